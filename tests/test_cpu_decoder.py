"""The CPU decoder's layers in one C call (``cpu_decoder``) give the bits of the torch loop it
replaces (``LlamaModel.forward``'s per-layer ops), step by step: for random steps of several
conversations (prefill chunks, decode rows, verify windows, in any mix), on one and two threads,
with every build of the three C kernels (AVX-512, AVX2, plain C vectors), and under torch's
other CPU capabilities (its kernels round differently there: the C follows them).

The model is test_cached_equals_uncached's small GGUF (two layers, GQA, head dim 64, Q4_0/Q4_1
layers, Q8_0 embedding), loaded packed with bf16 KV rows, as the default CPU path runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cached_equals_uncached import ISAS, builds, tiny  # noqa: F401 (builds, tiny: fixtures)

from turnkv import cbuild
from turnkv.attention import cpu_native
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.step import Window
from turnkv.models import cpu_decoder, cpu_int4

pytestmark = pytest.mark.skipif(
    cpu_decoder.library() is None or cpu_native.library() is None or cpu_int4.library() is None,
    reason=f"no C kernels: {cpu_decoder.status()}, {cpu_native.status()}, {cpu_int4.status()}",
)

KERNELS = (cpu_native, cpu_int4, cpu_decoder)


@pytest.fixture(scope="module")
def engine(tiny):  # noqa: F811 (the imported fixture)
    """test_cached_equals_uncached's small model, packed, bf16 KV rows, one thread."""
    return tiny["segmented"]


@pytest.fixture(scope="module")
def engine_fp32_kv(engine):
    """The same model with fp32 KV rows (``--kv-dtype float32``)."""
    eng = Engine(engine.loaded, EngineConfig(device="cpu", threads=1, kv_dtype="float32"))
    assert eng.shape.dtype == torch.float32
    return eng


@pytest.fixture(scope="module")
def all_builds(builds, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """test_cached_equals_uncached's builds of the attention and matmul kernels (``builds``), each
    with the decoder's build for the same ISA."""
    out = {"native": (*builds["native"], cpu_decoder.library())}
    root = tmp_path_factory.mktemp("decoder")
    for name, libs in builds.items():
        if name == "native":
            continue
        so = root / f"cpu_decoder-{name}.so"
        flags = [*cbuild.FLAGS, *cbuild.OPENMP, ISAS[name], *cpu_decoder.KERNEL.flags]
        subprocess.run(
            ["cc", *flags, str(cpu_decoder.SOURCE), "-o", str(so)], check=True, capture_output=True
        )
        lib = ctypes.CDLL(str(so))
        cpu_decoder._setup(lib)
        out[name] = (*libs, lib)
    return out


@contextlib.contextmanager
def kernels(libs, decoder: bool, threads: int):
    """These builds of the kernels, the layers in C (``decoder``) or the torch loop, ``threads``."""
    saved = [(k.KERNEL.lib, k.KERNEL.why) for k in KERNELS]
    before = torch.get_num_threads()
    try:
        for k, lib in zip(KERNELS, libs, strict=True):
            k.KERNEL.lib, k.KERNEL.why = lib, "ok"
        if not decoder:
            cpu_decoder.KERNEL.lib, cpu_decoder.KERNEL.why = None, "off (test)"
        torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(before)
        for k, (lib, why) in zip(KERNELS, saved, strict=True):
            k.KERNEL.lib, k.KERNEL.why = lib, why


def run_script(engine: Engine, script: dict) -> list[torch.Tensor]:
    """The steps of ``script`` on fresh caches: each conversation's history prefilled alone, then
    ``steps`` steps in which every conversation sends a window of its kind -> every step's logits."""
    rng = np.random.default_rng(script["seed"])
    caches = []
    out = []
    for history in script["histories"]:
        cache = engine.new_cache()
        if history:
            ids = rng.integers(0, 256, history).tolist()
            out.append(engine.run_step([Window(cache, ids, logits=1)]).logits)
            cache.commit(ids)
        caches.append(cache)
    for _ in range(script["steps"]):
        windows = []
        for cache, kind in zip(caches, script["kinds"], strict=True):
            n = {"decode": 1, "verify": int(rng.integers(2, 9)), "prefill": int(rng.integers(20, 70))}[kind]
            windows.append(
                Window(cache, rng.integers(0, 256, n).tolist(), logits=1 if kind != "verify" else n)
            )
        out.append(engine.run_step(windows).logits)
        for cache, w in zip(caches, windows, strict=True):
            cache.commit(w.tokens)
    return out


scripts = st.integers(1, 4).flatmap(
    lambda n: st.fixed_dictionaries(
        {
            "seed": st.integers(0, 2**16),
            "histories": st.lists(st.integers(0, 300), min_size=n, max_size=n),
            "kinds": st.lists(
                st.sampled_from(["decode", "decode", "verify", "prefill"]), min_size=n, max_size=n
            ),
            "steps": st.integers(1, 4),
            "threads": st.sampled_from([1, 2]),
        }
    )
)

EXAMPLES = {"native": 25, "avx2": 12, "plain-c": 6}


def check_script(engine: Engine, libs, script: dict) -> None:
    with kernels(libs, decoder=True, threads=script["threads"]):
        assert cpu_decoder.for_model(engine.model) is not None, cpu_decoder.why(engine.model)
        got = run_script(engine, script)
    with kernels(libs, decoder=False, threads=script["threads"]):
        assert cpu_decoder.for_model(engine.model) is None
        want = run_script(engine, script)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {i}: max |diff| {(g - w).abs().max().item()}"


@pytest.mark.parametrize("isa", list(ISAS))
def test_the_c_layers_give_the_torch_loops_bits(engine, all_builds, isa):
    if isa not in all_builds:
        pytest.skip(f"no {isa} build here")
    settings(max_examples=EXAMPLES[isa], deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(script=scripts)(lambda script: check_script(engine, all_builds[isa], script))
    )()


def test_fp32_kv_rows_too(engine_fp32_kv, all_builds):
    settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(script=scripts)(lambda script: check_script(engine_fp32_kv, all_builds["native"], script))
    )()


@pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY") is not None, reason="(the run under another capability)"
)
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_under_torchs_other_cpu_capabilities(capability):
    """torch's DEFAULT kernels fuse no multiply-add and take libm's expf, its AVX2 ones block silu
    by 16 floats: the C follows the capability torch runs, so the bits stay the loop's there too."""
    if capability == "avx2" and "avx2" not in cbuild._cpu_flags():
        pytest.skip("no AVX2 here")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    here = Path(__file__)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(here),
            "-k",
            "native",
        ],
        env=env,
        cwd=here.parent.parent,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout, run.stdout[-2000:]


def test_a_model_the_c_does_not_cover_keeps_the_loop_and_says_why(engine):
    """A layer weight that is not packed for the C matmul (here a plain fp32 tensor) is refused,
    and the model is bound again once its weight is back."""
    model = engine.model
    layer = model.layers[0]
    packed = layer.o
    try:
        del layer.o
        layer.o = torch.nn.Parameter(torch.zeros(packed.shape), requires_grad=False)
        assert cpu_decoder.for_model(model) is None
        assert cpu_decoder.why(model) == "a layer weight not packed for the C matmul"
    finally:
        del layer.o
        layer.o = packed
    assert cpu_decoder.for_model(model) is not None
    assert cpu_decoder.why(model) == "ok"

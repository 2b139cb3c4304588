"""The CPU attention in C (``turnkv/attention/cpu_native.py``) as a spec.

Against the fp32 oracle (``reference.py``) at 1e-5; and bit for bit against itself: a row's result
is the same alone, inside a verify window or a prefill chunk (cut into row blocks), among other
windows, split over threads, and whether its keys lie in one view or several (segmented ==
contiguous).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from turnkv.attention import cpu_native
from turnkv.attention.portable import PortableBackend
from turnkv.attention.reference import reference_attention
from turnkv.attention.routes import Path
from turnkv.attention.verdict import Verdict
from turnkv.kv.cache import KVWindow
from turnkv.runtime import new_bank

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason=f"no C kernel: {cpu_native.status()}")


def _views(hkv, lengths, d, dtype, seed, layers=2):
    """``(k, v)`` views ``[L, Hkv, T_i, D]`` sliced from larger buffers (strides as a cache's)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        k, v = torch.randn(2, layers, hkv, n + 3, d, generator=g).to(dtype)
        out.append((k[:, :, :n], v[:, :, :n]))
    return out


def _run(windows, hq, d, layer=1, threads=1, q=None, seed=0):
    """windows: ``(views, ws, m)``, their items cut over ``threads``; returns (q, out), each ``[N, Hq, D]``."""
    n = sum(m for _, _, m in windows)
    if q is None:
        q = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(seed))
    rows, starts = 0, []
    for _, _, m in windows:
        starts.append(rows)
        rows += m
    step = cpu_native.NativeStep(
        [(s, v, ws, m) for s, (v, ws, m) in zip(starts, windows, strict=True)], threads
    )
    out = torch.full((n, hq, d), float("nan"))
    step.attend(layer, q, out, d**-0.5)
    return q, out


def _truncated(views, n):
    """The first ``n`` keys of ``views``, as the views a decode row at key n - 1 has."""
    out, left = [], n
    for k, v in views:
        take = min(left, k.shape[2])
        if take:
            out.append((k[:, :, :take], v[:, :, :take]))
        left -= take
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1], [7], [5, 9], [1, 0, 13, 3], [16] * 5, [300, 17]])
@pytest.mark.parametrize("m", [1, 4, 32, 70])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (32, 8, 32)])
def test_equals_the_fp32_reference(dtype, lengths, m, hq, hkv, d):
    """Window-causal attention over all views (the last holds the window's m rows) in fp32."""
    lengths = [*lengths[:-1], lengths[-1] + m]
    views = _views(hkv, lengths, d, dtype, seed=len(lengths) + m)
    ws = sum(lengths) - m
    q, out = _run([(views, ws, m)], hq, d)
    layer_views = [(k[1].float(), v[1].float()) for k, v in views]
    ref = reference_attention(q.transpose(0, 1), layer_views, d**-0.5).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2), (4, 4)])
def test_a_row_is_the_same_bits_alone_in_a_verify_window_and_in_company(dtype, hq, hkv):
    """Speculation's, batching's and the cache's exactness: row i of a verify window or a prefill
    chunk (several row blocks) equals that row decoded alone over its keys; a window's rows equal
    the window alone, whatever else shares the step and however its items are cut over threads."""
    rnd = random.Random(7)
    d = 64
    windows = []
    for seed in range(7):
        lengths = [rnd.randint(1, 200) for _ in range(rnd.randint(1, 4))]
        m = [1, 1, 3, 8, 32, 33, 75][seed]
        lengths[-1] += m
        windows.append((_views(hkv, lengths, d, dtype, seed), sum(lengths) - m, m))
    q, together = _run(windows, hq, d, threads=3)
    assert torch.isfinite(together).all()
    row = 0
    for views, ws, m in windows:
        _, alone = _run([(views, ws, m)], hq, d, q=q[row : row + m])
        assert torch.equal(together[row : row + m], alone)
        for i in range(m):  # each row as a one-row decode window over the keys it sees
            _, one = _run([(_truncated(views, ws + i + 1), ws + i, 1)], hq, d, q=q[row + i : row + i + 1])
            assert torch.equal(alone[i], one[0]), i
        row += m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_equals_contiguous_bit_for_bit(dtype):
    """The same keys in one view or cut into turns' views give the same bits (the sums run key
    after key, never view by view)."""
    hq, hkv, d, m = 9, 3, 64, 4
    (k, v) = _views(hkv, [517 + m], d, dtype, seed=3)[0]
    cuts = [0, 5, 6, 200, 333, 517 + m]
    pieces = [(k[:, :, a:b], v[:, :, a:b]) for a, b in itertools.pairwise(cuts)]
    q, one = _run([([(k, v)], 517, m)], hq, d)
    _, many = _run([(pieces, 517, m)], hq, d, q=q)
    assert torch.equal(one, many)


def test_the_portable_step_runs_every_cpu_window_in_c():
    """A ragged CPU step: decode, verify and prefill windows (a first chunk, a chunk after a
    segment, several row blocks) all in one C call, in one output in row order; only views the
    kernel cannot read (float16) are left to torch ops."""
    hq, hkv, d = 9, 3, 64
    shapes = [([40], 1), ([8, 3], 4), ([2, 30], 40), ([0], 70), ([50], 33)]
    windows = []
    for seed, (lengths, m) in enumerate(shapes):
        views = _views(hkv, [*lengths[:-1], lengths[-1] + m], d, torch.float32, seed)
        windows.append(KVWindow(tuple(views), sum(lengths), m))
    step = PortableBackend(Verdict(), torch.float32).plan(windows)
    assert step.native is not None and step.others == []
    assert all(r.path is Path.NATIVE for r in step.routes)
    n = sum(w.rows for w in windows)
    q = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(1))
    out = step.attend(1, q, d**-0.5)
    row = 0
    for w in windows:
        ref = reference_attention(q[row : row + w.rows].transpose(0, 1), w.layer_views(1), d**-0.5)
        torch.testing.assert_close(out[row : row + w.rows], ref.transpose(0, 1), atol=1e-5, rtol=1e-5)
        row += w.rows
    half = KVWindow(tuple(_views(hkv, [45], d, torch.float16, 9)), 5, 40)
    mixed = PortableBackend(Verdict(), torch.float32).plan([windows[0], half])
    assert mixed.others == [1] and [r.path for r in mixed.routes] == [Path.NATIVE, Path.LSE]


def test_off_and_build_failures_fall_back_to_torch_ops_with_the_reason(monkeypatch):
    monkeypatch.setattr(cpu_native.KERNEL, "lib", None)
    monkeypatch.setattr(cpu_native.KERNEL, "why", None)
    monkeypatch.setenv("TURNKV_CPU_KERNEL", "off")
    assert cpu_native.library() is None and cpu_native.status() == "off (TURNKV_CPU_KERNEL)"
    monkeypatch.setattr(cpu_native.KERNEL, "why", None)
    monkeypatch.delenv("TURNKV_CPU_KERNEL")
    monkeypatch.setenv("CC", "no-such-compiler-turnkv")
    assert cpu_native.library() is None
    assert "no C compiler" in cpu_native.status() and "no-such-compiler-turnkv" in cpu_native.status()
    windows = [KVWindow(tuple(_views(2, [9], 16, torch.float32, 0)), 8, 1)]
    assert PortableBackend(Verdict(), torch.float32).plan(windows).native is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_store_writes_what_torch_writes(dtype):
    """The step's new rows go into each window's last view in one call, the same bits as torch's
    copy (bf16: round to nearest even, ties included) and nothing else of the cache changes."""
    hkv, d, layer = 3, 64, 1
    shapes = [([5, 9], 1), ([40], 4), ([1], 32)]
    ours, theirs = [], []
    for seed, (lengths, m) in enumerate(shapes):
        views = _views(hkv, [*lengths[:-1], lengths[-1] + m], d, dtype, seed)
        ours.append(KVWindow(tuple((k.clone(), v.clone()) for k, v in views), sum(lengths), m))
        theirs.append(KVWindow(tuple(views), sum(lengths), m))
    n = sum(w.rows for w in ours)
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(n, 2 * hkv + 3, d, generator=g)  # strided k and v, as the model's split gives
    kv[0, 0, :8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, 0.0, -0.0, 1e38, -1e-40])
    k, v = kv[:, :hkv], kv[:, hkv + 3 :]
    step = cpu_native.NativeStep(
        [(s, w.views, w.start, w.rows) for s, w in zip([0, 1, 5], ours, strict=True)]
    )
    assert step.store(layer, k, v)
    row = 0
    for a, b in zip(ours, theirs, strict=True):
        b.write(layer, k[row : row + b.rows].transpose(0, 1), v[row : row + b.rows].transpose(0, 1))
        for (ka, va), (kb, vb) in zip(a.views, b.views, strict=True):
            assert torch.equal(ka.view(torch.uint8), kb.view(torch.uint8))
            assert torch.equal(va.view(torch.uint8), vb.view(torch.uint8))
        row += b.rows
    assert not step.store(layer, k.bfloat16(), v)  # only fp32 rows; the caller then writes them


@pytest.mark.slow
def test_the_default_model_answers_alike_with_the_kernel_and_with_torch_ops(default_model, monkeypatch):
    """End to end through the scheduler: the default prompt's greedy answer (every step through the
    C kernel or, switched off, through torch ops: prefill through torch's flash kernel)."""
    from turnkv.config import EngineConfig
    from turnkv.engine.engine import Engine
    from turnkv.engine.events import GenEvent, TurnRequest
    from turnkv.engine.sampling import SamplingParams
    from turnkv.engine.scheduler import Scheduler, run_turn

    engine = Engine(default_model, EngineConfig())
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    )
    answers = {}
    for kernel in ("c", "torch"):
        if kernel == "torch":
            monkeypatch.setattr(cpu_native.KERNEL, "lib", None)
            monkeypatch.setattr(cpu_native.KERNEL, "why", "off (test)")
        req = TurnRequest(list(ids), SamplingParams(), max_tokens=24, namespace=kernel)
        bank = new_bank(engine, "256M")
        answers[kernel] = "".join(
            e.text for e in run_turn(Scheduler(engine, bank, max_running=1), req) if isinstance(e, GenEvent)
        )
    assert answers["c"] == answers["torch"] and "Paris" in answers["c"]

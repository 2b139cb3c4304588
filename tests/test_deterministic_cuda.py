"""``--deterministic on`` on CUDA (issue 33): a turn's logits are the same bits whether its prompt
ran in one window alone or in prefill chunks of any size beside 0-7 other conversations (decode,
verify and prefill windows), and so is its greedy text; and so are the company's own rows. Random
weights (``random:test``) in bf16, the fused attention and CUDA graphs as the engine picks them.
Skipped without a GPU.

Every kept logit row is a tensor of its own (``graphs.StepGraphs._result``): before, a kept row was
a view of its graph's output buffer, which the companions' own prefills (the same graph key as a
narrow prompt window's) rewrote, and the comparison failed in both modes (the issue's H200 run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from test_cached_equals_uncached import SIZES, company_of, greedy, run_windows  # noqa: E402

from turnkv.config import EngineConfig  # noqa: E402
from turnkv.engine.engine import Engine  # noqa: E402
from turnkv.engine.step import Window  # noqa: E402
from turnkv.models.load import load_model  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    loaded = load_model("random:test", "cuda", "bfloat16", progress=False)
    e = Engine(loaded, EngineConfig(device="cuda", dtype="bfloat16", deterministic="on", no_disk=True))
    assert e.rowinv and e.deterministic_health()["matmul"] == "triton_rowinv"
    return e


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.integers(1, 400),
    st.integers(0, 2**16),
    st.lists(st.sampled_from(SIZES), min_size=1, max_size=3),
    st.lists(st.sampled_from(["decode", "verify", "prefill"]), max_size=7),
)
@example(17, 1, [17], ["decode"] * 7)  # the H200 diagnosis's failing case (issue 33)
def test_a_turns_bits_do_not_depend_on_chunks_or_company(engine, length, seed, sizes, kinds):
    ids = np.random.default_rng(seed).integers(0, 256, length).tolist()
    fresh = engine.new_cache()
    alone = run_windows(engine, fresh, ids, [length], [])
    alone_text, alone_logits = greedy(engine, fresh, alone, [])
    cache = engine.new_cache()
    company = company_of(engine, kinds, seed)
    got = run_windows(engine, cache, ids, sizes, company)
    text, logits = greedy(engine, cache, got, company)
    assert torch.equal(got, alone)
    assert text == alone_text
    assert torch.equal(logits, alone_logits)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.integers(1, 120),
    st.integers(0, 2**16),
    st.lists(st.sampled_from(["decode", "verify", "prefill"]), min_size=1, max_size=7),
)
@example(17, 1, ["decode"] * 7)
def test_the_companys_rows_are_the_bits_they_have_alone(engine, length, seed, kinds):
    """Each companion's logits beside a prompt (and the others) equal its same windows run alone."""
    ids = np.random.default_rng(seed).integers(0, 256, length).tolist()
    company = company_of(engine, kinds, seed)
    seen: list[list[tuple[list[int], int, torch.Tensor]]] = [[] for _ in company]
    cache = engine.new_cache()
    for at in range(0, length, 16):  # the prompt in chunks of 16, then its first decode row
        chunk = ids[at : at + 16]
        others = [c.window() for c in company]
        res = engine.run_step([Window(cache, chunk, logits=1), *others])
        cache.commit(chunk)
        for j, (c, w) in enumerate(zip(company, others, strict=True)):
            c.cache.commit(w.tokens)
            seen[j].append((w.tokens, w.logits, res.of(j + 1)))
    for j, alone in enumerate(company_of(engine, kinds, seed)):  # the same histories, fresh caches
        for tokens, logits, got in seen[j]:
            res = engine.run_step([Window(alone.cache, tokens, logits=logits)])
            alone.cache.commit(tokens)
            assert torch.equal(res.of(0), got), (kinds[j], len(tokens))

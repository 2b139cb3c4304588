"""``--deterministic on`` on CUDA (issue 33): a turn's logits are the same bits whether its prompt
ran in one window alone or in prefill chunks of any size beside 0-7 other conversations (decode,
verify and prefill windows), and so is its greedy text. Random weights (``random:test``) in bf16,
the fused attention and CUDA graphs as the engine picks them. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from test_cached_equals_uncached import SIZES, company_of, greedy, run_windows  # noqa: E402

from turnkv.config import EngineConfig  # noqa: E402
from turnkv.engine.engine import Engine  # noqa: E402
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

"""A verify window on the fused route runs as one-row windows (``step.one_row_windows``): each
row's attention is bit for bit that row decoded alone -- the same keys, split the same way
(``fused.conversations``: a decode launch's split count follows its conversations, not its
windows) -- alone in its step and beside another conversation's decode row. On CUDA the matmuls
of a ``solo`` step take the one-row GEMV for every row (tests/test_triton_gemv.py), so the whole
step is exact there; tests/test_graphs.py replays such steps. The kernels run through Triton's CPU
interpreter in CI, compiled on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

from turnkv.attention.segment_table import key_bucket  # noqa: E402
from turnkv.attention.triton_segments import decode_splits  # noqa: E402
from turnkv.config import EngineConfig  # noqa: E402
from turnkv.engine.engine import Engine  # noqa: E402
from turnkv.engine.step import Window, one_row_windows, plan_step  # noqa: E402
from turnkv.runtime import load_engine  # noqa: E402

HISTORY = 300  # rows before the window
K = 5  # the window: the current token and 4 drafts


@pytest.fixture(scope="module")
def engine() -> Engine:
    cfg = EngineConfig(
        model="random:test",
        device="cuda" if CUDA else "cpu",
        dtype="bfloat16",
        attention="fused",
        speculate="off",
    )
    engine = load_engine(cfg)
    assert engine.backend.name == "fused"
    return engine


def conversation(engine: Engine, seed: int, rows: int):
    """A cache of ``rows`` prefilled rows, trimmed back by ``K``: the window's own K/V rows stay in
    the tail's buffer (as a verify step writes them before it attends)."""
    gen = torch.Generator().manual_seed(seed)
    cache = engine.new_cache()
    cache.presize(rows + 8)
    engine.prefill(cache, torch.randint(0, 250, (rows,), generator=gen).tolist())
    cache.trim(rows - K)
    return cache


def attend(engine: Engine, windows: list[Window], q: torch.Tensor, solo: bool = False) -> torch.Tensor:
    plan = plan_step(windows, engine.backend, engine.model.device, solo)
    return plan.attention.attend(0, q, engine.model.scale)  # [N, Hq, D]


def test_a_verify_windows_rows_attend_as_each_row_decoded_alone(engine):
    cache = conversation(engine, 0, HISTORY)
    cfg = engine.model.cfg
    q = torch.randn(K, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(engine.model.device, torch.bfloat16)
    rows, firsts = one_row_windows([Window(cache, [0] * K, logits=K)])
    assert firsts == [0] and [w.ahead for w in rows] == list(range(K))
    got = attend(engine, rows, q, solo=True)
    for i in range(K):
        alone = attend(engine, [Window(cache, [0], 1, ahead=i)], q[i : i + 1])
        assert torch.equal(got[i], alone[0]), i
    # what makes it so: the split count of one conversation, not of K sequences
    plan = plan_step(rows, engine.backend, engine.model.device)
    b = engine.backend
    one = decode_splits(1, key_bucket(HISTORY), b.kv_heads, b.gqa, b.head_dim, b.device)
    assert [lc.config.splits for lc in plan.attention.launches] == [one] == [b.decode_launch(plan.kv).splits]
    if not CUDA:  # the interpreter's 8 "SMs": K sequences would split otherwise (the test shows it)
        assert decode_splits(K, key_bucket(HISTORY), b.kv_heads, b.gqa, b.head_dim, b.device) != one


def test_beside_another_conversation_each_row_is_that_row_decoded_in_the_same_company(engine):
    cache, other = conversation(engine, 2, HISTORY), conversation(engine, 3, HISTORY + 40)
    cfg = engine.model.cfg
    q = torch.randn(K + 1, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(4))
    q = q.to(engine.model.device, torch.bfloat16)
    rows, firsts = one_row_windows([Window(other, [0], 1), Window(cache, [0] * K, logits=K)])
    assert firsts == [0, 1]
    got = attend(engine, rows, q)
    for i in range(K):
        pair = attend(engine, [Window(other, [0], 1), Window(cache, [0], 1, ahead=i)], q[[0, 1 + i]])
        assert torch.equal(got[0], pair[0]) and torch.equal(got[1 + i], pair[1]), i


def test_the_engine_runs_a_verify_window_as_one_row_windows_and_reports_it_per_window(engine):
    from turnkv.engine.step import run_plan

    cache, other = conversation(engine, 5, HISTORY), conversation(engine, 6, HISTORY)
    asked = [Window(other, [7], 1), Window(cache, [8, 9, 10, 11, 12], logits=K)]
    res = engine.run_step(asked)
    assert res.plan.windows == asked and res.plan.logit_offsets == [0, 1] and len(res.plan.labels) == 2
    assert res.of(0).shape[0] == 1 and res.of(1).shape[0] == K
    rows, _ = one_row_windows(asked)
    want = run_plan(engine.model, plan_step(rows, engine.backend, engine.model.device))
    assert torch.equal(res.logits, want)

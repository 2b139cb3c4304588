"""The host side of a captured step (engine/graphs.py), without a GPU: the row buckets a step with
prompt rows is captured at, and its inputs laid out for the graph's padded rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnkv.attention.segment_table import ROW_BUCKETS, row_bucket
from turnkv.engine.graphs import GraphStep, StepGraphs, padded_inputs
from turnkv.engine.step import Window, host_inputs
from turnkv.kv.cache import KVWindow
from turnkv.models.matmul import MatmulPlan


@given(st.integers(1, 9000))
def test_a_step_pads_to_the_first_bucket_that_holds_it_and_by_at_most_half(n):
    b = row_bucket(n)
    if n > ROW_BUCKETS[-1]:
        assert b is None  # runs eagerly
        return
    assert b >= n and (b == ROW_BUCKETS[0] or b <= 1.5 * n)
    assert all(s < n for s in ROW_BUCKETS if s < b)


class _Cache:
    """What ``host_inputs`` reads of a window: nothing but its tokens and KV start."""


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 1), st.integers(0, 500), st.booleans()), min_size=1,
             max_size=12),
    st.integers(0, 64),
    st.integers(0, 8),
)  # fmt: skip
def test_padded_inputs_keep_every_real_word_where_the_graph_reads_it(shape, extra_rows, extra_logits):
    windows, kv = [], []
    for i, (m, asks, start, fed) in enumerate(shape):
        logits = min(asks, m) if m > 1 else 1
        tokens = [(7 * i + j) % 97 for j in range(m)]
        windows.append(Window(_Cache(), tokens, logits, feed=i if fed else None))
        kv.append(KVWindow((), start, m))
    words, n, offsets, _ = host_inputs(windows, kv)
    r = sum(w.logits for w in windows)
    np_, rp = n + extra_rows, r + extra_logits
    out = torch.tensor(padded_inputs(words, n, r, np_, rp))
    ids, pos, rows, feeds = out[:np_], out[np_ : 2 * np_], out[2 * np_ : 2 * np_ + rp], out[2 * np_ + rp :]
    assert ids[:n].tolist() == [t for w in windows for t in w.tokens] and not ids[n:].any()
    assert pos[:n].tolist() == [p for k in kv for p in range(k.start, k.start + k.rows)] and not pos[n:].any()
    assert rows[:r].tolist() == words[2 * n : 2 * n + r] and not rows[r:].any()  # pad logit rows read row 0
    fed = [i for i, w in enumerate(windows) if w.feed is not None]
    assert feeds.tolist() == words[2 * n + r :] and len(feeds) == 2 * len(fed)
    # each fed window's first row is where its carried id lands
    starts = [sum(len(w.tokens) for w in windows[:i]) for i in range(len(windows))]
    assert feeds[: len(fed)].tolist() == [starts[i] for i in fed]
    assert all(rows[offsets[i]] < n for i in range(len(windows)) if windows[i].logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_replays_logits_are_the_callers_own_not_the_graphs_buffer(dtype):
    """A graph's output buffer is rewritten by its next replay (issue 33: a test's reference row,
    kept across steps, changed under it): the step's fp32 logits are a tensor of their own, the
    real rows of the buffer upcast (bf16: the upcast every step makes anyway)."""
    windows = [Window(_Cache(), [3], 1), Window(_Cache(), [4, 5], 1)]
    kv = [KVWindow((), 9, 1), KVWindow((), 0, 2)]
    staged = GraphStep(windows, kv, (4, 4, None, False), None, None, 0, 3, 2, [0, 1])
    buffer = torch.randn(4, 8).to(dtype)  # [padded logit rows, V] in the compute dtype
    inputs = torch.zeros(16, dtype=torch.int64)
    res = StepGraphs._result(staged, buffer, inputs[:4], inputs[4:8], inputs[8:12], MatmulPlan())
    want = buffer[:2].float().clone()
    buffer.fill_(7.0)  # the next replay of this graph
    assert res.logits.dtype == torch.float32 and torch.equal(res.logits, want)
    assert res.of(1).shape == (1, 8)

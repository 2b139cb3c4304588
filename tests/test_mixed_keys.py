"""The mixed graph keys a step can take are the ones ``engine.mixed_keys`` enumerates (CPU: the
keys are host arithmetic; ``FusedBackend.mixed_launch`` over real windows is the oracle).

Random steps within a scheduler's limits (decode rows, verify windows cut into one-row windows,
short prompt chunks and prefill chunks; at most ``running`` conversations and ``budget`` rows):
the key ``StepGraphs.stage`` gives each is in ``shapes(budget, running)``'s keys, and the same
step shape over another context or with its chunk sizes moved within the step is the same key.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from turnkv.attention.fused import FusedBackend
from turnkv.attention.segment_table import row_bucket
from turnkv.attention.verdict import Verdict
from turnkv.engine.mixed_keys import key, shapes
from turnkv.kv.cache import KVWindow
from turnkv.limits import MAX_WINDOW_ROWS

HQ, HKV, D = 32, 8, 128  # llama3-8b's heads
DTYPE = torch.bfloat16
BACKEND = FusedBackend(Verdict(), HQ, HKV, D, "cpu")


def window(history: int, rows: int) -> KVWindow:
    """A window of ``rows`` rows after ``history`` (one view, zero-copy: ``expand``; the launch
    reads the views' dtype and count, the windows' rows)."""
    tail = torch.zeros(1, 1, 1, 1, dtype=DTYPE).expand(1, HKV, history + rows, D)
    return KVWindow(((tail, tail),), history, rows)


def staged_key(windows: list[KVWindow]):
    launch = BACKEND.mixed_launch(windows)
    if launch is None:
        return None
    return (row_bucket(sum(w.rows for w in windows)), launch.batch, launch, False)  # (StepGraphs)


conversation = st.one_of(
    st.tuples(st.just("decode"), st.just(1)),
    st.tuples(st.just("verify"), st.integers(2, MAX_WINDOW_ROWS)),
    st.tuples(st.just("short"), st.integers(2, MAX_WINDOW_ROWS)),
    st.tuples(st.just("chunk"), st.integers(MAX_WINDOW_ROWS + 1, 3000)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from([64, 200, 256, 512, 1000, 2048, 4096, 8192]),
    st.integers(1, 64),
    st.lists(conversation, min_size=1, max_size=64),
    st.integers(0, 40000),
)
def test_every_steps_key_is_one_the_enumeration_lists(budget, running, convs, history):
    convs = convs[:running]
    windows, total = [], 0
    for kind, rows in convs:
        if total + rows > budget:
            break
        if kind == "verify":  # cut into one-row windows over one tail (step.one_row_windows)
            windows += [window(history + j, 1) for j in range(rows)]
        else:
            windows.append(window(history, rows))
        total += rows
    if not any(w.rows > 1 for w in windows):  # a step with prompt rows
        return
    got = staged_key(windows)
    if got is None:  # more than 64 windows of a kind, or past 8192 rows: runs eagerly
        return
    listed = {key(BACKEND, s, DTYPE) for s in shapes(budget, running)}
    assert got in listed


def test_a_steps_key_holds_no_context_and_no_chunk_size():
    # 7 decode rows beside one chunk, at 3K and 30K keys, the chunk 100 or 180 rows of a
    # 192-row step: one key (so one graph, captured once, serves them all)
    keys = set()
    for history in (3000, 30000):
        for chunk in (100, 180):
            windows = [window(history, 1) for _ in range(7)] + [window(history, chunk)]
            keys.add(staged_key(windows))
    assert len(keys) == 2  # (100 + 7 rows: the 128 bucket; 187: the 192 bucket)
    assert {k[0] for k in keys} == {128, 192}


def test_the_warm_up_counts_the_possible_keys_it_captured():
    from types import SimpleNamespace

    from turnkv.engine.warmup import mixed_coverage

    engine = SimpleNamespace(shape=SimpleNamespace(dtype=DTYPE))
    sched = SimpleNamespace(max_batch_tokens=256, max_running=8, engine=engine)
    possible = shapes(256, 8)
    some = sorted(possible, key=str)[:5]
    held = {key(BACKEND, s, DTYPE): None for s in some} | {(8, 8, 4, False): None}  # + a decode graph
    graphs = SimpleNamespace(capture=True, backend=BACKEND, graphs=held)
    assert mixed_coverage(sched, graphs) == {"possible": len(possible), "captured": 5}
    assert mixed_coverage(sched, SimpleNamespace(status="off: no CUDA (cpu)")) == {}

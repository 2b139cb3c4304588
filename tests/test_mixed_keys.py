"""The mixed graph keys a step can take are the ones ``engine.mixed_keys`` enumerates (CPU: the
keys are host arithmetic; ``FusedBackend.mixed_launch`` over real windows is the oracle).

The enumeration is small enough for the warm-up to capture every key (``MIXED_BATCHES``), and
``layout`` gives a step of each shape that stages to exactly that shape's key.

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
from turnkv.engine.mixed_keys import key, layout, shapes
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


def parts_windows(parts, history: int) -> list[KVWindow]:
    """``layout``'s parts as the windows the backend plans (a verify part cut into one-row windows)."""
    out: list[KVWindow] = []
    for p in parts:
        out += [window(history + j, 1) for j in range(p.rows)] if p.verify else [window(history, p.rows)]
    return out


@pytest.mark.parametrize(
    "budget,running", [(64, 64), (256, 8), (1024, 64), (1000, 3), (2048, 64), (8192, 64)]
)
def test_every_listed_shape_has_a_step_that_stages_to_its_key(budget, running):
    listed = shapes(budget, running)
    # few enough to capture them all before ready (at 2048 rows and 64 running the old
    # power-of-two tables listed 786 keys; the classes 209)
    assert len(listed) <= 300
    made = 0
    for shape in listed:
        parts = layout(shape, budget, running)
        if parts is None:
            continue
        made += 1
        assert len(parts) <= running
        assert sum(p.rows for p in parts) <= budget
        assert any(p.rows > 1 and not p.verify for p in parts) or any(p.logits == 0 for p in parts)
        assert staged_key(parts_windows(parts, 3000)) == key(BACKEND, shape, DTYPE), shape
    # with room for the conversations, every shape has a step (the warm-up captures all of them)
    assert made == len(listed) or running < 16


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


@pytest.mark.parametrize("budget,running", [(256, 8), (1024, 64)])
def test_the_warm_up_captures_every_possible_mixed_key(budget, running):
    # ``capture_mixed`` runs a step of each listed shape not captured yet; an engine whose steps
    # stage as the fused backend plans them (verify windows cut into one-row windows) and record
    # their key as captured ends the warm-up with every possible key captured (or, where too few
    # conversations may run for a shape's fewest windows, all but those)
    from types import SimpleNamespace

    from turnkv.engine.warmup import capture_mixed, mixed_coverage

    graphs = SimpleNamespace(capture=True, backend=BACKEND, graphs={})
    ran = []

    class Engine:
        loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=256))
        shape = SimpleNamespace(device=torch.device("cuda"), dtype=DTYPE)

        def __init__(self):
            self.graphs = graphs

        def new_cache(self):
            return object()

        def warm_step(self, windows):
            assert len({id(w.cache) for w in windows}) == len(windows)  # one window a conversation
            kv = []
            for w in windows:
                cut = w.logits == len(w.tokens) > 1  # a verify window (``Window.verifies``)
                kv += (
                    [window(3000 + j, 1) for j in range(len(w.tokens))]
                    if cut
                    else [window(3000, len(w.tokens))]
                )
            ran.append(staged_key(kv))
            graphs.graphs[ran[-1]] = None

    sched = SimpleNamespace(engine=Engine(), max_batch_tokens=budget, max_running=running)
    graphs.graphs[key(BACKEND, min(shapes(budget, running), key=str), DTYPE)] = None  # met by a turn before
    steps = capture_mixed(sched)
    assert steps == len(ran) == len(set(ran))  # no key twice, none already captured
    cov = mixed_coverage(sched, graphs)
    missing = [s for s in shapes(budget, running) if layout(s, budget, running) is None]
    assert cov == {"possible": len(shapes(budget, running)), "captured": cov["possible"] - len(missing)}
    assert running < 16 or not missing

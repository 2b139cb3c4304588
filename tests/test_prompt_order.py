"""The prompt order (``engine/prompt_order.py``): shortest first, aged. The order itself (ties,
aging, and that a prompt admitted long enough after another never goes before it), and through
the real scheduler on ``random:test``, for any arrival order and lengths: every prompt's last row
is computed within the order's bound (no starvation), and a short follow-up on a cached history
gets its first token in the step it is admitted, however many long first turns came before it."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from order_helpers import last_row_bound, record

from turnkv.config import EngineConfig
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.prompt_order import AGE_ROWS, order, prompt_key
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler, run_turn
from turnkv.runtime import load_engine, new_bank

CHUNK = 64  # --prefill-chunk of the engine below
BUDGET, RUNNING = 64, 8  # --max-batch-tokens, --max-running of the schedulers below
FEWEST = min(BUDGET - (RUNNING - 1), CHUNK)  # prompt rows of a step with a prompt: at least this


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(
        model="random:test", device="cpu", dtype="float32", prefill_chunk=CHUNK, speculate="off"
    )
    return load_engine(cfg)


def test_shortest_first_ties_by_admission_and_the_old_catch_up():
    # (name, rows left, admitted at step)
    prompts = [("doc", 900, 0), ("long", 5000, 3), ("short", 10, 4), ("twin", 10, 4), ("mid", 300, 4)]

    def names(step: int) -> list[str]:
        return [p[0] for p in order(prompts, lambda p: p[1], lambda p: p[2], step)]

    assert names(4) == ["short", "twin", "mid", "doc", "long"]
    # 60 steps on, the document has waited long enough to go before a fresh 10-row prompt
    prompts.append(("fresh", 10, 64))
    assert prompt_key(900, 0, 64) < prompt_key(10, 64, 64)
    assert names(64) == ["short", "twin", "mid", "doc", "fresh", "long"]


@given(
    st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 200)), min_size=1, max_size=12),
    st.integers(0, 400),
)
def test_no_prompt_admitted_its_rows_over_age_steps_later_goes_first(prompts, extra):
    """For any prompts (rows left, admitted) at any later step, each prompt ``p`` goes before every
    prompt admitted ``ceil(rows_p / AGE_ROWS)`` or more steps after it."""
    step = max(a for _, a in prompts) + extra
    ranked = order(list(enumerate(prompts)), lambda p: p[1][0], lambda p: p[1][1], step)
    place = {i: k for k, (i, _) in enumerate(ranked)}
    for i, (rows, at) in enumerate(prompts):
        for j, (_, later) in enumerate(prompts):
            if later - at >= math.ceil(rows / AGE_ROWS):
                assert place[i] < place[j], (prompts, step, i, j)


def _request(n: int, answer: int, seed: int) -> TurnRequest:
    ids = [256, *((seed * 37 + i * 11) % 250 for i in range(n - 1))]
    return TurnRequest(ids, SamplingParams(ignore_eos=True), answer)


def _drive(sched, arrivals, make, turns, seen):
    """Submit ``make(i, rows, answer)`` at its arrival step (counted from now) and step until idle."""
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    start = sched.steps
    while pending or sched.busy:
        while pending and pending[0][1][0] <= sched.steps - start:
            i, (_, rows, answer) = pending.pop(0)
            turns[i] = sched.submit(make(i, rows, answer), lambda ev: None)
        sched.step()
        record(sched, turns, seen)
        assert sched.steps - start < 3000, "the scheduler did not finish"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(2, 400), st.integers(2, 6)), min_size=1, max_size=14)
)
def test_every_prompt_is_done_within_the_bound_for_any_arrival_order(engine, arrivals):
    """Arrivals (step, prompt rows, answer tokens), more turns than ``--max-running`` at times:
    every turn's last prompt row is computed within ``order_helpers.last_row_bound`` steps of its
    admission, and every turn ends."""
    sched = Scheduler(engine, new_bank(engine, "256M"), max_running=RUNNING, max_batch_tokens=BUDGET)
    turns, seen = {}, {}
    _drive(sched, arrivals, lambda i, n, a: _request(n, a, i), turns, seen)
    assert set(seen) == set(turns) and all(t.done for t in turns.values())
    everyone = list(seen.values())
    for i, p in seen.items():
        assert p.done is not None and p.done <= last_row_bound(p, everyone, FEWEST), (i, p, everyone)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(600, 900)), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 16)), min_size=1, max_size=3),
)
def test_a_short_follow_up_behind_long_first_turns_gets_its_first_token_at_once(engine, longs, follow):
    """Long first turns (600-900 rows: ten or more steps of the budget each) arrive at steps 0-2;
    follow-ups of 1-16 new rows on a banked 120-row history arrive at steps 1-6, behind them. Every
    follow-up's first token comes in the step it is admitted (in arrival order it would wait for
    the older first turns' rows: four steps at least), and every prompt meets the bound."""
    sched = Scheduler(engine, new_bank(engine, "256M"), max_running=RUNNING, max_batch_tokens=BUDGET)
    histories = []
    for k in range(len(follow)):  # each follow-up's first turn, banked before the load starts
        first = _request(120, 2, 500 + k)
        assert any(isinstance(ev, GenEvent) for ev in run_turn(sched, first))
        histories.append(first.prompt)
    arrivals = [(at, rows, 3) for at, rows in longs] + [(at, new, 3) for at, new in follow]

    def make(i: int, rows: int, answer: int) -> TurnRequest:
        if i < len(longs):
            return _request(rows, answer, i)
        new = [(i * 13 + j) % 250 for j in range(rows)]
        return TurnRequest(histories[i - len(longs)] + new, SamplingParams(ignore_eos=True), answer)

    turns, seen = {}, {}
    _drive(sched, arrivals, make, turns, seen)
    everyone = list(seen.values())
    for i, p in seen.items():
        assert p.done is not None and p.done <= last_row_bound(p, everyone, FEWEST), (i, p, everyone)
    for k, (_, new) in enumerate(follow):
        f = seen[len(longs) + k]
        assert f.rows <= new  # the history came from the bank: only the new rows are computed
        assert f.done == f.admitted, (f, everyone)

"""A turn whose restored rows are still copying in (a RAM-tier restore: ``Segment.ready``) sits
out of the steps while other turns can run, so their decoding overlaps the copy instead of
queueing behind it; once the copy is done it runs and answers what it would have anyway. Alone it
is taken at once: the device waits on the copy, the host never does. On ``random:test`` (CPU),
with a stand-in for the CUDA event."""

from __future__ import annotations

import pytest

from turnkv.config import EngineConfig
from turnkv.engine import turn as turn_mod
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.runtime import load_engine, new_bank

PROMPT = [256, *((5 + 3 * i) % 250 for i in range(47))]


@pytest.fixture(scope="module")
def engine():
    return load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", speculate="off"))


class Copy:
    """A copy's event that completes once the scheduler has run ``steps`` more steps (never: None)."""

    def __init__(self, sched: Scheduler, steps: int | None) -> None:
        self.sched, self.until = sched, None if steps is None else sched.steps + steps

    def query(self) -> bool:
        return self.until is not None and self.sched.steps >= self.until


def tokens(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, GenEvent) and e.token_id is not None]


def run(engine, monkeypatch, copy_steps: int | None, company: bool, marked: list | None = None):
    """Conversation ``a``'s first turn, then (beside a long answer of ``b`` when ``company``) its
    follow-up, whose restored segments get a pending copy of ``copy_steps`` steps (``marked``
    collects them). Returns (follow-up events, b events, per step: (follow-up tokens, b tokens))."""
    sched = Scheduler(engine, new_bank(engine, "64M"), max_running=4, max_batch_tokens=64)
    first: list = []
    sched.submit(TurnRequest(PROMPT, SamplingParams(ignore_eos=True), 4, namespace="a"), first.append)
    while sched.busy:
        sched.step()
    b: list = []
    if company:
        other = [256, *((11 + 7 * i) % 250 for i in range(20))]
        sched.submit(TurnRequest(other, SamplingParams(ignore_eos=True), 30, namespace="b"), b.append)
        for _ in range(3):
            sched.step()
    if marked is not None:
        start = turn_mod.Turn._start

        def start_marked(self, lease, slack):
            start(self, lease, slack)
            if self.request.namespace == "a" and lease.cached:  # the follow-up's restored rows
                for seg in self.cache.segments():
                    object.__setattr__(seg, "ready", Copy(sched, copy_steps))
                    marked.append(seg)

        monkeypatch.setattr(turn_mod.Turn, "_start", start_marked)
    follow: list = []
    ids = [*PROMPT, *tokens(first), *((9 + i) % 250 for i in range(10))]
    sched.submit(TurnRequest(ids, SamplingParams(ignore_eos=True), 6, namespace="a"), follow.append)
    seen = []
    while sched.busy:
        sched.step()
        seen.append((len(tokens(follow)), len(tokens(b))))
    monkeypatch.undo()
    return follow, b, seen


def test_a_restoring_turn_sits_out_while_others_decode_then_answers_as_without_the_copy(engine, monkeypatch):
    plain, plain_b, _ = run(engine, monkeypatch, None, company=True)
    marked: list = []
    follow, b, seen = run(engine, monkeypatch, 5, company=True, marked=marked)
    assert marked and all(seg.ready is None for seg in marked)  # joined once taken
    # the copy is pending for the follow-up's first 5 steps: no token of it, b decodes in each
    assert all(f == 0 for f, _ in seen[:5])
    assert [n for _, n in seen[:5]] == [seen[0][1] + i for i in range(5)]
    assert tokens(follow) == tokens(plain) and len(tokens(follow)) == 6
    assert tokens(b) == tokens(plain_b)


def test_alone_a_restoring_turn_is_taken_at_once(engine, monkeypatch):
    marked: list = []
    follow, _, seen = run(engine, monkeypatch, None, company=False, marked=marked)  # never completes
    assert marked and all(seg.ready is None for seg in marked)
    assert len(tokens(follow)) == 6 and len(seen) <= 8

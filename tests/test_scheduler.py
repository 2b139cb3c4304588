"""The scheduler without HTTP, on ``random:test`` (fast): the token budget, decode before prefill,
the prompt order (shortest first), no starvation, waiting instead of failing, the queue timeout, step observations."""

from __future__ import annotations

import time

import pytest

from turnkv.config import EngineConfig
from turnkv.engine.admission import activation_bytes
from turnkv.engine.engine import Engine
from turnkv.engine.events import Admitted, Failed, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.runtime import load_engine, new_bank


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", prefill_chunk=64))


def request(n: int, max_tokens: int = 4, start: int = 10) -> TurnRequest:
    return TurnRequest(
        [256, *((start + i) % 250 for i in range(n - 1))], SamplingParams(ignore_eos=True), max_tokens
    )


class Log:
    """Events per turn, and every step's windows as the scheduler reports them."""

    def __init__(self, sched: Scheduler) -> None:
        self.events: dict[int, list] = {}
        self.steps: list[tuple[int, int]] = []
        sched.pipeline.observe = lambda windows, rows, seconds: self.steps.append((windows, rows))

    def emit(self, i: int):
        self.events[i] = []
        return self.events[i].append

    def tokens(self, i: int) -> int:
        return sum(isinstance(e, GenEvent) and e.token_id is not None for e in self.events[i])


def test_a_long_prompt_never_stalls_the_others_decoding_for_more_than_one_chunk(engine):
    sched = Scheduler(engine, new_bank(engine, "256M"), max_running=8, max_batch_tokens=64)
    log = Log(sched)
    for i in range(3):
        sched.submit(request(10, max_tokens=40, start=i), log.emit(i))
    while not all(e.turn.phase == "decode" for e in sched.running) or len(sched.running) < 3:
        sched.step()
    sched.submit(request(600, max_tokens=2), log.emit(9))  # ten 64-row chunks of prefill
    before = {i: log.tokens(i) for i in range(3)}
    steps = 0
    while sched.waiting or any(e.turn.phase == "prefill" for e in sched.running):
        sched.step()
        steps += 1
    # every step of the long prefill also decoded one row of each of the three others
    assert all(log.tokens(i) - before[i] >= steps - 1 for i in range(3))
    assert max(rows for _, rows in log.steps) <= 64  # the token budget held
    while sched.busy:
        sched.step()
    assert all(log.tokens(i) == 40 for i in range(3)) and log.tokens(9) == 2


def test_prefill_goes_shortest_first_within_the_budget(engine):
    sched = Scheduler(engine, new_bank(engine, "256M"), max_running=8, max_batch_tokens=100)
    log = Log(sched)
    for i, n in enumerate((90, 90, 30)):
        sched.submit(request(n, start=7 * i), log.emit(i))
    sched.step()  # the third's 30 rows, a 64-row chunk (--prefill-chunk) of the first, 6 of the second
    assert log.steps[0] == (3, 100)
    first, second, third = (e.turn for e in sched.running)
    assert third.phase == "decode" and (first.cache.num_tokens, second.cache.num_tokens) == (64, 6)
    while sched.busy:
        sched.step()
    assert all(log.tokens(i) == 4 for i in range(3))


def test_max_running_caps_the_running_set_and_nobody_starves(engine):
    sched = Scheduler(engine, new_bank(engine, "256M"), max_running=2, max_batch_tokens=64)
    log = Log(sched)
    for i in range(7):
        sched.submit(request(12, max_tokens=3, start=3 * i), log.emit(i))
    while sched.busy:
        assert len(sched.running) <= 2
        sched.step()
    assert all(log.tokens(i) == 3 for i in range(7))
    assert max(windows for windows, _ in log.steps) == 2


def test_a_turn_that_fits_once_others_finish_waits_then_runs(engine):
    one = 140 * engine.shape.bytes_per_row + activation_bytes(
        engine.footprint, 40, 0
    )  # 40 prompt + 100 answer
    budget = one + 70 * engine.shape.bytes_per_row  # room for one turn, not two
    sched = Scheduler(engine, new_bank(engine, budget), max_running=8, max_batch_tokens=64)
    log = Log(sched)
    sched.submit(request(40, max_tokens=100, start=1), log.emit(0))
    sched.submit(request(40, max_tokens=100, start=99), log.emit(1))
    sched.step()
    assert len(sched.running) == 1 and len(sched.waiting) == 1  # the second waits, not a 507
    while sched.busy:
        sched.step()
    assert isinstance(log.events[1][0], Admitted) and log.tokens(1) == 100
    assert sched.bank.stats.refusals == 0


def test_a_turn_that_can_never_fit_is_refused_at_once_with_the_numbers(engine):
    sched = Scheduler(engine, new_bank(engine, 64 * 1024), max_running=8)
    log = Log(sched)
    sched.submit(request(200, max_tokens=50), log.emit(0))
    sched.step()
    [failed] = log.events[0]
    assert isinstance(failed, Failed) and failed.code == "kv_memory_exhausted"
    assert failed.needed_bytes > failed.available_bytes and not sched.busy


def test_a_waiting_turn_past_the_queue_timeout_fails_with_queue_timeout(engine):
    budget = 210 * engine.shape.bytes_per_row + activation_bytes(engine.footprint, 40, 0)  # one turn, not two
    sched = Scheduler(
        engine, new_bank(engine, budget), max_running=8, max_batch_tokens=64, queue_timeout=0.05
    )
    log = Log(sched)
    sched.submit(request(40, max_tokens=100, start=1), log.emit(0))
    sched.submit(request(40, max_tokens=100, start=99), log.emit(1))
    sched.step()
    time.sleep(0.1)
    sched.step()
    assert isinstance(log.events[1][-1], Failed) and log.events[1][-1].code == "queue_timeout"
    assert "--queue-timeout" in log.events[1][-1].message
    while sched.busy:
        sched.step()
    assert log.tokens(0) == 100


def test_a_cancelled_turn_frees_its_slot_at_the_next_step_and_banks_its_rows(engine):
    bank = new_bank(engine, "256M")
    sched = Scheduler(engine, bank, max_running=1, max_batch_tokens=64)
    log = Log(sched)
    first = request(30, max_tokens=200)
    sched.submit(first, log.emit(0))
    sched.submit(request(30, max_tokens=2, start=50), log.emit(1))
    for _ in range(4):
        sched.step()
    first.cancel.set()
    sched.step()  # the cancelled turn ends here; the next one is admitted at the next step
    sched.step()
    assert [e.turn.request for e in sched.running] != [first]
    last = [e for e in log.events[0] if isinstance(e, GenEvent)][-1]
    assert last.finish_reason == "cancelled" and len(bank) == 1
    while sched.busy:
        sched.step()
    assert log.tokens(1) == 2

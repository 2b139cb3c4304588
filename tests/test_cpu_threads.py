"""The CPU thread governor (turnkv/engine/cpu_threads.py): which count it keeps, when it probes
again, when it is off, and that counts changing from one step to the next change no bits."""

from __future__ import annotations

import pytest
import torch

from turnkv.config import EngineConfig
from turnkv.engine.cpu_threads import (
    SEVERE,
    FixedThreads,
    ThreadGovernor,
    candidates,
    is_decode,
    make_thread_policy,
)
from turnkv.engine.engine import Engine
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.engine.step import Window
from turnkv.models import quant
from turnkv.runtime import load_engine, new_bank


class Clocked:
    """A governor under a fake machine: ``cost[n]`` seconds per window on ``n`` threads."""

    def __init__(self, cores: int, cost: dict[int, float], **kw) -> None:
        self.set_calls: list[int] = []
        self.gov = ThreadGovernor(cores, set_threads=self.set_calls.append, **kw)
        self.cost = cost

    def step(self, windows: int = 1, window_rows: int = 1) -> int:
        n = self.gov.begin([window_rows] * windows)
        self.gov.end(self.cost[n] * windows)
        return n


def test_candidates_are_all_half_and_one_core():
    assert candidates(1) == (1,)
    assert candidates(2) == (2, 1)
    assert candidates(16) == (16, 8, 1)


def test_only_steps_of_one_row_windows_are_timed():
    assert is_decode([1, 1, 1])
    assert not is_decode([1, 8])  # a verify window costs more than a decode row
    assert not is_decode([1, 512]) and not is_decode([])


def test_steps_are_timed_per_window():
    gov = ThreadGovernor(2, set_threads=lambda n: None)
    gov.begin([1])
    gov.end(0.020)
    gov.begin([1, 1])  # two conversations decoding
    gov.end(0.040)
    gov.begin([8])  # a verify window: the kept count, not timed
    gov.end(0.030)
    assert gov.samples == {2: [0.020], 1: [0.020]}


def test_it_probes_interleaved_then_keeps_the_fastest_count():
    m = Clocked(2, {2: 0.015, 1: 0.019}, probes=3)
    probe = [m.step() for _ in range(6)]
    assert probe == [2, 1, 2, 1, 2, 1]  # neighbours in time are compared
    assert [m.step() for _ in range(5)] == [2] * 5
    assert m.gov.health() == {"mode": "auto", "candidates": [2, 1], "threads": 2, "probes": 1}


def test_a_slower_team_loses_to_one_thread():
    m = Clocked(2, {2: 0.030, 1: 0.019}, probes=2)
    for _ in range(4):
        m.step()
    assert [m.step() for _ in range(3)] == [1, 1, 1]


def test_a_count_twice_as_slow_is_dropped_after_two_of_its_steps():
    m = Clocked(4, {4: 0.200, 2: 0.019, 1: 0.025}, probes=4)
    assert [m.step() for _ in range(4)] == [4, 2, 1, 4]  # 4 lost on its second step: 2 and 1 go on
    assert m.gov.queue == [2, 1, 2, 1, 2, 1]
    for _ in range(6):
        m.step()
    assert m.gov.health()["threads"] == 2 and len(m.gov.samples) == 0
    m = Clocked(2, {2: 0.200, 1: 0.019}, probes=4)
    assert [m.step() for _ in range(5)] == [2, 1, 2, 1, 1]  # 3 steps of the probe, not 8


def test_one_slow_step_does_not_drop_the_faster_count():
    """The first probe step at one thread pays a one-off (an engine's first decode step, a
    neighbour's burst): the spinning team beside the neighbour must not win on it."""
    m = Clocked(2, {2: 0.250, 1: 0.020}, probes=4)
    m.step()  # 2 threads: 0.250
    m.cost = {2: 0.250, 1: 0.600}
    m.step()  # 1 thread, once: 0.600
    m.cost = {2: 0.250, 1: 0.020}
    while m.gov.queue:
        m.step()
    assert m.step() == 1


def test_it_probes_again_after_a_period():
    m = Clocked(2, {2: 0.015, 1: 0.019}, probes=1, period=5)
    for _ in range(2 + 5):
        m.step()
    assert m.gov.queue  # a new probe is under way
    m.cost = {2: 0.051, 1: 0.019}  # a neighbour arrived
    while m.gov.queue:
        m.step()
    assert m.step() == 1


@pytest.mark.parametrize(("slow", "within"), [(0.026, 16), (0.051, 4)])
def test_a_slowdown_of_the_kept_count_starts_a_probe_at_once(slow, within):
    # 1.7x its probe: a full window of slow steps; 3.4x (past ``cut``): SEVERE steps
    m = Clocked(2, {2: 0.015, 1: 0.019}, probes=1, period=10_000, drift=1.5)
    for _ in range(2):
        m.step()
    m.cost = {2: slow, 1: 0.019}
    steps = 0
    while not m.gov.queue:
        m.step()
        steps += 1
    assert steps == within == (m.gov.recent.maxlen if slow < 2 * 0.015 else SEVERE)
    while m.gov.queue:
        m.step()
    assert m.step() == 1


def test_prefill_steps_take_the_kept_count_and_are_not_timed():
    m = Clocked(2, {2: 0.030, 1: 0.019}, probes=2)
    assert m.step(window_rows=512) == 2  # nothing measured yet: every core
    assert m.step(window_rows=6) == 2  # a verify window, likewise
    assert m.gov.queue == [2, 1, 2, 1] and not m.gov.samples
    assert m.step() == 2 and m.step(window_rows=512) == 2  # mid-probe: still the kept count
    assert m.gov.queue == [1, 2, 1] and len(m.gov.samples[2]) == 1
    for _ in range(3):
        m.step()
    assert m.step(window_rows=512) == 1 and m.gov.since == 0


def test_the_governor_is_on_only_for_threads_0_on_a_cpu_with_cores(monkeypatch):
    import turnkv.engine.cpu_threads as ct

    monkeypatch.setattr(ct, "available_cores", lambda: 2)
    assert isinstance(make_thread_policy(torch.device("cpu"), 0, False), ThreadGovernor)
    assert make_thread_policy(torch.device("cpu"), 3, False).health() == {"mode": "fixed", "threads": 3}
    assert isinstance(make_thread_policy(torch.device("cpu"), 0, True), FixedThreads)  # tensor parallel
    assert make_thread_policy(torch.device("meta"), 0, False).health()["mode"] == "none"
    monkeypatch.setattr(ct, "available_cores", lambda: 1)
    assert isinstance(make_thread_policy(torch.device("cpu"), 0, False), FixedThreads)


def _answers(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    bank = new_bank(engine, "1G")
    sched = Scheduler(engine, bank, max_running=len(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        req = TurnRequest(ids, SamplingParams(ignore_eos=True), max_tokens=n, namespace=f"p{i}")
        sched.submit(req, lambda ev, i=i: out[i].append(ev.token_id) if isinstance(ev, GenEvent) else None)
    while sched.busy:
        sched.step()
    return out


needs_int4 = pytest.mark.skipif(quant.kernel_missing() is not None, reason="no int4 CPU kernel in torch")


@pytest.fixture(scope="module")
def packed_engine() -> Engine:
    # no drafts: the governor times only steps of one-row windows, and the maps prompt below drafts
    # at every step
    cfg = EngineConfig(device="cpu", weights="packed", prefill_chunk=300, threads=1, speculate="off")
    return load_engine(cfg, progress=False)


@pytest.mark.slow
@needs_int4
def test_a_steps_logits_are_the_same_bits_on_one_and_two_threads(packed_engine):
    """A 300-row prefill window (the wide bf16 path), a 40-row one (the int4 kernel, the CPU
    flash kernel), then a decode step of both conversations and one of the first alone, each on 1
    and on 2 threads."""
    engine = packed_engine
    engine.threads = FixedThreads(None)  # the counts are set here
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, engine.model.cfg.vocab_size, (340,), generator=gen).tolist()
    before = torch.get_num_threads()
    logits = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            a, b = engine.new_cache(), engine.new_cache()
            first = engine.run_step([Window(a, ids[:300], logits=4), Window(b, ids[300:], logits=4)])
            a.commit(ids[:300])
            b.commit(ids[300:])
            second = engine.run_step([Window(a, [ids[7]]), Window(b, [ids[9]])])
            a.commit([ids[7]])
            alone = engine.run_step([Window(a, [ids[8]])])  # one window: attention on n threads
            logits[n] = (first.logits, second.logits, alone.logits)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(x, y) for x, y in zip(logits[1], logits[2], strict=True))


@pytest.mark.slow
@needs_int4
def test_counts_changing_every_step_give_the_same_tokens_on_the_default_model(packed_engine):
    """Packed int4 weights, prefill chunks (the wide bf16 path included) and batched decode on 1
    and 2 threads alternating step by step, against one thread throughout."""
    engine = packed_engine
    tok = engine.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}])
        for p in ("What is the capital of France?", "Name three colours of the rainbow.")
    ]
    prompts.append(tok.encode("The history of maps. " * 80)[:420])  # two chunks, one of 300 rows
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        engine.threads = FixedThreads(1)
        want = _answers(engine, prompts, 12)
        # probing for ever: 2, 1, 2, 1, ... (never dropping a count as a loser: beside another busy
        # process, as under xdist, two threads can be many times slower than one)
        engine.threads = ThreadGovernor(2, probes=10_000, cut=float("inf"))
        got = _answers(engine, prompts, 12)
        assert len(engine.threads.samples) == 2  # decode steps ran on both counts
    finally:
        torch.set_num_threads(before)
    assert got == want

"""Warm-up before ready: representative turns through the real step path, so that every Triton
kernel variant and CUDA graph the scheduler will use is compiled and captured before ``/health``
says ``ok`` (docs/SERVER.md, "Warming up").

It drives turns, not kernels or caches: a private bank and a scheduler like the server's
(``Runtime.warm_up`` builds both) run synthetic turns whose arrivals make the steps a server
meets -- prefill chunks of many row counts (aligned and odd: Triton specializes integers by
divisibility), decode batches of every captured batch size, each beside a conversation long
enough to reach the larger key buckets (the split count a decode graph is keyed by), follow-up
chunks of several sizes over histories of every power of two of keys (restored from the bank: a
chunk's split count, and so its combine kernel's variant, follows its keys), mixed steps
of decode rows plus prompt chunks across the row range, sampled, logprob and grammar-masked rows.
Whatever those steps compile or capture is then in place; what a serving step still compiles is
counted (``jit_watch``).

On a CPU there is no JIT (the C kernels are built at load): one short turn (``smoke``) checks the
path end to end and touches torch's kernels once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from turnkv.attention.segment_table import GRAPH_BATCHES
from turnkv.engine.events import Banked, Failed, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

LONG_CONTEXTS = (4100, 8200, 16400)  # one conversation per key bucket past the first (4096 keys)
NAMESPACE = "turnkv-warmup"  # its own bank anyway; the name only shows in logs


@dataclass
class WarmProgress:
    """Where start-up stands, read by ``/health`` from another thread (plain fields, replaced whole)."""

    state: str = "loading"  # loading | warming | ok | failed
    phase: str = "load"
    done: int = 0  # turns finished in the warm-up
    total: int = 0
    started: float = field(default_factory=time.monotonic)
    error: str | None = None

    def doc(self) -> dict:
        return {
            "phase": self.phase,
            "done": self.done,
            "total": self.total,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "error": self.error,
        }


@dataclass(frozen=True)
class Arrival:
    at: int  # submitted before this step of its phase
    request: TurnRequest


@dataclass
class WarmReport:
    """What the warm-up did (the startup line, ``/health.scheduler.warmup``)."""

    seconds: float = 0.0
    turns: int = 0
    steps: int = 0
    failed: int = 0  # turns that ended in a Failed (logged; the server still starts)
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    note: str = ""

    def doc(self) -> dict:
        return {
            "seconds": round(self.seconds, 2),
            "turns": self.turns,
            "steps": self.steps,
            "failed": self.failed,
            "phases": {k: round(v, 2) for k, v in self.phases.items()},
            "note": self.note,
        }


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` ids that share no prefix with another seed's (so each turn prefills its own rows)."""
    span = max(1, min(vocab, 32000) - 200)
    return [100 + (seed * 7919 + i * 104729) % span for i in range(n)]


def _turn(n: int, seed: int, vocab: int, answer: int, **kw) -> TurnRequest:
    params = SamplingParams(ignore_eos=True, **kw.pop("sampling", {}))
    return TurnRequest(_prompt(n, seed, vocab), params, max_tokens=answer, namespace=NAMESPACE, **kw)


def _keys(limit: int) -> list[int]:
    """History lengths 64, 128, ... up to ``limit``: one per power of two of the keys read."""
    return [1 << k for k in range(6, 32) if 1 << k <= limit]


def _sizes(limit: int) -> list[int]:
    """Row counts from 1 to ``limit``: each power of two, and one past it."""
    out, p = set(), 1
    while p <= limit:
        out.update(x for x in (p, p + 1) if x <= limit)
        p *= 2
    return sorted(out | {limit})


def _compiles(engine) -> bool:
    """Whether steps JIT-compile kernels or capture graphs here (CUDA: Triton, CUDA graphs)."""
    return engine.shape.device.type == "cuda"


Group = list[Arrival]  # turns driven together until the scheduler is idle again


def plan(sched: Scheduler, grammar=None) -> list[tuple[str, list[Group]]]:
    """The phases of the warm-up for ``sched``'s engine and limits, each a list of groups."""
    engine = sched.engine
    vocab = engine.loaded.config.vocab_size
    if not _compiles(engine):
        return [("smoke", [[Arrival(0, _turn(16, 1, vocab, 2))]])]
    budget, running = sched.max_batch_tokens, sched.max_running
    room = (engine.max_context or 1 << 20) - 16
    seed = iter(range(1, 1 << 30))
    # prompt chunks alone: one turn at a time, so each step has exactly that many rows
    lengths = [*_sizes(budget), budget + 3, 2 * budget + 1]
    prefill = [[Arrival(0, _turn(n, next(seed), vocab, 2))] for n in lengths if n < room]
    # decode batches of each captured size, with short contexts and beside one long conversation
    decode: list[Group] = []
    longs = [n for n in LONG_CONTEXTS if n < room]
    for b in [b for b in GRAPH_BATCHES if b <= running]:
        for long in [0, *longs]:
            group = [_turn(5 + i, next(seed), vocab, 4) for i in range(b - (long > 0))]
            if long:  # the same long prompt every time: the bank restores it after the first
                group.append(_turn(long, 0, vocab, 4))
            decode.append([Arrival(0, r) for r in group])
    # prompt chunks over a history (follow-ups, restored from the bank): the split count of a
    # chunk's attention, and so its combine kernel's variant, follows the keys it reads
    history: list[Group] = []
    for h in [h for h in _keys(max(longs, default=0)) if h + budget < room]:
        for r in [2, 8, 16, 40, 200, budget]:
            ids = _prompt(h, 0, vocab) + _prompt(r, next(seed), vocab)
            history.append([Arrival(0, TurnRequest(ids, SamplingParams(ignore_eos=True), 2, NAMESPACE))])
    # mixed steps: decode rows (greedy, sampled, logprobs, grammar-masked) beside prompt chunks
    sizes = [n for n in _sizes(budget) if n > 4]
    answer = 3 * len(sizes) + 8
    decoders = [
        _turn(12, next(seed), vocab, answer),
        _turn(13, next(seed), vocab, answer, sampling={"temperature": 0.8, "top_p": 0.9, "seed": 1}),
        _turn(14, next(seed), vocab, answer, logprobs=2),
    ]
    if grammar is not None:
        decoders.append(_turn(15, next(seed), vocab, answer, grammar=grammar))
    d = len(decoders)
    mixed = [Arrival(0, r) for r in decoders]
    mixed += [Arrival(2 + 3 * i, _turn(n - d, next(seed), vocab, 1)) for i, n in enumerate(sizes) if n > d]
    return [("prefill", prefill), ("decode", decode), ("history", history), ("mixed", [mixed])]


def warm_up(sched: Scheduler, progress: WarmProgress, grammar=None) -> WarmReport:
    """Run ``plan(sched)`` on ``sched`` (idle, over a bank of its own) to the end of every turn."""
    phases = plan(sched, grammar)
    report = WarmReport()
    progress.total = sum(len(g) for _, groups in phases for g in groups)
    progress.done = 0
    progress.state = "warming"
    t0 = time.perf_counter()
    for name, groups in phases:
        progress.phase = name
        t = time.perf_counter()
        for group in groups:
            report.steps += _drive(sched, group, progress, report)
        report.phases[name] = time.perf_counter() - t
    report.seconds = time.perf_counter() - t0
    report.turns = progress.total
    if report.failed:
        log.warning("warm-up: %d of %d turns failed (see above); serving anyway", report.failed, report.turns)
    return report


def _drive(sched: Scheduler, arrivals: list[Arrival], progress: WarmProgress, report: WarmReport) -> int:
    pending = sorted(arrivals, key=lambda a: a.at)
    step = 0

    def sink(ev) -> None:
        if isinstance(ev, Failed):
            report.failed += 1
            log.warning("warm-up turn failed: %s: %s", ev.code, ev.message)
        if isinstance(ev, (Banked, Failed)):
            progress.done += 1

    while pending or sched.busy:
        if not sched.busy and pending and pending[0].at > step:
            step = pending[0].at  # nothing runs until the next arrival: skip ahead
        while pending and pending[0].at <= step:
            sched.submit(pending.pop(0).request, sink)
        sched.step()
        step += 1
    return step

"""The step loop: a waiting queue, a running set, and one forward per step for all running turns.

Each ``step()`` admits waiting turns while the running set has room (``Turn.begin``: the bank's
admission), then takes one window from every running turn -- a decode row (or a verify window of
context-copy drafts) from each decoding turn first, then prefill chunks (and rebase rows) of the
others, in the prompt order (``prompt_order``: shortest first, aged; this module's decision),
within the step's prompt budget (``budget.StepBudget``: how many rows, ``--max-batch-tokens``,
docs/SCHEDULER.md "The prompt budget") -- and hands them to the step pipeline (``pipeline.Pipeline.advance``: stage, launch, finalize, complete), which runs them
as one forward, chooses every row's token (``chooser``) and hands each turn its tokens.
A turn's events go to the ``emit`` callback it was submitted with, in order.

**Run-ahead** (docs/SCHEDULER.md, "Run-ahead"): with a step in flight, a turn whose window is in
it gets the window after it where that is known before the tokens come back
(``Turn.window_ahead``, fed from the step in flight's row ``InFlight.feeds``), else none this
step; the pipeline launches the new step before it completes the one in flight.

**Faults.** Every stage runs under a ``guard.Guard``: admission (``Turn.begin``: the context
check, the bank's lookup and the disk tier's, the price, the new or restored cache), a turn's
window, the step's stage, launch, finalize and complete, and a turn's advance (sampler, grammar,
detokenizer, stop strings, seal and bank). An exception there ends exactly the turns that stage
concerns with a ``Failed`` (``internal_error``: HTTP 500), releasing their leases (nothing already
banked is lost), and the loop goes on; a fault in the loop's own glue fails the running turns. An
entry leaves the queue and the running set once its last event (``Banked`` or ``Failed``) is
sent, so neither holds a turn that nobody will end. (A disk tier that raises never gets here: it
degrades to a miss, ``turnkv.bank.disk``.)

``run_turn`` drives one turn to its end on the calling thread (``turnkv generate``, ``turnkv chat``,
the benches): the same code path as the server, with a running set of one.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from turnkv.bank.session_bank import SessionBank
from turnkv.engine.budget import FixedBudget, StepBudget
from turnkv.engine.engine import Engine
from turnkv.engine.events import Failed, TurnEvent, TurnRequest
from turnkv.engine.guard import Emit, Entry, Guard
from turnkv.engine.pipeline import InFlight, Pipeline, Work
from turnkv.engine.prompt_order import order
from turnkv.engine.step import Window
from turnkv.engine.turn import Turn
from turnkv.kv.segments import copying, join_copies

log = logging.getLogger(__name__)


class StepHook(Protocol):
    """Another party to every step (tensor parallelism's rank 0, ``parallel.control.Leader``):
    told of each submitted turn and of each step before it runs."""

    def latch(self, sched: Scheduler, request: TurnRequest) -> TurnRequest:
        """The request the turn runs with (the hook may replace its cancel flag or seed)."""
        ...

    def announce(self, sched: Scheduler) -> bool:
        """Before a step (``sched.digest()`` names the state it starts from); False: the step
        must not run (the hook has failed every turn)."""
        ...


class Scheduler:
    """Not thread-safe: ``submit`` and ``step`` run on one thread (the server's engine thread)."""

    def __init__(
        self,
        engine: Engine,
        bank: SessionBank,
        max_running: int = 64,
        max_batch_tokens: int | StepBudget = 0,
        queue_timeout: float = 0.0,
        run_ahead: bool = False,
        hook: StepHook | None = None,
    ) -> None:
        """``queue_timeout`` (s, 0 = none): a turn still waiting for admission after it fails with
        ``queue_timeout`` (HTTP 503). ``run_ahead``: the pipeline's (``Pipeline``).
        ``max_batch_tokens``: the prompt budget, or a fixed row count (0: ``--prefill-chunk``)."""
        self.engine = engine
        self.queue_timeout = queue_timeout
        self.bank = bank
        self.max_running = max(1, max_running)
        if isinstance(max_batch_tokens, int):
            max_batch_tokens = FixedBudget(max_batch_tokens or engine.prefill_chunk)
        self.budget: StepBudget = max_batch_tokens  # the one owner of the prompt rows' count
        self.max_batch_tokens = self.budget.ceiling  # the most rows of a step (the warm-up's bound)
        self._observed = 0  # steps told to the budget
        self.steps = 0  # step() calls (the prompt order's clock: deterministic, alike on every rank)
        self._mixed = False  # the step being gathered has prompt rows
        self.host_ms = {"mixed": 0.0, "decode": 0.0}  # host time of a step() (not waiting), moving average
        self.host_s = {"mixed": 0.0, "decode": 0.0}  # the same, summed: a bench's mean over a pass
        self.kind_steps = {"mixed": 0, "decode": 0}  # step() calls of each kind, for host_s
        self.waiting: deque[Entry] = deque()
        self.running: list[Entry] = []
        self.pipeline = Pipeline(engine, run_ahead)
        self.hook = hook
        self.ctx = engine.turn_context()  # what its turns may use of the engine
        self.snapshot: dict = self._info()  # what other threads read (replaced after each step)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.pipeline.inflight)

    def submit(self, request: TurnRequest, emit: Emit) -> Turn:
        if self.hook is not None:  # rank 0 of a tensor-parallel group: the other ranks replay the turn
            request = self.hook.latch(self, request)
        turn = Turn(self.ctx, self.bank, request)
        self.waiting.append(Entry(turn, emit, time.monotonic()))
        return turn

    def step(self) -> None:
        """Admit what fits, run one forward over every running turn's window, deliver events;
        with run-ahead, launch this step before the one in flight hands out its tokens. Never
        raises an ``Exception``: a fault ends the turns it concerns (module docstring)."""
        t0, waited = time.perf_counter(), self.pipeline.stats.wait_s
        with Guard("the step loop", lambda: [(e, None) for e in self.running]) as out:
            self._mixed = False
            self._step()
        self.steps += 1
        host = (time.perf_counter() - t0 - (self.pipeline.stats.wait_s - waited)) * 1e3
        kind = "mixed" if self._mixed else "decode"
        self.host_ms[kind] += (0.1 if self.host_ms[kind] else 1.0) * (host - self.host_ms[kind])
        self.host_s[kind] += host / 1e3
        self.kind_steps[kind] += 1
        if out.failed:  # outside every stage: what was in flight is unknown, so it is dropped
            self.pipeline.drop()
        # the other choices of a prompt prefilled this step run from the next step on, as its
        # turn's (they are one request: ``max_running`` does not hold them back)
        self.running += [
            Entry(t, e.emit, e.submitted, e.admitted) for e in self.running for t in e.turn.take_forks()
        ]
        self.running = [e for e in self.running if e.live]
        try:
            self.snapshot = self._info()
        except Exception:  # the counts /health reads stay true whatever broke the rest
            log.exception("scheduler: the health snapshot failed")
            self.snapshot = {**self.snapshot, "running": len(self.running), "waiting": len(self.waiting)}

    def _step(self) -> None:
        if self.hook is not None and not self.hook.announce(self):  # the other ranks run it too
            return  # the group is down: every turn was failed
        if self.pipeline.settle():  # a turn's next window needed the step in flight's tokens
            self.running = [e for e in self.running if e.live]
        self._admit()
        self.pipeline.advance(self._gather(self.pipeline.inflight))
        s = self.pipeline.stats
        if s.steps != self._observed:  # what the last completed step cost, to the budget's model
            self._observed = s.steps
            self.budget.observe(s.last_rows, s.last_ms)

    def _gather(self, run: InFlight | None) -> Work:
        """This step's windows: a decode row (or a verify window of drafts) from each decoding
        turn first, so decode never waits behind a prefill; then prefill chunks (and rebase rows)
        of the others in the prompt order (``prompt_order``: shortest first, aged, so a short
        follow-up does not wait behind long first turns, which are chunked into what it leaves)
        within the budget's prompt rows (``self.budget``: a long prompt stalls the others'
        decoding one chunk); drafts share what prefill left. Prefill chunk sizes
        then never depend on speculation: a row's bits depend on its own window only, so turns
        answer alike with speculation on and off also in company (tests/test_scheduler.py; a
        fixed budget: an adaptive one follows the measured step times).

        A turn whose window is in ``run`` (in flight) gets the window after it if that is known
        before ``run``'s tokens come back (``Turn.window_ahead``), else none this step."""
        flying = run.feeds() if run is not None else {}

        def window(e: Entry, budget: int, draft: bool = True) -> Window | None:
            with Guard("the turn's window", [(e, None)]):
                row = flying.get(id(e.turn))
                if row is not None:
                    return e.turn.window_ahead(budget, row, draft)
                w = e.turn.window(budget, draft)
                if w is None:  # nothing to compute: finishing (or cancelled before its decode row)
                    e.deliver(e.turn.advance(None))
                return w
            return None  # it raised: the turn failed

        decode = [e for e in self.running if e.turn.decodes_next()]
        prompts = self._restored([e for e in self.running if not e.turn.decodes_next()], bool(decode))
        budget = self.budget.prompt_rows(len(decode)) if prompts else 0
        prefill: Work = []
        for e in order(prompts, lambda e: e.turn.rows_left, lambda e: e.admitted, self.steps):
            if budget <= 0 and (prefill or decode):
                continue  # waits for a later step
            if (w := window(e, max(budget, 1))) is not None:
                budget -= len(w.tokens)
                prefill.append((e, w))
        self._mixed = bool(prefill)
        if not prompts:  # drafts may take what decode rows leave of the ceiling
            budget = self.budget.ceiling - len(decode)
        work: Work = []
        spec = self.engine.speculation
        cost = spec.cost  # what the drafts are priced with: this step's company
        rows = sum(len(w.tokens) for _, w in prefill) + len(decode)
        # a draft row is one more one-row window on CUDA: past what a graph holds the whole step
        # would run eagerly, so drafts stop there (``StepGraphs.max_windows``; None: no graphs)
        most = self.engine.graphs.max_windows
        if most is not None:
            budget = min(budget, most - len(decode) - len(prefill))
        for e in decode:
            cost.company(len(prefill) + len(decode), rows, self.pipeline.run_ahead)
            # a decode row, or drafts after it (where one can fit: ``room``, once for the company)
            if (w := window(e, 1 + max(budget, 0), spec.enabled and budget > 0 and cost.room())) is not None:
                budget -= len(w.tokens) - 1
                rows += len(w.tokens) - 1
                work.append((e, w))
        return work + prefill

    def _restored(self, prompts: list[Entry], others: bool) -> list[Entry]:
        """The prompt turns that may have windows this step: a turn whose restored rows are still
        copying (from the RAM tier, ``Segment.ready``) sits out while other turns can run, so their
        steps overlap the copy instead of queueing behind it on the compute stream; a turn taken
        joins its copies (the GPU waits where one is still pending: nothing else could run).
        Under tensor parallelism every rank must pick the same windows, so none sits out there."""

        segments = [(e, e.turn.cache.segments() if e.turn.cache is not None else ()) for e in prompts]
        if self.hook is None:
            busy = [copying(segs) for _, segs in segments]
            if any(busy) and (others or not all(busy)):
                segments = [pair for pair, b in zip(segments, busy, strict=True) if not b]
        taken = []
        for e, segs in segments:
            with Guard("joining the turn's restore", [(e, None)]) as out:  # a CUDA error fails it alone
                join_copies(segs)
            if not out.failed:
                taken.append(e)
        return taken

    def digest(self) -> int:
        """A 62-bit digest of what every replica of this scheduler must agree on between steps
        (tensor parallelism: ints only, whose ``hash`` is the same in every process)."""
        s = self.bank.stats
        turns = tuple(
            (e.turn.cache.num_tokens if e.turn.cache is not None else -1, e.turn.stats.completion_tokens)
            for e in self.running
        )
        steps = self.pipeline.stats
        facts = (steps.steps, steps.rows, len(self.bank), s.inserts, s.evictions, s.refusals, s.hits, turns)
        return hash(facts) & ((1 << 62) - 1)

    def fail_all(self, failed: Failed) -> None:
        """End every waiting and running turn with ``failed`` (steps can no longer run)."""
        self.pipeline.drop()
        for e in [*self.waiting, *self.running]:
            e.turn.fail(RuntimeError(failed.message))  # releases its lease; its own event is dropped
            e.emit(failed)
        self.waiting.clear()
        self.running.clear()
        self.snapshot = self._info()

    def _admit(self) -> None:
        if self.queue_timeout:
            now = time.monotonic()
            for e in [e for e in self.waiting if now - e.submitted > self.queue_timeout]:
                self.waiting.remove(e)
                msg = (
                    f"the turn waited {now - e.submitted:.0f} s for KV memory or a running slot "
                    f"(--queue-timeout {self.queue_timeout:g} s); retry later"
                )
                e.deliver([Failed("queue_timeout", msg)])
        while self.waiting and len(self.running) < self.max_running:
            e = self.waiting.popleft()
            if e.turn.request.cancel.is_set():
                e.deliver([Failed("cancelled", "the client went away before the turn started")])
                continue
            with Guard("admission", [(e, None)]):
                events = e.turn.begin()
                e.turn.stats.queue_s = time.monotonic() - e.submitted
                if events is None:  # it fits once running turns finish: it waits, first in line
                    self.waiting.appendleft(e)
                    break
                e.deliver(events)
                if e.live:
                    e.admitted = self.steps
                    self.running.append(e)

    def _info(self) -> dict:
        graphs, p = self.engine.graphs, self.pipeline
        s = p.stats
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "steps": s.steps,
            "step_ms": round(s.step_ms, 3),
            "rows_per_step": round(s.rows_per_step, 2),
            "graphs": {
                "status": graphs.status,
                "captures": graphs.captures,
                "replays": graphs.replays,
                "mixed_replays": graphs.mixed_replays,
            },
            "run_ahead": {"enabled": p.run_ahead, "steps": s.ahead_steps},
            "budget": self.budget.health(),
            "host_ms": {k: round(v, 3) for k, v in self.host_ms.items()},
            "host_s": {k: round(v, 6) for k, v in self.host_s.items()},
            "kind_steps": dict(self.kind_steps),
            "wait_s": round(s.wait_s, 6),  # waiting for the device's results, summed
            "threads": self.engine.threads.health(),
            "route_counts": dict(s.route_counts),
        }


def run_turn(sched: Scheduler, request: TurnRequest, interruptible: bool = False) -> Iterator[TurnEvent]:
    """Drive one turn to its end on ``sched`` (an idle one, on this thread), yielding its events
    as they happen.

    With ``interruptible``, Ctrl-C (KeyboardInterrupt) cancels the turn instead of ending the
    program: the answer stops, and what was computed is still sealed and banked. On rank 0 of a
    tensor-parallel group Ctrl-C always cancels the turn and never interrupts a step (the other
    ranks would wait in its collectives).
    """
    events: list[TurnEvent] = []
    sched.submit(request, events.append)
    with _sigint_cancels(request) if sched.hook is not None else contextlib.nullcontext():
        while sched.busy:
            try:
                sched.step()
            except KeyboardInterrupt:
                if not interruptible:
                    raise
                request.cancel.set()
            yield from events
            events.clear()


@contextlib.contextmanager
def _sigint_cancels(request: TurnRequest) -> Iterator[None]:
    """While the turn runs, SIGINT sets its cancel flag instead of raising (main thread only)."""
    try:
        old = signal.signal(signal.SIGINT, lambda *_: request.cancel.set())
    except ValueError:  # not the main thread: signals never reach this one
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)

"""The step loop: a waiting queue, a running set, and one forward per step for all running turns.

Each ``step()`` admits waiting turns while the running set has room (``Turn.begin``: the bank's
admission), then takes one window from every running turn -- a decode row (or a verify window of
context-copy drafts) from each decoding turn first, then prefill chunks (and rebase rows) of the
others in arrival order within the token budget (``max_batch_tokens``) -- runs them as one ``Engine.run_step``, samples every row
that asked for logits (one batched argmax; a sampled turn draws its row on the device into the
same tensor) and hands each turn its token.
A turn's events go to the ``emit`` callback it was submitted with, in order.

**Run-ahead** (``--run-ahead``; ``auto``: where decode steps replay CUDA graphs): every step stays
in flight; the next ``step()`` admits, plans and launches the following step first and only then
waits for the tokens of the one in flight and hands them to the turns (detokenizing, stop strings,
events), so the host's work per step -- the turns', the plan's and the kernel launches of an
eager mixed step -- runs while the GPU computes instead of between its steps. A turn with a window
in flight gets the window after it when that is known before the tokens come back
(``Turn.window_ahead``): its prompt's next chunk, or the decode row after a decode row or after
the prompt's last chunk, whose token id is the step in flight's argmax, still on the device
(greedy or drawn: either way chosen there), its KV rows after the uncommitted ones; a turn whose
next window is not known (rebase rows, an answer about to end) sits that one step out, and turns
with no window in flight (admitted, rebasing) join as they would without run-ahead. A decoding turn
that drafts (context-copy speculation) runs ahead too: the window after its window in flight
carries the drafts that follow the copy's guess of that window's last token, after its drafts in
flight, and is dropped if one of those is rejected (``Turn.advance``); only a sampled turn's
verify window, whose tokens are drawn on the host, completes before the next step is planned. A
turn whose answer ended in the step it waited for had one more row computed, never committed (its
KV row is dropped as a rejected draft's is) and its token ignored. A step with rows under a
grammar is launched ahead without its masks and argmax: they need the tokens of the step in
flight, so the next ``step()`` adds them (the masks filled on a thread while the forward runs)
before launching the one after, which it builds and uploads (``Engine.stage``) while that thread
fills them: only the masks' upload, the argmax and the launch lie between the fill's end and the
next forward.

**Faults.** Every stage runs under ``_guard``: admission (``Turn.begin``: the context check, the
bank's lookup and the disk tier's, the price, the new or restored cache), a turn's window, the
step's stage, launch, finalize and complete, and a turn's advance (sampler, grammar, detokenizer,
stop strings, seal and bank). An exception there ends exactly the turns that stage concerns with a
``Failed`` (``internal_error``: HTTP 500), releasing their leases (nothing already banked is
lost), and the loop goes on; a fault in the loop's own glue fails the running turns. An entry
leaves the queue and the running set once its last event (``Banked`` or ``Failed``) is sent, so
neither holds a turn that nobody will end. (A disk tier that raises never gets here: it degrades
to a miss, ``turnkv.bank.disk``.)

``run_turn`` drives one turn to its end on the calling thread (``turnkv generate``, ``turnkv chat``,
the benches): the same code path as the server, with a running set of one.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from turnkv.bank.session_bank import SessionBank
from turnkv.engine.engine import Engine
from turnkv.engine.events import Banked, Failed, TurnEvent, TurnRequest, WindowOutput
from turnkv.engine.masks import StepMasks
from turnkv.engine.sampling import draw_rows, on_device
from turnkv.engine.step import Staged, StepResult, Window
from turnkv.engine.turn import Turn

log = logging.getLogger(__name__)

Emit = Callable[[TurnEvent], None]


@dataclass
class _Entry:
    turn: Turn
    emit: Emit
    submitted: float = 0.0  # time.monotonic() at submit
    ended: bool = False  # its last event (Banked or Failed) was sent
    deaf: bool = False  # its emit raised: the turn was cancelled

    @property
    def live(self) -> bool:
        return not (self.ended or self.turn.done)


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


Pairs = Sequence[tuple[_Entry, Window | None]]  # turns of a stage, with their windows in it


class _Guard:
    """``with``: one stage of ``work`` (pairs of an entry and its window in the stage, None: the
    turn itself; or a callable that lists them once the stage has raised). If it raises an
    ``Exception``, each turn it concerns ends with ``internal_error`` (``Scheduler._fail``), the
    exception goes no further and ``failed`` is set. (A class: a step enters one per turn.)"""

    __slots__ = ("failed", "sched", "stage", "work")

    def __init__(self, sched: Scheduler, stage: str, work: Pairs | Callable[[], Pairs]) -> None:
        self.sched, self.stage, self.work, self.failed = sched, stage, work, False

    def __enter__(self) -> _Guard:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is None or not issubclass(kind, Exception):
            return False  # KeyboardInterrupt and the like go on (run_turn cancels on Ctrl-C)
        self.failed = True
        pairs = self.work() if callable(self.work) else self.work
        # a window that is no longer its turn's (an answer that ended one row earlier) is not
        hit = [e for e, w in pairs if not e.ended and (w is None or e.turn.owns(w, ahead=True))]
        log.error("%s failed (%d turn(s) end with an error)", self.stage, len(hit), exc_info=exc)
        for e in hit:
            self.sched._fail(e, self.stage, exc)
        return True


@dataclass
class _Launched:
    """A step on the device whose tokens have not been handed to its turns yet."""

    work: list[tuple[_Entry, Window]]
    result: StepResult
    argmax: torch.Tensor | None  # [R] on the device: every logit row's argmax
    host: torch.Tensor | None = None  # [R] pinned: its asynchronous copy (CUDA)
    ready: torch.cuda.Event | None = None  # recorded after that copy
    t0: float = 0.0
    final: bool = False  # masked, argmax taken and on its way to the host (``_finalize``)
    drawn: set[int] = field(default_factory=set)  # windows whose row a sampler drew (``draw_rows``)


class Scheduler:
    """Not thread-safe: ``submit`` and ``step`` run on one thread (the server's engine thread)."""

    def __init__(
        self,
        engine: Engine,
        bank: SessionBank,
        max_running: int = 64,
        max_batch_tokens: int = 0,
        queue_timeout: float = 0.0,
        observe: Callable[[int, int, float], None] | None = None,
        run_ahead: bool = False,
        hook: StepHook | None = None,
    ) -> None:
        """``queue_timeout`` (s, 0 = none): a turn still waiting for admission after it fails with
        ``queue_timeout`` (HTTP 503). ``observe(windows, rows, seconds)`` hears of every step.
        ``run_ahead``: see docs/SCHEDULER.md (``runtime.resolve`` decides ``--run-ahead auto``)."""
        self.engine = engine
        self.queue_timeout = queue_timeout
        self.observe = observe
        self.bank = bank
        self.max_running = max(1, max_running)
        self.max_batch_tokens = max_batch_tokens or engine.prefill_chunk
        self.waiting: deque[_Entry] = deque()
        self.running: list[_Entry] = []
        self.steps = 0
        self.rows = 0  # rows computed over all steps
        self.route_counts: Counter = Counter()  # attention calls by route label, over all steps
        self.wait_s = 0.0  # host time spent waiting for the device's results (the rest is host work)
        self.step_ms = 0.0  # moving averages over recent steps
        self.rows_per_step = 0.0
        self.masks = StepMasks()  # grammar masks of constrained turns' rows
        self.inflight: _Launched | None = None  # a step whose tokens are not taken yet (run-ahead)
        self.run_ahead = run_ahead
        self.hook = hook
        self.ctx = engine.turn_context()  # what its turns may use of the engine
        self.ahead_steps = 0  # steps launched before the previous one completed
        self._done_at = 0.0  # when the last step's tokens were taken
        self.snapshot: dict = self._info()  # what other threads read (replaced after each step)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.inflight)

    def submit(self, request: TurnRequest, emit: Emit) -> Turn:
        if self.hook is not None:  # rank 0 of a tensor-parallel group: the other ranks replay the turn
            request = self.hook.latch(self, request)
        turn = Turn(self.ctx, self.bank, request)
        self.waiting.append(_Entry(turn, emit, time.monotonic()))
        return turn

    def step(self) -> None:
        """Admit what fits, run one forward over every running turn's window, deliver events;
        with run-ahead, launch this step before the one in flight hands out its tokens. Never
        raises an ``Exception``: a fault ends the turns it concerns (module docstring)."""
        with self._guard("the step loop", lambda: [(e, None) for e in self.running]) as out:
            self._step()
        if out.failed:  # outside every stage: what was in flight is unknown, so it is dropped
            self.inflight = None
        self.running = [e for e in self.running if e.live]
        try:
            self.snapshot = self._info()
        except Exception:  # the counts /health reads stay true whatever broke the rest
            log.exception("scheduler: the health snapshot failed")
            self.snapshot = {**self.snapshot, "running": len(self.running), "waiting": len(self.waiting)}

    def _step(self) -> None:
        if self.hook is not None and not self.hook.announce(self):  # the other ranks run it too
            return  # the group is down: every turn was failed
        run, self.inflight = self.inflight, None
        if run is not None and any(e.turn.owns(w) and e.turn.needs_tokens(w) for e, w in run.work):
            # a sampled turn's verify window is drawn on the host: its next window needs those
            # tokens. Rather than sit a step out (every other step, while it drafts), it waits here
            self._complete(run)
            self.running = [e for e in self.running if e.live]
            run = None
        self._admit()
        work = self._gather(run)
        staged = None
        if work and run is not None and not run.final:
            # the step in flight waits for its grammar masks, which a thread is filling: build and
            # upload this step meanwhile, so that only its launch follows the masked argmax
            staged = self._stage(work)
            work = work if staged is not None else []
        if run is not None and not self._finalize(run):  # its masks and argmax; if that broke,
            run = None  # its turns failed (and their windows of this step with them)
            self.running = [e for e in self.running if e.live]
            kept = [(e, w) for e, w in work if e.live]
            work, staged = kept, staged if len(kept) == len(work) else None
        launched = None
        if work:
            # a constrained row's mask needs the token the step in flight brings: taken below
            later = run is not None and any(e.turn.constraint is not None for e, _ in work)
            prev = run.argmax if run is not None else None
            launched = self._launch(work, prev, finalize=not later, staged=staged)
            self.ahead_steps += launched is not None and run is not None
        if run is not None:
            self._complete(run)
        if launched is not None:
            if self.run_ahead and not any(e.turn.needs_tokens(w) for e, w in work):
                self.inflight = launched  # its tokens are taken by the next step()
            else:  # (a turn that needs them would wait for them at the next step() anyway)
                self._complete(launched)

    def _gather(self, run: _Launched | None) -> list[tuple[_Entry, Window]]:
        """This step's windows: a decode row (or a verify window of drafts) from each decoding
        turn first, so decode never waits behind a prefill; then prefill chunks (and rebase rows)
        of the others in arrival order within the token budget (a long prompt stalls the others
        one chunk); drafts share what prefill left. Prefill chunk sizes then never depend on
        speculation: a row's bits depend on its own window only, so turns answer alike with
        speculation on and off also in company (tests/test_scheduler.py).

        A turn whose window is in ``run`` (in flight) gets the window after it if that is known
        before ``run``'s tokens come back (``Turn.window_ahead``), else none this step."""
        flying: dict[int, int] = {}  # id(turn) -> the logit row of its window's last row in ``run``
        if run is not None:
            offsets = run.result.plan.logit_offsets
            for i, (e, w) in enumerate(run.work):
                if e.turn.owns(w):
                    flying[id(e.turn)] = offsets[i] + w.logits - 1

        def window(e: _Entry, budget: int, draft: bool = True) -> Window | None:
            with self._guard("the turn's window", [(e, None)]):
                row = flying.get(id(e.turn))
                if row is not None:
                    return e.turn.window_ahead(budget, row, draft)
                w = e.turn.window(budget, draft)
                if w is None:  # nothing to compute: finishing (or cancelled before its decode row)
                    self._deliver(e, e.turn.advance(None))
                return w
            return None  # it raised: the turn failed

        decode = [e for e in self.running if e.turn.decodes_next()]
        budget = self.max_batch_tokens - len(decode)
        prefill: list[tuple[_Entry, Window]] = []
        for e in self.running:
            if e.turn.decodes_next() or (budget <= 0 and (prefill or decode)):
                continue  # decodes (below), or waits for a later step
            if (w := window(e, max(budget, 1))) is not None:
                budget -= len(w.tokens)
                prefill.append((e, w))
        work: list[tuple[_Entry, Window]] = []
        spec = self.engine.speculation
        cost = spec.cost  # what the drafts are priced with: this step's company
        rows = sum(len(w.tokens) for _, w in prefill) + len(decode)
        for e in decode:
            cost.company(len(prefill) + len(decode), rows, self.run_ahead)
            # a decode row, or drafts after it (where one can fit: ``room``, once for the company)
            if (w := window(e, 1 + max(budget, 0), spec.enabled and cost.room())) is not None:
                budget -= len(w.tokens) - 1
                rows += len(w.tokens) - 1
                work.append((e, w))
        return work + prefill

    def digest(self) -> int:
        """A 62-bit digest of what every replica of this scheduler must agree on between steps
        (tensor parallelism: ints only, whose ``hash`` is the same in every process)."""
        s = self.bank.stats
        turns = tuple(
            (e.turn.cache.num_tokens if e.turn.cache is not None else -1, e.turn.stats.completion_tokens)
            for e in self.running
        )
        facts = (self.steps, self.rows, len(self.bank), s.inserts, s.evictions, s.refusals, s.hits, turns)
        return hash(facts) & ((1 << 62) - 1)

    def fail_all(self, failed: Failed) -> None:
        """End every waiting and running turn with ``failed`` (steps can no longer run)."""
        self.inflight = None
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
                self._deliver(e, [Failed("queue_timeout", msg)])
        while self.waiting and len(self.running) < self.max_running:
            e = self.waiting.popleft()
            if e.turn.request.cancel.is_set():
                self._deliver(e, [Failed("cancelled", "the client went away before the turn started")])
                continue
            with self._guard("admission", [(e, None)]):
                events = e.turn.begin()
                e.turn.stats.queue_s = time.monotonic() - e.submitted
                if events is None:  # it fits once running turns finish: it waits, first in line
                    self.waiting.appendleft(e)
                    break
                self._deliver(e, events)
                if e.live:
                    self.running.append(e)

    def _stage(self, work: list[tuple[_Entry, Window]]) -> Staged | None:
        """``Engine.stage`` of ``work``'s windows; None if that broke (its turns failed)."""
        with self._guard("the step's stage", work):
            return self.engine.stage([w for _, w in work])
        return None

    def _launch(
        self,
        work: list[tuple[_Entry, Window]],
        prev: torch.Tensor | None = None,
        finalize: bool = True,
        staged: Staged | None = None,
    ) -> _Launched | None:
        """Run one forward over ``work``'s windows (``staged``: already built by ``_stage``), and
        ``_finalize`` it unless told not to; None if the step broke (its turns failed). ``prev``:
        the argmax of the step in flight."""
        windows = [w for _, w in work]
        t0 = time.perf_counter()
        with self._guard("the step's launch", work) as out:  # a broken step fails its turns
            if staged is None:
                result = self.engine.run_step(windows, prev)
            else:
                result = self.engine.run_staged(staged, prev)
        if out.failed:
            return None
        run = _Launched(work, result, None, t0=t0)
        return run if not finalize or self._finalize(run) else None

    def _finalize(self, run: _Launched) -> bool:
        """Mask the constrained rows of ``run`` (each grammar as it stands after the tokens taken so
        far: host work that overlaps the forward on CUDA), take every logit row's argmax in one op,
        put the sampled turns' draws in their rows (on the device), and start the copy to the host
        (the step's only sync comes at ``_complete``). False if that broke (its turns failed)."""
        if run.final:
            return True
        run.final = True
        result = run.result
        with self._guard("the step's finalize", run.work):
            offsets = result.plan.logit_offsets
            self.masks.apply(result.logits, _constrained(run.work, offsets))
            argmax = run.argmax = result.logits.argmax(-1) if result.logits.shape[0] else None
            drawers = [(i, e.turn.drawer(w)) for i, (e, w) in enumerate(run.work)
                       if w.logits == 1 and e.turn.owns(w, ahead=True)]  # fmt: skip
            drawers = [(i, sp) for i, sp in drawers if sp is not None]
            if drawers:  # the sampled one-row windows, drawn together on the device
                rows = on_device([offsets[i] for i, _ in drawers], torch.int64, argmax.device)
                tokens = draw_rows([sp for _, sp in drawers], result.logits.index_select(0, rows))
                argmax.index_copy_(0, rows, tokens)
                run.drawn.update(i for i, _ in drawers)
            if argmax is not None and argmax.is_cuda:
                run.host = torch.empty(argmax.shape, dtype=argmax.dtype, pin_memory=True)
                run.host.copy_(argmax, non_blocking=True)
                run.ready = torch.cuda.Event()
                run.ready.record()
            return True
        return False

    def _complete(self, run: _Launched) -> None:
        """Wait for ``run``'s tokens and hand each window's rows to its turn."""
        if not self._finalize(run):
            return
        work, result = run.work, run.result
        windows = [w for _, w in work]
        with self._guard("the step's complete", work) as out:
            t_sync = time.perf_counter()
            if run.ready is not None:
                run.ready.synchronize()
                argmax = run.host.tolist()
            else:
                argmax = run.argmax.tolist() if run.argmax is not None else []
            self.wait_s += time.perf_counter() - t_sync
            self.engine.speculation.cost.observe(windows, time.perf_counter() - run.t0)
            rows = sum(len(w.tokens) for w in windows)
            self.steps += 1
            self.rows += rows
            layers = self.engine.shape.num_layers
            labels = result.plan.labels
            for label in labels:
                self.route_counts[label] += layers
            offsets = result.plan.logit_offsets
            self._take_early(run, argmax)
        if out.failed:
            return
        for i, (e, w) in enumerate(work):
            if not e.turn.owns(w):  # a run-ahead row of an answer that ended one row earlier
                continue
            lo, hi = offsets[i], offsets[i] + w.logits
            # the turn's own host work (sampler, grammar, detokenizer, stops, seal and bank): that
            # turn alone fails
            with self._guard("the turn's advance", [(e, None)]):
                got = WindowOutput(result.logits[lo:hi], argmax[lo:hi], labels[i], layers, i in run.drawn)
                self._deliver(e, e.turn.advance(got))
        now = time.perf_counter()
        seconds = now - max(run.t0, self._done_at)  # overlapped steps: from the previous one's end
        self._done_at = now
        a = 0.1 if self.steps > 1 else 1.0
        self.step_ms += a * (seconds * 1e3 - self.step_ms)
        with self._guard("the step observer", ()):  # no turn fails: they have their tokens
            if self.observe is not None:
                self.observe(len(windows), rows, seconds)
        self.rows_per_step += a * (rows - self.rows_per_step)

    def _take_early(self, run: _Launched, argmax: list[int]) -> None:
        """Constrained turns' tokens to their grammars first, then the next step's masks filled on
        a thread while the turns take their tokens (text, stops, events: the host work of a step)."""
        offsets = run.result.plan.logit_offsets
        early = []
        for i, (e, w) in enumerate(run.work):
            if e.turn.constraint is None or not e.turn.owns(w):
                continue
            try:
                if e.turn.take_early(w, argmax[offsets[i] + w.logits - 1], i in run.drawn):
                    early.append(e.turn.constraint)
            except Exception:  # the grammar refused: ``advance`` fails the turn
                continue
        self.masks.start(early)

    def _guard(self, stage: str, work: Pairs | Callable[[], Pairs]) -> _Guard:
        return _Guard(self, stage, work)

    def _fail(self, e: _Entry, stage: str, exc: Exception) -> None:
        """End ``e`` with an error: its lease is released (nothing of this turn is banked; what
        was banked before stays), and its client gets ``Failed`` whatever else breaks."""
        try:
            e.turn.fail(exc)
        except Exception:
            log.exception("releasing a failed turn raised too")
        self._deliver(e, [Failed("internal_error", f"{stage} failed: {type(exc).__name__}: {exc}")])

    def _info(self) -> dict:
        graphs = self.engine.graphs
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "steps": self.steps,
            "step_ms": round(self.step_ms, 3),
            "rows_per_step": round(self.rows_per_step, 2),
            "graphs": {"status": graphs.status, "captures": graphs.captures, "replays": graphs.replays},
            "run_ahead": {"enabled": self.run_ahead, "steps": self.ahead_steps},
            "threads": self.engine.threads.health(),
            "route_counts": dict(self.route_counts),
        }

    @staticmethod
    def _deliver(e: _Entry, events: list[TurnEvent]) -> None:
        for ev in events:
            if isinstance(ev, (Banked, Failed)):
                e.ended = True  # it leaves the queue and the running set
            try:
                e.emit(ev)
            except Exception:  # nobody can hear this turn: it stops as a client that left does
                if not e.deaf:
                    log.exception("a turn's event could not be delivered: the turn is cancelled")
                e.deaf = True
                e.turn.request.cancel.set()


def _constrained(work: list[tuple[_Entry, Window]], offsets: list[int]) -> list:
    """``(logit row, constraint)`` of each window whose turn decodes under a grammar (its one
    logits row: a constrained turn never drafts)."""
    return [
        (offsets[i] + w.logits - 1, e.turn.constraint)
        for i, (e, w) in enumerate(work)
        if w.logits and e.turn.constraint is not None and e.turn.owns(w)
    ]


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

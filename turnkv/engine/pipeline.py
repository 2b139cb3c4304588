"""The step pipeline: the four phases of a step, and their order with a step in flight.

- **stage** (``Engine.stage``): the step's KV windows opened, its inputs and tables built and
  uploaded; nothing read from the step in flight.
- **launch** (``Engine.run_step`` / ``run_staged``): the forward, its fed ids copied on the device
  from the step in flight's chosen tokens (``InFlight.chosen``).
- **finalize**: the grammar masks of the constrained rows (``StepMasks.apply``), every row's token
  chosen on the device (``chooser.choose_on_device``: the argmax, the sampled rows drawn into it)
  and its asynchronous copy to the host.
- **complete**: wait for that copy (the step's one sync), the constrained turns' tokens to their
  grammars first (the next masks filled on a thread meanwhile), then each window's tokens to its
  turn (``chooser.window_tokens``, ``Turn.advance``) and the step's figures (``StepStats``).

``Pipeline.advance(work)`` runs one step's worth: without run-ahead it stages, launches, finalizes
and completes ``work``. With run-ahead (docs/SCHEDULER.md, "Run-ahead") ``work`` is launched
before the step in flight completes and stays in flight itself, so the turns' host work overlaps
the device's; a step with constrained rows is launched without its masks, which the next
``advance`` adds after staging its own step, before launching it. Each phase runs under a
``Guard``: a fault ends exactly the turns that phase concerns.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from turnkv.engine.chooser import Where, choose_on_device, where, window_tokens
from turnkv.engine.engine import Engine
from turnkv.engine.events import WindowOutput
from turnkv.engine.guard import Entry, Guard
from turnkv.engine.logprobs import Ask, StepLogprobs, prompt_scores, step_logprobs
from turnkv.engine.masks import StepMasks
from turnkv.engine.step import Staged, StepResult, Window
from turnkv.engine.step_trace import Marks, from_env

Work = list[tuple[Entry, Window]]  # a step's windows, each with its turn's entry


@dataclass
class InFlight:
    """A launched step whose tokens have not been handed to its turns yet."""

    work: Work
    result: StepResult
    t0: float  # time.perf_counter() at launch
    chosen: torch.Tensor | None = None  # [R] on the device: every logit row's token (finalize)
    host: torch.Tensor | None = None  # [R] pinned: its asynchronous copy (CUDA)
    ready: torch.cuda.Event | None = None  # recorded after that copy
    final: bool = False  # finalized: masked, tokens chosen and on their way to the host
    logprobs: StepLogprobs | None = None  # the rows whose turns ask for logprobs (finalize)
    prompt: StepLogprobs | None = None  # the prompt rows scored for their turns (``Window.scores``)
    marks: Marks | None = None  # its timeline (``step_trace``: TURNKV_STEP_TRACE)

    def feeds(self) -> dict[int, int]:
        """``id(turn)`` -> the logit row of its window's last row, for each turn whose window here
        is still to complete (``Turn.window_ahead``'s ``feed``)."""
        offsets = self.result.plan.logit_offsets
        return {id(e.turn): offsets[i] + w.logits - 1 for i, (e, w) in enumerate(self.work) if e.turn.owns(w)}


@dataclass
class StepStats:
    """Figures of the completed steps (``/health.scheduler``, the benches)."""

    steps: int = 0
    rows: int = 0  # rows computed over all steps
    ahead_steps: int = 0  # steps launched before the previous one completed
    route_counts: Counter = field(default_factory=Counter)  # attention calls by route label
    wait_s: float = 0.0  # host time spent waiting for the device's results (the rest is host work)
    step_ms: float = 0.0  # moving averages over recent steps
    rows_per_step: float = 0.0
    last_rows: int = 0  # the last completed step's rows and milliseconds (the prompt budget's)
    last_ms: float = 0.0


class Pipeline:
    """One engine's steps, in order (module docstring). Not thread-safe: the scheduler's thread."""

    def __init__(self, engine: Engine, run_ahead: bool = False) -> None:
        """``run_ahead``: see docs/SCHEDULER.md (``runtime.resolve`` decides ``--run-ahead auto``)."""
        self.engine = engine
        self.run_ahead = run_ahead
        self.masks = StepMasks()  # grammar masks of constrained turns' rows
        self.inflight: InFlight | None = None  # a step whose tokens are not taken yet (run-ahead)
        self.stats = StepStats()
        self.observe: Callable[[int, int, float], None] | None = None  # (windows, rows, seconds) per step
        self._done_at = 0.0  # when the last step's tokens were taken
        self.trace = from_env(engine.shape.device.type == "cuda")  # None unless TURNKV_STEP_TRACE

    def settle(self) -> bool:
        """Complete the step in flight now if a turn's next window needs its tokens on the host (a
        sampled turn's verify window, ``chooser.Where.HOST``): rather than sit a step out (every
        other step, while it drafts), that turn waits here. True if it did."""
        run = self.inflight
        if run is None or not any(self._on_host(e, w) for e, w in run.work):
            return False
        self.inflight = None
        self.complete(run)
        return True

    def advance(self, work: Work) -> None:
        """Launch ``work`` (the windows ``Turn.window`` and ``Turn.window_ahead`` gave: after the
        step in flight, if any) and complete the step in flight; ``work`` then completes too, or
        stays in flight (run-ahead)."""
        run, self.inflight = self.inflight, None
        staged = None
        if work and run is not None and not run.final:
            # the step in flight waits for its grammar masks, which a thread is filling: build and
            # upload this step meanwhile, so that only its launch follows the masked choice
            staged = self.stage(work)
            work = work if staged is not None else []
        if run is not None and not self.finalize(run):  # if that broke, its turns failed (and
            run = None  # their windows of this step with them)
            kept = [(e, w) for e, w in work if e.live]
            work, staged = kept, staged if len(kept) == len(work) else None
        launched = None
        if work:
            # a constrained row's mask needs the token the step in flight brings: taken below
            later = run is not None and any(e.turn.constraint is not None for e, _ in work)
            prev = run.chosen if run is not None else None
            launched = self.launch(work, prev, staged, finalize=not later)
            self.stats.ahead_steps += launched is not None and run is not None
        if run is not None:
            self.complete(run)
        if launched is not None:
            if self.run_ahead and not any(self._on_host(e, w) for e, w in work):
                self.inflight = launched  # its tokens are taken by the next advance
            else:  # (a turn whose tokens are chosen on the host would wait for them next anyway)
                self.complete(launched)

    def drop(self) -> None:
        """Forget the step in flight (its turns have failed, or what it holds is unknown)."""
        self.inflight = None

    # -- the phases ---------------------------------------------------------------------------
    def stage(self, work: Work) -> Staged | None:
        """``Engine.stage`` of ``work``'s windows; None if that broke (its turns failed)."""
        with Guard("the step's stage", work):
            return self.engine.stage([w for _, w in work])
        return None

    def launch(
        self, work: Work, prev: torch.Tensor | None, staged: Staged | None = None, finalize: bool = True
    ) -> InFlight | None:
        """Run one forward over ``work``'s windows (``staged``: already built by ``stage``), and
        ``finalize`` it unless told not to; None if the step broke (its turns failed). ``prev``:
        the step in flight's chosen tokens, which fed windows read."""
        windows = [w for _, w in work]
        marks = self.trace.begin(self.engine.graphs.replays) if self.trace is not None else None
        t0 = time.perf_counter()
        with Guard("the step's launch", work) as out:  # a broken step fails its turns
            if staged is None:
                result = self.engine.run_step(windows, prev)
            else:
                result = self.engine.run_staged(staged, prev)
        if out.failed:
            return None
        run = InFlight(work, result, t0, marks=marks)
        if marks is not None:
            marks.launched, marks.graph = time.perf_counter(), self.engine.graphs.replays != marks.replays
        return run if not finalize or self.finalize(run) else None

    def finalize(self, run: InFlight) -> bool:
        """Mask the constrained rows of ``run`` (each grammar as it stands after the tokens taken so
        far: host work that overlaps the forward on CUDA), choose every row's token on the device,
        and start the copy to the host (the step's only sync comes at ``complete``). False if that
        broke (its turns failed)."""
        if run.final:
            return True
        run.final = True
        result = run.result
        with Guard("the step's finalize", run.work):
            offsets = result.plan.logit_offsets
            self.masks.apply(result.logits, _constrained(run.work, offsets))
            draws = [(offsets[i], e.turn.sampler) for i, (e, w) in enumerate(run.work)
                     if e.turn.owns(w, ahead=True) and where(e.turn.sampler, w) is Where.DEVICE]  # fmt: skip
            chosen = run.chosen = choose_on_device(result.logits, draws)
            run.logprobs = step_logprobs(result.logits, chosen, _asks(run.work, offsets))
            if run.logprobs is not None:
                run.logprobs.to_host()
            run.prompt = prompt_scores(result.logits, _scoring(run.work, result.plan.score_offsets))
            if run.prompt is not None:
                run.prompt.to_host()
            if chosen is not None and chosen.is_cuda:
                run.host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
                run.host.copy_(chosen, non_blocking=True)
                run.ready = torch.cuda.Event() if run.marks is None else self.trace.end_event()
                run.ready.record()
                if run.marks is not None:
                    run.marks.end = run.ready
            return True
        return False

    def complete(self, run: InFlight) -> None:
        """Wait for ``run``'s tokens and hand each window's to its turn."""
        if not self.finalize(run):
            return
        work, result, s = run.work, run.result, self.stats
        windows = [w for _, w in work]
        with Guard("the step's complete", work) as out:
            t_sync = time.perf_counter()
            if run.ready is not None:
                run.ready.synchronize()
                chosen = run.host.tolist()
            else:
                chosen = run.chosen.tolist() if run.chosen is not None else []
            synced = time.perf_counter()
            s.wait_s += synced - t_sync
            if run.marks is not None:
                run.marks.sync, run.marks.synced = t_sync, synced
            self.engine.speculation.cost.observe(windows, time.perf_counter() - run.t0)
            rows = sum(len(w.tokens) for w in windows)
            s.steps += 1
            s.rows += rows
            layers = self.engine.shape.num_layers
            labels = result.plan.labels
            for label in labels:
                s.route_counts[label] += layers
            offsets = result.plan.logit_offsets
            self._take_early(run, chosen)
        if out.failed:
            return
        for i, (e, w) in enumerate(work):
            if not e.turn.owns(w):  # a run-ahead row of an answer that ended one row earlier
                continue
            lo, hi = offsets[i], offsets[i] + w.logits
            # the turn's own host work (a sampled verify window's draws, grammar, detokenizer,
            # stops, seal and bank): that turn alone fails
            with Guard("the turn's advance", [(e, None)]):
                tokens = window_tokens(e.turn.sampler, w, result.logits[lo:hi], chosen[lo:hi])
                lps = run.logprobs.window(i, tokens) if run.logprobs is not None else None
                scored = run.prompt.window(i, list(w.scores)) if run.prompt is not None and w.scores else None
                e.deliver(e.turn.advance(WindowOutput(tokens, labels[i], layers, lps, scored)))
        now = time.perf_counter()
        seconds = now - max(run.t0, self._done_at)  # overlapped steps: from the previous one's end
        self._done_at = now
        a = 0.1 if s.steps > 1 else 1.0
        s.step_ms += a * (seconds * 1e3 - s.step_ms)
        s.last_rows, s.last_ms = rows, seconds * 1e3
        with Guard("the step observer", ()):  # no turn fails: they have their tokens
            if self.observe is not None:
                self.observe(len(windows), rows, seconds)
        s.rows_per_step += a * (rows - s.rows_per_step)
        if run.marks is not None:
            with Guard("the step trace", ()):
                prompt = sum(len(w.tokens) for w in windows if w.logits < len(w.tokens))
                self.trace.write(run.marks, rows, len(windows), prompt)

    def _take_early(self, run: InFlight, chosen: list[int]) -> None:
        """Constrained turns' tokens to their grammars first, then the next step's masks filled on
        a thread while the turns take their tokens (text, stops, events: the host work of a step).
        A constrained turn never drafts: its tokens are chosen on the device."""
        offsets = run.result.plan.logit_offsets
        early = []
        for i, (e, w) in enumerate(run.work):
            if e.turn.constraint is None or not e.turn.owns(w):
                continue
            try:
                if e.turn.take_early(w, chosen[offsets[i] + w.logits - 1]):
                    early.append(e.turn.constraint)
            except Exception:  # the grammar refused: ``advance`` fails the turn
                continue
        self.masks.start(early)

    @staticmethod
    def _on_host(e: Entry, w: Window) -> bool:
        """Whether ``w``'s tokens, still to be taken, are chosen on the host (``Where.HOST``)."""
        return e.turn.owns(w) and where(e.turn.sampler, w) is Where.HOST


def _constrained(work: Work, offsets: list[int]) -> list:
    """``(logit row, constraint)`` of each window whose turn decodes under a grammar (its one
    logits row: a constrained turn never drafts)."""
    return [
        (offsets[i] + w.logits - 1, e.turn.constraint)
        for i, (e, w) in enumerate(work)
        if w.logits and e.turn.constraint is not None and e.turn.owns(w)
    ]


def _asks(work: Work, offsets: list[int]) -> list[Ask]:
    """The windows (run-ahead ones included) whose turns ask for logprobs, with their rows."""
    return [
        Ask(
            i,
            offsets[i],
            w.logits,
            e.turn.sampler,
            e.turn.request.logprobs,
            where(e.turn.sampler, w) is Where.HOST,
        )
        for i, (e, w) in enumerate(work)
        if w.logits and e.turn.request.logprobs is not None and e.turn.owns(w, ahead=True)
    ]


def _scoring(work: Work, offsets: list[int]) -> list[tuple[Ask, Sequence[int]]]:
    """The windows (run-ahead ones included) that score prompt rows, with the tokens they score."""
    return [
        (Ask(i, offsets[i], len(w.scores), None, e.turn.request.prompt_logprobs or 0), w.scores)
        for i, (e, w) in enumerate(work)
        if w.scores and e.turn.owns(w, ahead=True)
    ]

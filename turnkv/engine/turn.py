"""One owner per turn: begin (admit, restore, pre-size), steps (prefill, decode), finish (rebase,
seal, snapshot, bank).

A ``Turn`` is the whole life of one request after its body became token ids. Whoever drives it (the
scheduler, for the server, ``turnkv chat`` and ``turnkv generate`` alike) asks it for a window each
step and hands back what the step produced:

    turn = Turn(ctx, bank, request)       # ctx: Engine.turn_context()
    events = turn.begin()                 # [Admitted] or [Failed]; the only admission decision
    while not turn.done:
        w = turn.window(budget)           # a prefill chunk, a decode row or the rebase rows
        ...engine.run_step([w, ...]) ...  # with other turns' windows
        events += turn.advance(out)       # the tokens chosen for w's logits rows (None: not run)

Events, in order: ``Admitted`` or ``Failed`` (refused, nothing done), then ``GenEvent`` s (the last
carries ``finish_reason`` and ``stats`` and comes once the turn is banked), then ``Banked`` (or
``Failed`` if the turn broke). The context check and the price are ``admission.reserve``'s; the
tail is sized here once, for what admission granted. A cancelled turn still seals and banks the
rows it computed.

Choices (``TurnRequest.n`` > 1): the turn prefills the prompt once; when its last row is computed
the turn seals the prompt's rows into one segment (``_fork``) and ``n - 1`` forks start from it
by reference (``take_forks``: the scheduler runs them from the next step, beside the first), each
recomputing only the prompt's last row with its own seed. The first choice's turn emits
``Forked``; every choice then ends with its own ``Banked`` (all are banked, sharing the prompt's
segment; only the first under the request's session).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from turnkv.bank.session_bank import MustWait, Refused, SessionBank
from turnkv.engine import admission
from turnkv.engine.chooser import Where, where
from turnkv.engine.events import (
    Admitted,
    Banked,
    Failed,
    Forked,
    GenEvent,
    TurnEvent,
    TurnRequest,
    TurnStats,
    WindowOutput,
)
from turnkv.engine.logprobs import TokenLogprob
from turnkv.engine.masks import Constraint
from turnkv.engine.sampling import SEED_MAX, SEED_MIN, Sampler
from turnkv.engine.step import Window
from turnkv.engine.stops import StopMatcher
from turnkv.kv.cache import common_prefix_len
from turnkv.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from turnkv.engine.context import TurnContext

REBASE_MAX_ROWS = 64  # at most this many rows are prefilled to match the re-rendered history


_PREFILL, _DECODE, _REBASE, _DONE = "prefill", "decode", "rebase", "done"


class Turn:
    """The state of one turn (see the module docstring). Not thread-safe: one driver thread."""

    def __init__(self, ctx: TurnContext, bank: SessionBank, request: TurnRequest) -> None:
        self.ctx = ctx
        self.bank = bank
        self.request = request
        self.phase = _PREFILL
        self.cache = None
        self.lease = None
        self.stats = TurnStats(prompt_tokens=len(request.prompt))
        self.routes: dict[str, int] = {}
        self._text: list[str] = []
        self._pending: list[int] = []  # rows of the current phase not yet computed
        self._next: int | None = None  # the sampled token to feed next (decode)
        self._open: Window | None = None
        self._ahead: Window | None = None  # the window launched while ``_open`` is in flight
        self._matches = (0, 0)  # the match lengths the drafts of ``_open`` and ``_ahead`` follow
        self._t0 = time.perf_counter()
        self._t_first: float | None = None
        self._t_last = 0.0
        self._last: GenEvent | None = None  # the answer's last event, sent once the turn is banked
        self.constraint: Constraint | None = None  # the grammar's state; the step masks its rows
        self._taken: int | None = None  # a token the grammar took before ``advance`` (``take_early``)
        self._forks: list[Turn] = []  # the other choices, made once the prompt is prefilled

    @property
    def done(self) -> bool:
        return self.phase == _DONE

    @property
    def _will_fork(self) -> bool:
        """The first choice of several, whose prompt is still being prefilled."""
        return self.request.n > 1 and self.request.choice == 0 and self.phase == _PREFILL

    def take_forks(self) -> list[Turn]:
        """The other choices' turns, once, when the prompt is prefilled (the scheduler runs them)."""
        out, self._forks = self._forks, []
        return out

    # -- begin ----------------------------------------------------------------------------------
    def begin(self) -> list[TurnEvent] | None:
        """Check the context, price and admit the turn, restore its cache; ``[Admitted]`` or
        ``[Failed]``, or None: it fits only once the running turns have finished (call again)."""
        req, ctx = self.request, self.ctx
        ids = req.prompt
        want = admission.reserve(req, ctx)
        if isinstance(want, Failed):
            self.phase = _DONE
            return [want]
        self.params = req.params
        slack = want.slack
        try:
            reuse = req.prompt_logprobs is None  # scoring the prompt needs its rows' logits
            self.lease = self.bank.admit(req.namespace, ids, want, req.session, wait=True, reuse=reuse)
        except MustWait:
            return None
        except Refused as e:
            self.phase = _DONE
            fix = "a shorter prompt" + (" or a smaller max_tokens" if req.max_tokens is not None else "")
            fix += f" or fewer choices (n={req.n})" if req.n > 1 else ""
            msg = f"{e}; retry with {fix} (the server's KV budget is --bank-bytes)"
            return [Failed("kv_memory_exhausted", msg, e.needed_bytes, e.available_bytes)]
        self._start(self.lease, slack)
        self.stats.cache_break = brk = self.lease.cache_break
        return [Admitted(len(ids), self.lease.cached, self.lease.needed_bytes, brk)]

    def _start(self, lease, slack: int) -> None:
        """Restore the lease's prefix, size the tail, and set up the answer's state."""
        req, ctx, ids = self.request, self.ctx, self.request.prompt
        self.lease, self.slack = lease, slack
        rows = max(lease.reserve_rows - slack, 1)
        self.max_tokens = 0 if req.max_tokens == 0 else rows  # 0: the prompt alone
        self.cache = ctx.layout.restore(lease.snapshot) if lease.snapshot is not None else ctx.layout.new()
        lease.attach(self.cache)
        # the tail is sized once for everything admission priced
        self.cache.presize(len(ids) - lease.cached + rows + slack)
        # the prompt's logprobs so far (``TurnRequest.prompt_logprobs``), sent on the first event
        self._scored: list[TokenLogprob] | None = [] if req.prompt_logprobs is not None else None
        self.stats.cached_tokens = lease.cached
        self._pending = list(ids[lease.cached :])  # the last prompt row is always recomputed
        self.stats.prefilled_tokens = len(self._pending)
        self.sampler = Sampler(self.params, ctx.device, ids)
        self.decoder = StreamDecoder(ctx.tokenizer)
        self.stops = StopMatcher(self.params.stop)
        self.constraint = req.grammar.start() if req.grammar is not None else None
        # a grammar ends the answer with a stop token once it is complete, ignore_eos or not
        ignore = self.params.ignore_eos and self.constraint is None
        self.eos = set() if ignore else set(ctx.tokenizer.eos_token_ids)
        # a constrained turn never drafts: a verify window would need the mask of every draft row
        self.drafts = ctx.drafts(ids) if self.constraint is None else None  # None: off

    # -- steps ----------------------------------------------------------------------------------
    def window(self, budget: int, draft: bool = True) -> Window | None:
        """This turn's rows for the next step (at most ``budget`` rows of prefill), or None when it
        has nothing to compute (finished, or finishing without a rebase). ``draft``: whether a
        draft can fit this step at all (``StepCost.room``; if not, the step is not even counted
        by the turn's governor: a full batch's steps cost its turns nothing)."""
        self._ahead = None  # a run-ahead window is only ever completed through ``advance``
        if self.phase == _DECODE and self.request.cancel.is_set():
            self._open = None  # a window of a step that was interrupted (Ctrl-C) is not pending
            return None
        if self.phase in (_PREFILL, _REBASE):
            self._open = self._chunk(0, budget)
        elif self.phase == _DECODE:
            room = self.max_tokens - self.stats.completion_tokens - 1  # answer rows after _next's
            drafts, match = self._draft(min(budget - 1, room), self.cache.num_tokens) if draft else ([], 0)
            self._matches = (match, 0)
            self._open = Window(self.cache, [self._next, *drafts], logits=1 + len(drafts))
        else:
            self._open = None
        return self._open

    @property
    def rows_left(self) -> int:
        """Prompt (or rebase) rows still to compute, those in flight included (the prompt order's key)."""
        return len(self._pending) if self.phase in (_PREFILL, _REBASE) else 0

    def decodes_next(self) -> bool:
        """Whether this turn's next window is a decode row: it decodes, or the last chunk of its
        prompt is in flight (the scheduler counts decode rows before prefill chunks)."""
        o = self._open
        return self.phase == _DECODE or (self.phase == _PREFILL and o is not None and o.logits == 1)

    def window_ahead(self, budget: int, feed: int, draft: bool = True) -> Window | None:
        """The window after ``_open``, which is in flight (launched, not yet advanced), or None
        when it cannot be known before that step's tokens come back (the turn then sits one step
        out). Known ahead: the next prompt chunk (at most ``budget`` rows), and the decode window
        after a decode window or after the prompt's last chunk: its token is the one the step in
        flight chose on the device at logit row ``feed`` (``chooser``), and its drafts follow the
        copy's guess of that token, after the drafts in flight (``TurnDrafts.draft``'s ``after``
        and ``lag``). Not known: the rebase rows (rendered from the answer's text), a cancelled
        turn's decode row (a prompt goes on being prefilled, as ``window`` does), the window after
        one whose tokens are chosen on the host (a sampled turn's verify window, ``Where.HOST``:
        the pipeline completes its step first), and an answer with no room for the rows in flight
        and one more (so the tail, pre-sized for the answer, never regrows -- a copy that would
        miss the rows in flight). ``advance`` of the window in flight then makes this one the open
        window, or drops it if the answer ended there or a draft in flight was rejected: it was
        planned after rows that are not kept (its KV rows are never committed)."""
        o = self._open
        if o is None or self._ahead is not None:
            return None
        # answer rows after this window's first: the rows in flight bring len(o.tokens) tokens (a
        # prompt's last chunk one), and the answer's last token needs no row
        flying = len(o.tokens) if self.phase == _DECODE else 1
        room = self.max_tokens - self.stats.completion_tokens - flying - 1
        if self.phase == _PREFILL and len(self._pending) > len(o.tokens):  # the next chunk
            self._ahead = self._chunk(len(o.tokens), budget)
        elif (
            self.decodes_next()
            and where(self.sampler, o) is not Where.HOST
            and room >= 0
            and not self.request.cancel.is_set()
            and not self._will_fork  # the fork seals the tail this window would be written into
        ):
            after = o.tokens[1:] if self.phase == _DECODE else ()
            start = self.cache.num_tokens + len(o.tokens)
            drafts, match = self._draft(min(budget - 1, room), start, after, lag=True) if draft else ([], 0)
            self._matches = (self._matches[0], match)
            self._ahead = Window(
                self.cache, [0, *drafts], logits=1 + len(drafts), ahead=len(o.tokens), feed=feed
            )
        return self._ahead

    def take_early(self, w: Window, tok: int) -> bool:
        """Give the grammar ``tok``, the token chosen for this turn's one-row decode window ``w``,
        before ``advance`` takes it, so the next step's mask can be filled while the turns take
        their tokens (``StepMasks.start``). True when the grammar goes on (a mask will be wanted);
        False when it did nothing."""
        con = self.constraint
        if con is None or self.phase != _DECODE or w is not self._open or len(w.tokens) != 1:
            return False
        con.accept(tok)  # a refusal raises here, and the step fails the turn as advance would
        self._taken = tok
        return not con.done

    def owns(self, w: Window, ahead: bool = False) -> bool:
        """Whether ``w`` is this turn's window still to complete (a run-ahead window of an answer
        that ended one row earlier is not); with ``ahead``, also its run-ahead window."""
        return not self.done and (w is self._open or (ahead and w is self._ahead))

    def advance(self, out: WindowOutput | None) -> list[TurnEvent]:
        """After the step that ran ``window``'s rows (``out``; None when ``window`` gave none):
        commit them, take the tokens chosen for them (stop checks, text); may finish."""
        flying, rows = self._open, self.cache.num_tokens if self.cache is not None else 0
        events = self._advance(out)
        ahead, self._ahead = self._ahead, None
        if ahead is None or self._open is not None or self.phase not in (_PREFILL, _DECODE):
            return events
        # it starts where it was planned to only if the window in flight kept every row (no
        # rejected draft); else it is dropped, and the next ``window`` starts from the kept rows
        if flying is not None and self.cache.num_tokens - rows == len(flying.tokens):
            # the window in flight is now the open one (a decode window: its first id is the token
            # just taken); the cache's window covers it again (the commit above closed the cache's)
            if self.phase == _DECODE:
                ahead.tokens = [self._next, *ahead.tokens[1:]]
            ahead.ahead, ahead.feed = 0, None
            self._open = ahead
            self._matches = (self._matches[1], 0)
            self.cache.open_window(len(ahead.tokens))
        elif self.drafts is not None:
            self.drafts.stats.dropped += 1
        return events

    def _advance(self, out: WindowOutput | None) -> list[TurnEvent]:
        w = self._open
        self._open = None
        if w is None:  # nothing was computed: cancelled before its decode row, or done
            return self._end("cancelled") if self.phase == _DECODE else []
        assert out is not None, "a window that ran needs its output"
        self.stats.forwards += 1
        if out.calls:
            self.routes[out.route] = self.routes.get(out.route, 0) + out.calls
        if self.phase == _DECODE:
            return self._verify(w, out)
        self.cache.commit(w.tokens)
        del self._pending[: len(w.tokens)]
        if self.phase == _REBASE:
            return self._finish() if not self._pending else []
        if w.scores:
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(w.scores)
            self._scored += out.prompt_logprobs
        if self._pending:
            return []
        self.stats.prefill_s = time.perf_counter() - self._t0
        forked: list[TurnEvent] = self._fork() if self._will_fork else []
        self.phase = _DECODE
        if self.max_tokens == 0:
            return forked + self._end("length")
        tok = out.tokens[-1]
        if self.drafts is not None:
            self.drafts.push(tok)
        events, finish, flushed = self._take(tok, out.logprobs[-1] if out.logprobs else None)
        events = forked + events
        return events + self._end(finish, flushed) if finish else events

    def fail(self, exc: BaseException) -> list[TurnEvent]:
        """The step this turn was in broke: bank nothing of it (what was banked before stays)."""
        if self.lease is not None:
            self.bank.finish(self.lease, None)
        self.phase = _DONE
        return [Failed("internal_error", f"generation failed: {type(exc).__name__}: {exc}")]

    # -- internals ------------------------------------------------------------------------------
    def _chunk(self, skip: int, budget: int) -> Window:
        """The next chunk of the pending prompt or rebase rows after the first ``skip`` (rows in
        flight): at most ``budget`` (>= 1) and ``prefill_chunk`` rows; the prompt's last chunk
        asks for the logits of its last row."""
        rest = self._pending[skip:]
        n = min(len(rest), max(1, budget), self.ctx.prefill_chunk)
        last = n == len(rest) and self.phase == _PREFILL
        # scoring the prompt: each row's logits give the next prompt token's logprob (the last
        # row's start the answer instead)
        scores = rest[1 : n + 1] if self._scored is not None and self.phase == _PREFILL else ()
        return Window(self.cache, rest[:n], logits=int(last), ahead=skip, scores=scores)

    def _fork(self) -> list[TurnEvent]:
        """Choices (``TurnRequest.n``): the prompt's rows become one sealed segment (its one copy),
        and each other choice continues from all of them but the last by reference -- its own
        tail recomputes that row, as a bank hit does, and samples with its own seed. What
        admission priced for them moves to their leases (``SessionBank.fork``)."""
        req = self.request
        self.cache.seal()
        self.cache.share_prefix()
        prefix = self.cache.snapshot().prefix(len(req.prompt) - 1)
        self.cache.presize(self.max_tokens + self.slack)
        for i, lease in enumerate(self.bank.fork(self.lease, prefix, req.n - 1), 1):
            params = replace(req.params, seed=fork_seed(req.params.seed, i))
            child = Turn(self.ctx, self.bank, replace(req, params=params, choice=i, session=None))
            child.params = params
            child._t0 = self._t0
            child._start(lease, self.slack)
            child._scored = list(self._scored) if self._scored is not None else None
            child.cache.share_prefix()
            self._forks.append(child)
        return [Forked(req.n)]

    def _draft(self, limit: int, start: int, after=(), lag: bool = False) -> tuple[list[int], int]:
        """Tokens from the conversation to verify after a window's first, and the match they
        follow (``TurnDrafts.draft``): at most ``limit`` (the step's row budget and the answer's
        rows left, so no row past what admission priced is ever opened), and within the rows the
        engine runs as one-row decode would from cache row ``start`` (``Engine.verify_rows``)."""
        if self.drafts is None or not self.drafts.may_draft():
            return [], 0
        limit = min(limit, self.ctx.verify_rows(start) - 1)
        return self.drafts.draft(limit, after, lag)

    def _verify(self, w: Window, out: WindowOutput) -> list[TurnEvent]:
        """A decode window ``[_next, d1..dk]``: each row's token was chosen as a plain decode step
        would choose it (``chooser.window_tokens``: ``context_copy``'s exact acceptance); the walk
        stops at the first token that is not the next draft token (the correction; after a full
        match, the bonus) or at the end of the answer. Only the rows up to that cut are committed
        (the rollback: no copy)."""
        draft = w.tokens[1:]
        events: list[TurnEvent] = []
        finish, flushed, accepted, n = None, False, 0, 0
        for i, tok in enumerate(out.tokens):
            n += 1
            if self.drafts is not None:
                self.drafts.push(tok)
            more, finish, flushed = self._take(tok, out.logprobs[i] if out.logprobs else None)
            events += more
            hit = i < len(draft) and tok == draft[i]
            accepted += hit
            if finish or not hit:
                break
        self.cache.commit(w.tokens[:n])  # rows of _next and the accepted drafts; the rest dropped
        s = self.stats
        s.decode_forwards += 1
        s.drafted += len(draft)
        s.accepted += accepted
        s.verify_windows += bool(draft)
        if self.drafts is not None:
            self.drafts.verified(len(draft), accepted, n, self._matches[0])
        else:
            self.ctx.draft_stats.window(0, 0, n)
        return events + self._end(finish, flushed) if finish else events

    def _take(self, tok: int, lp: TokenLogprob | None = None) -> tuple[list[TurnEvent], str | None, bool]:
        """One answer token (``lp``: its logprob, if asked): its event, and the finish reason if
        the answer ends with it (and whether a stop string flushed the held-back text)."""
        if self._taken is not None:  # the grammar has it already (take_early)
            assert tok == self._taken, (tok, self._taken)
            self._taken = None
        elif self.constraint is not None:
            self.constraint.accept(tok)
        n = self.stats.completion_tokens = self.stats.completion_tokens + 1
        now = time.perf_counter()
        if self._t_first is None:
            self._t_first = now
            self.stats.ttft_s = now - self._t0
        else:
            self.stats.token_gaps_s.append(now - self._t_last)
        self._t_last = now
        if tok in self.eos:
            return (
                [GenEvent(tok, "", choice=self.request.choice, prompt_logprobs=self._prompt())],
                "stop",
                False,
            )
        text, hit = self.stops.push(self.decoder.push(tok))
        self._text.append(text)
        events: list[TurnEvent] = [
            GenEvent(tok, text, lp, choice=self.request.choice, prompt_logprobs=self._prompt())
        ]
        if hit:
            return events, "stop", True
        if n >= self.max_tokens:
            return events, "length", False
        if self.request.cancel.is_set():
            return events, "cancelled", False
        self._next = tok
        return events, None, False

    def _prompt(self) -> list[TokenLogprob] | None:
        """The prompt's logprobs, once (the choice's first event carries them), else None."""
        out, self._scored = self._scored, None
        return out

    def _end(self, finish: str, flushed: bool = False) -> list[TurnEvent]:
        """The answer is over: the last ``GenEvent``, then the rebase rows or the finish."""
        tail = ""
        if not flushed:  # text held back for a stop string or a half character is final now
            tail, hit = self.stops.push(self.decoder.flush())
            tail += "" if hit else self.stops.flush()
            finish = "stop" if hit else finish
        self._text.append(tail)
        s = self.stats
        t_end = time.perf_counter()
        if self._t_first is not None:
            s.decode_s = t_end - self._t_first
            s.decode_tok_s = (
                (s.completion_tokens - 1) / s.decode_s if s.completion_tokens > 1 and s.decode_s else 0.0
            )
        # the answer's last event waits until the turn is banked, so a client that has its answer
        # finds it in the bank when it sends the follow-up
        self._last = GenEvent(
            None,
            tail,
            finish_reason=finish,
            stats=s,
            stop_sequence=self.stops.hit,
            choice=self.request.choice,
            prompt_logprobs=self._prompt(),
        )
        render = self.request.render_history
        # a cancelled answer will not come back in the next request: bank it as generated
        if finish in ("stop", "length") and render is not None:
            self._pending = self._rebase_rows(render("".join(self._text)))
            if self._pending:
                self.phase = _REBASE
                return []
        return self._finish()

    def _rebase_rows(self, rendered: list[int]) -> list[int]:
        """Make the cache a prefix of ``rendered`` (trim at the first difference; a rollback, no
        copy); the missing rows, if few enough to prefill (else none)."""
        have = self.cache.tokens
        d = common_prefix_len(have, rendered)
        if d < len(have):
            self.cache.trim(d)
        todo = list(rendered[d:])
        limit = self.ctx.max_context
        # rows that replace trimmed ones (a template that re-renders the answer, e.g. a tool call
        # without the empty think block it was generated after) were priced already
        if len(todo) > REBASE_MAX_ROWS + len(have) - d or (limit and len(rendered) >= limit):
            return []
        self.stats.rebase_rows = len(todo)
        return todo

    def _finish(self) -> list[TurnEvent]:
        self.phase = _DONE
        self.cache.seal()
        snap = self.cache.snapshot()
        eid = self.bank.finish(self.lease, snap)
        self.stats.route_counts = dict(self.routes)  # the rebase rows' calls included
        return [self._last, Banked(eid, snap.num_tokens, self.stats.rebase_rows, self.request.choice)]


def fork_seed(seed: int | None, i: int) -> int | None:
    """Choice ``i``'s seed: ``seed + i``, wrapped into the seeds' range (None: unseeded)."""
    if seed is None:
        return None
    return (seed + i - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN

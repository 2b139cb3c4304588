"""One turn end to end without HTTP: admit, restore, generate, seal, bank -- and the engine worker.

``TurnService.run`` is the whole data path of a request after its body became token ids; the HTTP
app and ``bench/server_multiturn.py --in-process`` both drive it, so the benchmark measures the same
code on a device without fastapi. ``EngineWorker`` runs turns one at a time on a single thread:
concurrent clients wait in its queue and never fail for being concurrent.

Events a turn emits, in order: :class:`Admitted` or :class:`Failed` (refused, nothing done), then
the engine's ``GenEvent`` s, the last of which carries ``finish_reason`` and ``stats``, then
:class:`Banked` (or :class:`Failed` if the engine raised). A cancelled turn (``should_stop``) still
seals and banks the rows it computed.

This module never imports fastapi.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from turnkv.bank.session_bank import Refused, SessionBank
from turnkv.engine.sampling import SamplingParams
from turnkv.kv.cache import common_prefix_len

log = logging.getLogger(__name__)

Emit = Callable[[object], None]


# the most output rows reserved when a request sets no max_tokens (fewer when the context or the
# bank budget cannot hold them: the answer then ends with finish_reason "length")
DEFAULT_MAX_TOKENS = 4096
# rows reserved past the answer for the rebase (the last answer token and the end-of-turn tokens
# the template adds), so the tail need not regrow -- a copy -- to take them
REBASE_SLACK_ROWS = 8


@dataclass
class Turn:
    """What a request asks once its body is parsed and its prompt tokenized.

    ``prompt`` is the token ids (the HTTP handler renders and tokenizes them off the event loop and
    off this thread). ``max_tokens`` None means as many as the context and the bank budget allow,
    at most ``DEFAULT_MAX_TOKENS``; an explicit value that does not fit the context is a 400
    (``context_length_exceeded``), as with vLLM.
    ``render_history`` (optional) returns the token ids the client will send back for this
    conversation once the answer text is appended (the chat template applied to the history plus
    the answer, or the completion prompt plus its text); the service banks rows matching those ids,
    so the next turn reuses all of them (see :meth:`TurnService.rebase`).
    """

    prompt: list[int]
    params: SamplingParams
    max_tokens: int | None = None
    namespace: str = ""
    session: str | None = None
    render_history: Callable[[str], list[int]] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Admitted:
    prompt_tokens: int
    cached_tokens: int
    needed_bytes: int


@dataclass(frozen=True)
class Banked:
    entry_id: int | None
    banked_tokens: int
    rebase_rows: int  # rows recomputed after the answer so the bank matches the re-rendered history


@dataclass(frozen=True)
class Failed:
    """A turn that ended without an answer: ``status`` is the HTTP status the app answers with."""

    status: int
    message: str
    code: str | None = None
    needed_bytes: int | None = None
    available_bytes: int | None = None


class TurnService:
    """The engine, the bank and the policy between them. Not thread-safe: one turn at a time.

    ``rebase`` (default on): after an answer, the banked rows are made to match the history as the
    client will resend it -- rows past the first token where the re-rendered history differs from
    the generated tokens are trimmed and the rest of the re-rendered answer (e.g. the end-of-turn
    tokens the model never fed back) is prefilled, at most ``rebase_max_rows`` rows.
    """

    def __init__(self, engine, bank: SessionBank, rebase: bool = True, rebase_max_rows: int = 64) -> None:
        self.engine = engine
        self.bank = bank
        self.rebase_enabled = rebase
        self.rebase_max_rows = rebase_max_rows

    def prepare(self, turn: Turn) -> tuple[list[int], SamplingParams] | Failed:
        """Token ids and sampling parameters (``max_tokens`` as asked, or the most the context
        allows up to ``DEFAULT_MAX_TOKENS``), or the 400 that the request earns."""
        ids = list(turn.prompt)
        if not ids:
            return Failed(400, "the prompt is empty")
        limit = self.engine.max_context
        if limit and len(ids) + 1 > limit:
            msg = (
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(ids)} tokens (at least one more is needed to answer). Shorten the messages."
            )
            return Failed(400, msg, "context_length_exceeded")
        if turn.max_tokens is not None and limit and len(ids) + turn.max_tokens > limit:
            msg = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + turn.max_tokens} tokens ({len(ids)} in the messages, {turn.max_tokens} in "
                f"the completion). Reduce the length of the messages or the completion."
            )
            return Failed(400, msg, "context_length_exceeded")
        max_tokens = turn.max_tokens or DEFAULT_MAX_TOKENS
        if limit:
            max_tokens = min(max_tokens, limit - len(ids))
        return ids, replace(turn.params, max_tokens=max_tokens)

    def run(self, turn: Turn, emit: Emit) -> None:
        """Run one turn, reporting through ``emit``; never raises for a refused or failed turn."""
        ready = self.prepare(turn)
        if isinstance(ready, Failed):
            emit(ready)
            return
        ids, params = ready
        slack = REBASE_SLACK_ROWS if self.rebase_enabled and turn.render_history is not None else 0
        try:
            # without an explicit max_tokens the reservation shrinks to what the budget can hold
            lease = self.bank.admit(
                turn.namespace,
                ids,
                params.max_tokens + slack,
                self.engine.activation_bytes,
                turn.session,
                min_reserve_rows=1 + slack if turn.max_tokens is None else None,
            )
        except Refused as e:
            fix = (
                "a shorter prompt or a smaller max_tokens"
                if turn.max_tokens is not None
                else "a shorter prompt"
            )
            msg = f"{e}; retry with {fix} (the server's KV budget is --bank-bytes)"
            emit(Failed(507, msg, "kv_memory_exhausted", e.needed_bytes, e.available_bytes))
            return
        params = replace(params, max_tokens=max(lease.reserve_rows - slack, 1))
        cache = self.engine.restore(lease.snapshot) if lease.snapshot is not None else self.engine.new_cache()
        lease.attach(cache)
        # the tail is sized once for everything admission priced (generate plans less: no slack)
        cache.plan(len(ids) - lease.cached + params.max_tokens + slack)
        emit(Admitted(len(ids), lease.cached, lease.needed_bytes))
        text: list[str] = []
        finish = None
        try:
            for ev in self.engine.generate(cache, ids, params, should_stop=turn.cancel.is_set):
                text.append(ev.text)
                finish = ev.finish_reason
                emit(ev)
        except Exception as e:  # a broken turn must not take the worker down; bank nothing of it
            log.exception("generation failed")
            self.bank.finish(lease, None)
            emit(Failed(500, f"generation failed: {type(e).__name__}: {e}", "internal_error"))
            return
        rows = 0
        # a cancelled answer will not come back in the next request: bank it as generated
        if finish in ("stop", "length") and self.rebase_enabled and turn.render_history is not None:
            rows = self.rebase(cache, turn.render_history("".join(text)))
        cache.seal()
        snap = cache.snapshot()
        eid = self.bank.finish(lease, snap)
        emit(Banked(eid, snap.num_tokens, rows))

    def rebase(self, cache, rendered: Sequence[int]) -> int:
        """Make ``cache`` hold a prefix of ``rendered`` that ends with the re-rendered answer.

        Rows from the first difference on are trimmed (a rollback, no copy); then up to
        ``rebase_max_rows`` missing rows of ``rendered`` are prefilled. Returns the rows prefilled.
        """
        have = cache.tokens
        d = common_prefix_len(have, rendered)
        if d < len(have):
            cache.trim(d)
        todo = list(rendered[d:])
        if not todo or len(todo) > self.rebase_max_rows:
            return 0
        if self.engine.max_context and len(rendered) >= self.engine.max_context:
            return 0
        self.engine.prefill(cache, todo)
        return len(todo)


@dataclass
class Job:
    turn: Turn
    emit: Emit


class EngineWorker:
    """A single thread that runs queued turns one at a time, in arrival order."""

    def __init__(self, service: TurnService) -> None:
        self.service = service
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._jobs: list[Job] = []  # queued and running (removed when done), for stop()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="turnkv-engine", daemon=True)
        self.busy = False
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, turn: Turn, emit: Emit) -> None:
        with self._lock:
            self._jobs.append(job := Job(turn, emit))
        self._queue.put(job)

    def cancel_all(self) -> None:
        """Cancel every queued and running turn: a running one stops at its next token (its answer
        ends with ``finish_reason`` "cancelled") and still banks what it computed. Thread-safe."""
        with self._lock:
            for job in self._jobs:
                job.turn.cancel.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every turn (``cancel_all``), then stop; wait at most ``timeout`` s for the thread."""
        self.cancel_all()
        self._queue.put(None)
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.busy = True
            try:
                if job.turn.cancel.is_set():
                    job.emit(Failed(499, "the client went away before the turn started", "cancelled"))
                else:
                    self.service.run(job.turn, job.emit)
            except Exception as e:  # never let one job end the worker
                log.exception("turn failed")
                job.emit(Failed(500, f"internal error: {type(e).__name__}: {e}", "internal_error"))
            finally:
                self.busy = False
                with self._lock:
                    self._jobs.remove(job)

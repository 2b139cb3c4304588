"""A running turn's entry in the scheduler (``Entry``) and the fault fence around each stage of a
step (``Guard``): an exception in a stage ends exactly the turns that stage concerns, with a
``Failed`` (``internal_error``: HTTP 500) and their leases released, and the loop goes on
(docs/SCHEDULER.md, "Admission: wait, or refuse"; tests/test_faults.py pins each stage)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from turnkv.engine.events import Banked, Failed, TurnEvent
from turnkv.engine.step import Window
from turnkv.engine.turn import Turn

log = logging.getLogger(__name__)

Emit = Callable[[TurnEvent], None]


@dataclass
class Entry:
    """A submitted turn and where its events go."""

    turn: Turn
    emit: Emit
    submitted: float = 0.0  # time.monotonic() at submit
    admitted: int = 0  # the scheduler's step count at admission (the prompt order's age)
    ended: bool = False  # its last event (Banked or Failed) was sent
    deaf: bool = False  # its emit raised: the turn was cancelled

    @property
    def live(self) -> bool:
        return not (self.ended or self.turn.done)

    def deliver(self, events: list[TurnEvent]) -> None:
        for ev in events:
            if isinstance(ev, (Banked, Failed)):
                self.ended = True  # it leaves the queue and the running set
            try:
                self.emit(ev)
            except Exception:  # nobody can hear this turn: it stops as a client that left does
                if not self.deaf:
                    log.exception("a turn's event could not be delivered: the turn is cancelled")
                self.deaf = True
                self.turn.request.cancel.set()

    def fail(self, stage: str, exc: Exception) -> None:
        """End the turn with an error: its lease is released (nothing of this turn is banked; what
        was banked before stays), and its client gets ``Failed`` whatever else breaks."""
        try:
            self.turn.fail(exc)
        except Exception:
            log.exception("releasing a failed turn raised too")
        self.deliver([Failed("internal_error", f"{stage} failed: {type(exc).__name__}: {exc}")])


Pairs = Sequence[tuple[Entry, Window | None]]  # turns of a stage, with their windows in it


class Guard:
    """``with``: one stage of ``work`` (pairs of an entry and its window in the stage, None: the
    turn itself; or a callable that lists them once the stage has raised). If it raises an
    ``Exception``, each turn it concerns ends with ``internal_error`` (``Entry.fail``), the
    exception goes no further and ``failed`` is set. (A class: a step enters one per turn.)"""

    __slots__ = ("failed", "stage", "work")

    def __init__(self, stage: str, work: Pairs | Callable[[], Pairs]) -> None:
        self.stage, self.work, self.failed = stage, work, False

    def __enter__(self) -> Guard:
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
            e.fail(self.stage, exc)
        return True

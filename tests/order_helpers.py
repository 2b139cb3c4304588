"""The prompt order's bound (``engine/prompt_order.py``'s docstring), computed from its statement
for the scheduler tests, and a recorder of when each turn was admitted and had its prompt done."""

from __future__ import annotations

import math
from dataclasses import dataclass

from turnkv.engine.prompt_order import AGE_ROWS
from turnkv.engine.scheduler import Scheduler
from turnkv.engine.turn import Turn


@dataclass
class Seen:
    rows: int  # prompt rows to compute at admission
    admitted: int  # the step of its admission
    done: int | None = None  # the step that computed its last prompt row


def last_row_bound(p: Seen, everyone: list[Seen], r: int) -> int:
    """The last step by which ``p``'s last prompt row is computed: the rows that any other prompt
    ``q`` can take ahead of it are at most ``min(L_q, L_p + AGE_ROWS * (admitted_p - admitted_q))``,
    and each step the front of the order up to ``p`` takes ``r`` rows or finishes."""
    ahead = sum(
        max(0, min(q.rows, p.rows + AGE_ROWS * (p.admitted - q.admitted))) for q in everyone if q is not p
    )
    return p.admitted + math.ceil((p.rows + ahead) / r) - 1


def record(sched: Scheduler, turns: dict[int, Turn], seen: dict[int, Seen]) -> None:
    """After a step: the turns admitted in it, and those whose prompt it finished (each turn must
    answer at least two tokens, so that it is still running after the step of its first)."""
    step = sched.steps - 1
    for e in sched.running:
        i = next((i for i, t in turns.items() if t is e.turn), None)
        if i is not None and i not in seen:
            assert e.admitted == step
            seen[i] = Seen(e.turn.stats.prefilled_tokens, step)
    for i, t in turns.items():
        if i in seen and seen[i].done is None and t.phase != "prefill":
            seen[i].done = step

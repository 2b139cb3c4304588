"""The order in which a step's prompts take its prompt rows (docs/SCHEDULER.md, "The prompt order").

One owner per decision: the scheduler orders the prompts (here), the budget (``engine/budget.py``)
says how many prompt rows a step takes. Decode rows go before every prompt; then the prompts in
this order, each taking what it needs of the rows left (a long prompt is chunked into what the
shorter ones leave).

**Shortest first, aged.** A prompt's key is its rows left minus ``AGE_ROWS`` for every step since
it was admitted; the smallest key goes first, ties in admission order. A follow-up of 150 new rows
on a cached history goes before a 12K-token first turn that arrived earlier, and among first turns
of one length the one started goes on (fewer rows left): the mean time to a first token is what
shortest-first minimizes.

**No prompt starves.** All keys fall at the same rate, so a prompt ``Q`` goes before ``P`` only
while ``left_Q <= left_P + AGE_ROWS * (admitted_P - admitted_Q)``. Hence:

- no prompt admitted ``ceil(L / AGE_ROWS)`` or more steps after ``P`` (``L``: ``P``'s rows at its
  admission) ever goes before it; and
- while ``Q`` goes before ``P`` it has at most ``L + AGE_ROWS * (admitted_P - admitted_Q)`` rows
  left, so the rows any ``Q`` takes ahead of ``P`` are at most
  ``min(L_Q, L + AGE_ROWS * (admitted_P - admitted_Q))`` (none where that is below one).

Every step, the prompts from the front of the order up to ``P`` take at least ``r`` rows between
them (``r``: the fewest prompt rows the budget gives a step, at most ``--prefill-chunk``) or
finish, so ``P``'s last prompt row is computed within ``ceil((L + the sum of those bounds) / r)``
steps from its admission (without run-ahead; ``tests/test_prompt_order.py`` checks it through the
real scheduler for any arrival order). ``AGE_ROWS`` sets how long shorter prompts may pass a long one: a 12K-token
prompt is passed by no prompt admitted ~750 steps after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
AGE_ROWS = 16  # rows of priority a prompt gains per step since its admission


def prompt_key(rows_left: int, admitted: int, step: int) -> int:
    """The order's key of a prompt with ``rows_left`` rows to go, admitted at step ``admitted``,
    at step ``step`` (smaller goes first)."""
    return rows_left - AGE_ROWS * (step - admitted)


def order(prompts: Sequence[T], left: Callable[[T], int], admitted: Callable[[T], int], step: int) -> list[T]:
    """``prompts`` (in admission order) in the order they take this step's prompt rows."""
    return sorted(prompts, key=lambda p: prompt_key(left(p), admitted(p), step))  # stable: ties by admission

"""Warnings for disk-tier events that can repeat per block: one line a minute at most, with a count.

Under load the same event (a write dropped because the queue is full, a block deleted between a
restore's lookup and its read) can happen for every block of every turn; one warning per block
would bury the log. :class:`EveryMinute` logs the first occurrence of a kind at once and then at
most one line per period, each saying how many occurred since the previous line. The counters on
``/health.disk`` keep the exact totals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

PERIOD_S = 60.0


class EveryMinute:
    """Rate-limited warnings by kind; thread-safe."""

    def __init__(
        self, log: logging.Logger, period: float = PERIOD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log = log
        self.period = period
        self.clock = clock
        self._mu = threading.Lock()
        self._last: dict[str, float] = {}  # kind -> when its last line was logged
        self._since: Counter[str] = Counter()  # kind -> occurrences not yet in a line

    def note(self, kind: str, message: str, n: int = 1) -> None:
        """Count ``n`` occurrences of ``kind``; when a line is due, log ``message % count`` (its
        one ``%d`` is the count since the previous line of this kind)."""
        now = self.clock()
        with self._mu:
            self._since[kind] += n
            last = self._last.get(kind)
            if last is not None and now - last < self.period:
                return
            self._last[kind] = now
            count = self._since.pop(kind)
        self.log.warning(message, count)

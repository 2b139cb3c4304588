"""Items from the engine thread to the event loops' handlers, one wake-up per loop per step.

``loop.call_soon_threadsafe`` per event writes the loop's self-pipe and hands the GIL to the loop
thread once per token of every stream: under 32 streams the step thread waits on it 32 times a
step. ``LoopPost.post`` only queues; the engine thread calls ``flush`` at the end of each step
(and of anything else that emits), which wakes each loop once with that step's items in order.

Invariant: items posted to a loop run on it in the order they were posted, at the next ``flush``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

Call = tuple[Callable[[object], None], object]  # (a loop-side function, its item)


def _run(calls: list[Call]) -> None:  # on the loop
    for fn, item in calls:
        fn(item)


class LoopPost:
    """Calls queued for event loops from another thread, delivered at ``flush``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[asyncio.AbstractEventLoop, list[Call]] = {}

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[[object], None], item: object) -> None:
        """Queue ``fn(item)`` to run on ``loop`` at the next ``flush``. Thread-safe."""
        with self._lock:
            self._pending.setdefault(loop, []).append((fn, item))

    def flush(self) -> None:
        """Wake every loop with something queued, once, with its calls in order. Thread-safe."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for loop, calls in pending.items():
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
                loop.call_soon_threadsafe(_run, calls)

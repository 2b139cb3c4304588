"""Torch's CPU threads per step, chosen by measuring steps (``--threads 0`` on a CPU).

Why measured and not fixed: OpenMP threads that spin between parallel regions keep a decode step's
~120 small int4 matmuls cheap on several cores, and threads that wait passively pay a wake-up in
every one of them. But with another process busy on one core, a spinning team waits for its
partner's time slice and falls far below one thread (docs/BENCHMARKS.md, issue 11). No fixed
count is right on both machines, and a neighbour can come and go while the server runs.

So the governor measures decode steps (every window one row: frequent, alike from one step to
the next, and the most sensitive to a team's wake-ups): it runs ``probes`` of them at each
candidate count, interleaved, keeps the count with the lowest median seconds per window (a count
whose best of two steps is twice another's best is dropped at once), and probes again after
``period`` decode steps, or as soon as the recent median of the kept count is ``drift`` times what
the probe measured (a neighbour arrived), or its last ``SEVERE`` steps each ``cut`` times (a
neighbour arrived beside a spinning team: steps of seconds). One step never decides alone: a
step can take several times its usual time beside a busy neighbour or on an engine's first use,
and a count dropped on such a sample left a 2-core VM on a spinning 2-thread team at 0.1-6 s a
step for 16 steps before the drift rule probed again (the 4-5x gap between two engines of
``bench/decode.py --deterministic on,off``, docs/BENCHMARKS.md). Candidates: the cores available, half of them, and one. Other
steps take the kept count without being timed, because their times do not compare: prefill
chunks differ in size, and a verify window of drafts costs more than a decode row. Prefill
suffers the same contention.

Switching counts between steps must not change a row's bits, or cached and uncached answers
could part: ``tests/test_cpu_threads.py`` pins a prefill step's and a decode step's logits
bit-identical on 1 and 2 threads (the int4 kernel, the wide bf16 GEMM, the CPU flash kernel) and
greedy text with the count alternating every step.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence

import torch

from turnkv.threads import available_cores, set_threads

SEVERE = 4  # consecutive steps of the kept count each ``cut`` times its probe's median: probe again


def is_decode(window_rows: Sequence[int]) -> bool:
    """A decode step, the kind the governor times: every window one row."""
    return bool(window_rows) and max(window_rows) == 1


def candidates(cores: int) -> tuple[int, ...]:
    """The counts a governor tries on ``cores`` cores: all, half, one (deduplicated)."""
    return tuple(dict.fromkeys((cores, max(1, cores // 2), 1)))


class ThreadGovernor:
    """Sets torch's thread count before each CPU step and times decode steps (see the module doc).

    ``begin(window_rows)`` before the forward, ``end(seconds)`` after it (the engine thread
    only; a step that raised calls no ``end``). ``set_threads`` is injectable so the policy is
    testable without timing anything.

    State: ``queue`` the counts still to probe (in order), ``samples`` the seconds per window measured
    per count in the current probe (``dropped``: counts that lost at once), ``chosen`` the kept count, ``baseline`` its median in the probe
    that chose it, ``recent`` its latest decode steps.
    """

    mode = "auto"

    def __init__(
        self,
        cores: int,
        probes: int = 4,
        period: int = 256,
        drift: float = 1.5,
        cut: float = 2.0,
        set_threads: Callable[[int], None] | None = None,
    ) -> None:
        self.counts = candidates(cores)
        self.probes = max(1, probes)
        self.period = max(1, period)
        self.drift = drift
        self.cut = cut
        self._set = set_threads or _set_count
        self.chosen = self.counts[0]
        self.queue: list[int] = []
        self.samples: dict[int, list[float]] = {}
        self.baseline = 0.0
        self.since = 0  # decode steps since the last probe ended
        self.recent: deque[float] = deque(maxlen=16)
        self.probes_done = 0
        self._timing: tuple[int, int] | None = None  # (count, windows) of the decode step begun last
        self._start_probe()

    def begin(self, window_rows: Sequence[int]) -> int:
        """Set the thread count for a step of windows of ``window_rows`` rows; returns it."""
        decode = is_decode(window_rows)
        n = self.queue[0] if decode and self.queue else self.chosen
        self._set(n)
        self._timing = (n, len(window_rows)) if decode else None
        return n

    def end(self, seconds: float) -> None:
        """Record the step begun last: ``seconds`` of forward."""
        timing, self._timing = self._timing, None
        if timing is None:
            return
        n, windows = timing
        per_window = seconds / windows
        if self.queue:
            self.samples.setdefault(n, []).append(per_window)
            self.queue.pop(0)
            self._drop_losers()
            if not self.queue:
                self._choose()
            return
        self.since += 1
        self.recent.append(per_window)
        full = len(self.recent) == self.recent.maxlen
        last = list(self.recent)[-SEVERE:]
        if (
            self.since >= self.period
            or (full and statistics.median(self.recent) > self.drift * self.baseline)
            or (len(last) == SEVERE and min(last) > self.cut * self.baseline)
        ):
            self._start_probe()

    @property
    def probing(self) -> bool:
        """Whether decode steps are still being timed at other counts (a bench waits this out)."""
        return bool(self.queue)

    def health(self) -> dict:
        """``/health.scheduler.threads``: the mode, the candidates, the count in use, probes run."""
        return {
            "mode": self.mode,
            "candidates": list(self.counts),
            "threads": self.chosen,
            "probes": self.probes_done,
        }

    def _start_probe(self) -> None:
        # the kept count first, then the others, round after round: neighbours in time are compared
        order = [self.chosen, *(c for c in self.counts if c != self.chosen)]
        self.queue = order * self.probes if len(order) > 1 else []
        self.samples = {}
        self.dropped: set[int] = set()  # counts that lost at once in this probe
        self.since = 0
        self.recent.clear()

    def _drop_losers(self) -> None:
        """Stop probing a count whose best of two or more steps is ``cut`` times another's best:
        beside a busy process a spinning team's step can take many times one thread's, so each
        such probe step costs the server what many steps would (docs/BENCHMARKS.md, issue 11).
        Never on one step of the loser: one slow outlier would drop the right count."""
        best = {n: min(v) for n, v in self.samples.items()}
        fastest = min(best.values())
        losers = {n for n, b in best.items() if b > self.cut * fastest and len(self.samples[n]) >= 2}
        if losers:
            self.dropped |= losers  # out of this probe's choice too (``_choose``)
            self.queue = [n for n in self.queue if n not in losers]
            if len(set(self.queue)) == 1:  # no rival left to compare with
                self.queue = []

    def _choose(self) -> None:
        medians = {n: statistics.median(v) for n, v in self.samples.items() if n not in self.dropped}
        self.chosen = min(medians, key=lambda n: (medians[n], -n))
        self.baseline = medians[self.chosen]
        self.probes_done += 1
        self.samples = {}


class FixedThreads:
    """``--threads N`` (or a device that is not a CPU, or one core): nothing is chosen per step."""

    def __init__(self, threads: int | None) -> None:
        self.threads = threads

    @property
    def mode(self) -> str:
        return "fixed" if self.threads else "none"

    probing = False  # nothing is timed

    def begin(self, window_rows: Sequence[int]) -> int:
        return self.threads or 0

    def end(self, seconds: float) -> None:
        pass

    def health(self) -> dict:
        return {"mode": self.mode, "threads": self.threads}


def make_thread_policy(device: torch.device, threads: int, tensor_parallel: bool):
    """The engine's policy: a ``ThreadGovernor`` on a CPU with more than one core and
    ``--threads 0``; else ``FixedThreads`` (torch's count as the CLI set it, or None off CPU).
    Not under tensor parallelism: every rank must run the same steps the same way."""
    if device.type != "cpu":
        return FixedThreads(None)
    cores = available_cores()
    if threads > 0 or cores <= 1 or tensor_parallel:
        return FixedThreads(threads or torch.get_num_threads())
    return ThreadGovernor(cores)


def _set_count(n: int) -> None:
    set_threads(n)  # n >= 1: that count exactly, torch called only when it differs

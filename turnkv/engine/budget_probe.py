"""``--max-batch-tokens auto``'s start-up measurement: the time of a step of prompt rows at each row
count, through the real step path (a scheduler over a bank of its own, so graphs are captured as
serving captures them), from which ``budget.StepCurve`` predicts a step's cost and finds where a
step stops getting cheaper per row (``StepCurve.knee``: the budget's ceiling).

A step of ``n`` rows is ``ceil(n / --prefill-chunk)`` fresh one-chunk prompts prefilled together
(one answer token each). Each size runs ``reps`` times and the fastest counts (the first may
compile kernels and capture a graph, which the warm-up that follows would do anyway). The probe
stops once it has spent ``SPEND_S`` (a slow or busy CPU). The ceiling is the knee, never below
``--prefill-chunk`` (``Probe.ceiling``). ``Runtime.measure_budget`` runs it before the warm-up (which compiles up to
the chosen ceiling).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from turnkv.engine.budget import StepCurve
from turnkv.engine.events import TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

CUDA_ROWS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)  # the mixed graphs' row buckets, by twos
CPU_ROWS = (16, 32, 64, 128, 256, 512)
SPEND_S = {"cuda": 60.0, "cpu": 10.0}  # the probe's time at most (other devices: the CPU's)
NAMESPACE = "turnkv-budget-probe"


@dataclass(frozen=True)
class Probe:
    curve: StepCurve
    seconds: float  # the probe's own time (start-up)
    complete: bool  # every size of ``probe_sizes`` ran
    cached: bool = False  # read back from an earlier start's measurement (``probe_cache``)

    def ceiling(self, prefill_chunk: int) -> int:
        """The most rows of a step: the knee, never fewer than ``prefill_chunk`` (the fixed
        default: a probe timed on a noisy machine may find a knee too low, and fewer rows a
        step never prefill faster)."""
        return max(self.curve.knee(), prefill_chunk)


def probe_sizes(device: str, room: int) -> list[int]:
    """The row counts probed on ``device`` (``cuda``/``cpu``/...), within ``room`` context rows."""
    sizes = CUDA_ROWS if device == "cuda" else CPU_ROWS
    return [n for n in sizes if n < room] or [max(1, room // 2)]


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` ids sharing no prefix with another seed's (each prompt prefills all of its rows)."""
    span = max(1, min(vocab, 32000) - 200)
    return [100 + (seed * 7919 + i * 104729) % span for i in range(n)]


def probe(sched: Scheduler, reps: int = 2) -> Probe:
    """Time prompt-only steps on ``sched`` (idle, over a bank of its own, ``max_running`` at
    least ``max(sizes) / prefill_chunk``, no run-ahead: a step's time is its launch to its tokens)."""
    engine = sched.engine
    vocab = engine.loaded.config.vocab_size
    room = (engine.max_context or 1 << 20) - 8
    chunk = engine.prefill_chunk
    times: list[float] = []
    sizes: list[int] = []
    seed = 1
    t0 = time.perf_counter()
    seen: list[tuple[int, float]] = []
    sched.pipeline.observe = lambda windows, rows, seconds: seen.append((rows, seconds))
    device = engine.shape.device.type
    spend = SPEND_S.get(device, SPEND_S["cpu"])
    reps += device == "cuda"  # the first compiles and captures
    todo = probe_sizes(device, room)
    for n in todo:
        k = math.ceil(n / chunk)
        if k > sched.max_running or time.perf_counter() - t0 > spend:
            break
        best = math.inf
        for _ in range(reps):
            seen.clear()
            for i in range(k):
                rows = n // k + (i < n % k)
                request = TurnRequest(
                    _prompt(rows, seed, vocab), SamplingParams(ignore_eos=True), 1, namespace=NAMESPACE
                )
                seed += 1
                sched.submit(request, lambda ev: None)
            while sched.busy:
                sched.step()
            best = min([best, *(s for r, s in seen if r == n)])
        if not math.isfinite(best):  # the step did not run as one (it failed: logged by the guard)
            log.warning("budget probe: no %d-row step ran; probing stops there", n)
            break
        sizes.append(n)
        times.append(best * 1e3)
    sched.pipeline.observe = None
    if not sizes:
        raise RuntimeError("the budget probe ran no step (see the errors above)")
    for i in range(1, len(times)):  # more rows never cost less (noise): keep the curve monotone
        times[i] = max(times[i], times[i - 1])
    curve = StepCurve(tuple(sizes), tuple(times))
    secs = time.perf_counter() - t0
    log.info(
        "budget probe: %s in %.1f s; knee %d rows", dict(zip(sizes, times, strict=True)), secs, curve.knee()
    )
    return Probe(curve, secs, len(sizes) == len(todo))

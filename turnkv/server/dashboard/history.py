"""The dashboard's short memory: one sample a second for the last five minutes, kept by the server.

A sample holds the bank's figures exactly as ``/health`` reports them at that moment, the live
bytes and the logical bytes (see ``bankview``), and the cumulative event counters of ``/metrics``
(tokens of finished turns, time-to-first-token sum and count). Rates are differences of
consecutive samples, so the page's charts and ``/metrics`` always agree. Tokens are counted when a
turn finishes (that is when ``/metrics`` counts them), so a long answer shows as one step, not a
ramp; the live-turn table shows progress in between.

The ring is filled by :meth:`History.run` (a task of the app's lifespan) and, where no lifespan
runs, by :meth:`History.maybe_sample` on each state request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
WINDOW_S = 300  # five minutes of samples
RATE_WINDOW_S = 5  # tokens/s "now" is the average over this many seconds
TTFT_WINDOW_S = 60  # "recent" time to first token


@dataclass(frozen=True)
class Sample:
    t: float  # unix time
    banked_bytes: int
    live_bytes: int
    logical_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    refusals: int
    generated_tokens: int
    prefilled_tokens: int
    ttft_sum_s: float
    ttft_count: int


def _value(metric, suffix: str) -> float:
    """One sample of a prometheus_client metric of ours, through its public ``collect()``."""
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith(suffix) and not s.labels:
                return s.value
    return 0.0


def take_sample(srv, doc: dict, live_total_bytes: int, logical_bytes: int) -> Sample:
    """A sample from a ``/health`` document ``doc`` and the figures it lacks."""
    bank = doc["bank"]
    m = srv.metrics
    return Sample(
        t=time.time(),
        banked_bytes=bank["unique_bytes"],
        live_bytes=max(live_total_bytes - bank["unique_bytes"], 0),  # as /metrics' turnkv_kv_live_bytes
        logical_bytes=logical_bytes,
        entries=bank["entries"],
        hits=bank["hits"],
        misses=bank["misses"],
        evictions=bank["evictions"],
        refusals=bank["refusals"],
        generated_tokens=int(_value(m.generated_tokens, "_total")),
        prefilled_tokens=int(_value(m.prefilled_tokens, "_total")),
        ttft_sum_s=_value(m.ttft, "_sum"),
        ttft_count=int(_value(m.ttft, "_count")),
    )


class History:
    """The ring of samples; ``sample`` is a callable returning a fresh :class:`Sample`."""

    def __init__(self, sample, interval_s: float = INTERVAL_S, window_s: float = WINDOW_S) -> None:
        self.sample = sample
        self.interval_s = interval_s
        self.ring: deque[Sample] = deque(maxlen=int(window_s / interval_s))

    def offer(self, s: Sample) -> None:
        """Keep ``s`` unless the last kept sample is younger than the interval."""
        if not self.ring or s.t - self.ring[-1].t >= self.interval_s * 0.95:
            self.ring.append(s)

    def maybe_sample(self) -> None:
        """Sample now unless the last sample is younger than the interval."""
        if not self.ring or time.time() - self.ring[-1].t >= self.interval_s * 0.95:
            self.ring.append(self.sample())

    async def run(self) -> None:
        """Sample every interval until cancelled; a failed sample is logged and skipped."""
        while True:
            try:
                self.maybe_sample()
            except Exception:  # a status page must never take the server down
                log.exception("dashboard sample failed")
            await asyncio.sleep(self.interval_s)

    # -- what the page gets ------------------------------------------------------------------
    def series(self) -> dict:
        """Columns over the ring: times, bytes, tokens/s and events per interval (first interval 0)."""
        ring = list(self.ring)
        t = [round(s.t, 2) for s in ring]
        out: dict[str, list] = {
            "t": t,
            "banked_bytes": [s.banked_bytes for s in ring],
            "live_bytes": [s.live_bytes for s in ring],
            "logical_bytes": [s.logical_bytes for s in ring],
        }
        pairs = list(zip(ring[:1] + ring[:-1], ring, strict=True))
        # rates over the rounded times the page gets, so rate x interval gives back each
        # interval's tokens (over the exact times, the times' rounding would scale them)
        spans = [max(tb - ta, 1e-9) for ta, tb in zip(t[:1] + t[:-1], t, strict=True)]
        for name in ("generated_tokens", "prefilled_tokens"):
            out[name.replace("_tokens", "_tok_s")] = [
                round((getattr(b, name) - getattr(a, name)) / dt, 4) if b is not a else 0.0
                for (a, b), dt in zip(pairs, spans, strict=True)
            ]
        for name in ("hits", "misses", "evictions", "refusals"):
            out[name] = [getattr(b, name) - getattr(a, name) for a, b in pairs]
        return out

    def rates(self, last: Sample) -> dict:
        """Tokens/s over the ``RATE_WINDOW_S`` up to ``last`` (a fresh sample, kept or not) and the
        mean time to first token: over ``TTFT_WINDOW_S`` and since the start."""
        ring = [s for s in self.ring if s.t < last.t] + [last]
        a = _since(ring, last.t - RATE_WINDOW_S)
        dt = max(last.t - a.t, 1e-9)
        f = _since(ring, last.t - TTFT_WINDOW_S)
        recent = last.ttft_count - f.ttft_count
        return {
            "tokens_per_s": round((last.generated_tokens - a.generated_tokens) / dt, 2)
            if a is not last
            else 0.0,
            "prefill_tokens_per_s": (
                round((last.prefilled_tokens - a.prefilled_tokens) / dt, 2) if a is not last else 0.0
            ),
            "ttft_s": round((last.ttft_sum_s - f.ttft_sum_s) / recent, 4) if recent else None,
            "ttft_mean_s": round(last.ttft_sum_s / last.ttft_count, 4) if last.ttft_count else None,
        }


def _since(ring: list[Sample], t: float) -> Sample:
    """The oldest sample at or after ``t`` (the newest if none is that old)."""
    for s in ring:
        if s.t >= t:
            return s
    return ring[-1]

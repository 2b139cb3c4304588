"""The prompt budget of a step: how many prompt rows ride beside its decode rows
(docs/SCHEDULER.md, "The prompt budget").

One owner for the count: the scheduler asks its ``StepBudget`` each step for the prompt rows
(``prompt_rows``) and tells it what each completed step cost (``observe``); whose rows they are
is the scheduler's decision (``engine/prompt_order.py``). Two kinds:

- ``FixedBudget`` (``--max-batch-tokens N``, tensor parallelism, an unprobed ``auto``): ``N`` rows
  a step, decode rows first -- the behaviour before issue 30.
- ``AdaptiveBudget`` (``--max-batch-tokens auto`` after the start-up probe,
  ``engine/budget_probe.py``): a step with no decode row takes up to the ``ceiling`` (the row count
  where a step stops getting cheaper per row: nobody's inter-token latency is at stake); a step
  with decode rows takes the prompt rows whose predicted cost keeps the step within the target
  (``--itl-target-ms``; ``auto``: twice the predicted cost of the decode rows alone), predicted by
  a per-row cost model (``StepCurve``: the measured step times, plus a residual learned from every
  step: the attention over long histories, run-ahead's overlap). At least ``floor`` prompt rows
  go every step, so prompts keep moving even where the decode rows alone reach the target.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

GRAIN = 16  # adaptive prompt rows are a multiple of this (fewer distinct chunk shapes)
RESIDUAL_ALPHA = 0.1  # weight of the newest step in the learned residual
KNEE_WITHIN = 1.1  # the knee: the fewest rows whose per-row cost is within 10 % of the cheapest


@dataclass(frozen=True)
class StepCurve:
    """Measured milliseconds of a step of ``rows[i]`` rows (prompt rows alone, short histories):
    ``rows`` ascending, ``ms`` non-decreasing (``budget_probe.probe`` makes it so)."""

    rows: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.ms) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"a step curve needs ascending rows, one time each (got {self.rows}, {self.ms})")

    def predict(self, n: int) -> float:
        """ms of an ``n``-row step: linear between measured points, the smallest point's time
        below it (a step is never cheaper than reading the weights once), the largest point's
        cost per row past it (an upper bound: per row, steps get cheaper or stay)."""
        rows, ms = self.rows, self.ms
        if n <= rows[0]:
            return ms[0]
        if n >= rows[-1]:
            return ms[-1] * n / rows[-1]
        i = bisect.bisect_left(rows, n)
        x0, x1, y0, y1 = rows[i - 1], rows[i], ms[i - 1], ms[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def rows_within(self, limit_ms: float) -> int:
        """The most rows whose predicted step costs at most ``limit_ms`` (0: not even the smallest)."""
        if self.predict(self.rows[0]) > limit_ms:
            return 0
        lo, hi = self.rows[0], self.rows[0] * 2
        while self.predict(hi) <= limit_ms and hi < 1 << 24:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # predict is non-decreasing: bisect the row count
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.predict(mid) <= limit_ms else (lo, mid)
        return lo

    def knee(self) -> int:
        """The fewest measured rows whose cost per row is within ``KNEE_WITHIN`` of the cheapest:
        where a step stops getting cheaper per row."""
        per_row = [m / r for r, m in zip(self.rows, self.ms, strict=True)]
        best = min(per_row)
        return next(r for r, c in zip(self.rows, per_row, strict=True) if c <= KNEE_WITHIN * best)


class StepBudget(Protocol):
    """What the scheduler asks each step (module docstring)."""

    ceiling: int  # the most rows a step takes (the warm-up compiles up to it)

    def prompt_rows(self, decode: int) -> int:
        """Prompt rows this step may take beside ``decode`` decode rows."""
        ...

    def observe(self, rows: int, ms: float) -> None:
        """A completed step of ``rows`` rows took ``ms``."""
        ...

    def health(self) -> dict:
        """``/health.scheduler.budget``."""
        ...


@dataclass
class FixedBudget:
    """``ceiling`` rows a step, decode rows first (at least one prompt row: prompts move).
    ``mode``: what /health says (``fixed``, or why ``auto`` is fixed here)."""

    ceiling: int
    mode: str = "fixed"

    def prompt_rows(self, decode: int) -> int:
        return max(self.ceiling - decode, 1)

    def observe(self, rows: int, ms: float) -> None:
        return None

    def health(self) -> dict:
        return {"mode": self.mode, "max_batch_tokens": self.ceiling, "itl_target_ms": None}


@dataclass
class Decision:
    """The last step's decision (``/health``, the tests)."""

    decode: int = 0
    prompt: int = 0
    predicted_ms: float = 0.0  # the step's rows by the model (decode + prompt rows, + residual)
    target_ms: float = 0.0  # 0: no decode rows (no target)


class AdaptiveBudget:
    """``--max-batch-tokens auto`` over a measured ``curve`` (module docstring). ``target_ms``:
    ``--itl-target-ms`` (None: auto, twice the decode rows' predicted cost where ``relative``,
    else no target: the ceiling every step); ``floor``: prompt rows every step at least;
    ``ceiling``: the most rows of a step."""

    def __init__(
        self,
        curve: StepCurve,
        ceiling: int,
        target_ms: float | None,
        floor: int,
        probe_s: float = 0.0,
        relative: bool = True,
        probe_cached: bool = False,
    ) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"the prompt floor must be in 1..{ceiling} rows (got {floor})")
        self.curve = curve
        self.ceiling = ceiling
        self.target_ms = target_ms
        self.floor = floor
        self.probe_s = probe_s
        self.probe_cached = probe_cached  # the curve was kept from an earlier start (``probe_cache``)
        self.relative = relative
        self.residual_ms = 0.0  # measured minus predicted, moving average (attention, overlap)
        self.last = Decision()
        self.observed = 0

    def predict(self, rows: int) -> float:
        return max(self.curve.predict(rows) + self.residual_ms, 0.0)

    def target(self, decode: int) -> float:
        """The step time a step with ``decode`` decode rows may reach."""
        return self.target_ms if self.target_ms is not None else 2.0 * self.predict(decode)

    def prompt_rows(self, decode: int) -> int:
        if decode == 0 or (self.target_ms is None and not self.relative):  # the device's best rows
            self.last = Decision(0, self.ceiling, self.predict(self.ceiling), 0.0)
            return self.ceiling
        target = self.target(decode)
        fit = self.curve.rows_within(target - self.residual_ms) - decode
        rows = max(self.floor, min(fit // GRAIN * GRAIN, self.ceiling - decode))
        self.last = Decision(decode, rows, self.predict(decode + rows), target)
        return rows

    def observe(self, rows: int, ms: float) -> None:
        self.observed += 1
        a = RESIDUAL_ALPHA if self.observed > 1 else 1.0
        self.residual_ms += a * (ms - self.curve.predict(rows) - self.residual_ms)
        # a probe timed on a busier machine than now: no prediction below half the curve's
        self.residual_ms = max(self.residual_ms, -0.5 * self.curve.ms[0])

    def health(self) -> dict:
        last = self.last
        return {
            "mode": "auto",
            "max_batch_tokens": self.ceiling,
            "itl_target_ms": self.target_ms
            if self.target_ms is not None
            else "auto"
            if self.relative
            else None,
            "floor": self.floor,
            "residual_ms": round(self.residual_ms, 3),
            "curve": {"rows": list(self.curve.rows), "ms": [round(m, 3) for m in self.curve.ms]},
            "probe_s": round(self.probe_s, 2),
            "probe_cached": self.probe_cached,
            "last": {
                "decode_rows": last.decode,
                "prompt_rows": last.prompt,
                "predicted_ms": round(last.predicted_ms, 3),
                "target_ms": round(last.target_ms, 3),
            },
        }

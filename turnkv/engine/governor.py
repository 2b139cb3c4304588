"""What a step costs and how long a turn's draft should be (context-copy speculation's governor).

``StepCost`` fits the engine's measured step times (plain steps and steps with a verify window)
and knows the step being gathered (``company``); ``Governor`` (one per turn) sizes each draft
from the turn's recent acceptance and those costs, counting what a longer step costs the other
turns in it, and pauses with backoff while drafts keep failing.
"""

from __future__ import annotations

from collections.abc import Sequence

from turnkv.engine.step import Window

# -- what a step costs ------------------------------------------------------------------------
DECAY = 0.95  # weight of an older step observation relative to the next one (about 20 recent steps)


class _Fit:
    """``t ~ a + b * n`` by least squares over recent observations (older ones decay)."""

    def __init__(self) -> None:
        self.w = self.sn = self.st = self.snn = self.snt = 0.0

    def add(self, n: float, t: float) -> None:
        d = DECAY
        self.w = self.w * d + 1
        self.sn = self.sn * d + n
        self.st = self.st * d + t
        self.snn = self.snn * d + n * n
        self.snt = self.snt * d + n * t

    def mean_t(self) -> float | None:
        return self.st / self.w if self.w >= 0.5 else None

    def predict(self, n: float, slope: float) -> float | None:
        """The fitted time at ``n`` rows; ``slope`` per row where the rows seen barely varied."""
        if self.w < 0.5:
            return None
        mn, mt = self.sn / self.w, self.st / self.w
        var = self.snn / self.w - mn * mn
        b = (self.snt / self.w - mn * mt) / var if var > 1.0 else slope
        return max(mt + max(b, 0.0) * (n - mn), 1e-6)


class StepCost:
    """What a step of ``n`` rows costs, measured: one fit for plain steps (every window one row;
    CUDA graphs replay these) and one for steps with a verify window (eager on a CPU; on CUDA
    replayed as one-row windows, more of them).

    The scheduler reports every step (``observe``); only steps of decode and verify windows (every
    row asks for its logits) are counted, not prefill. Where a fit has not seen its rows vary,
    each row beyond them costs ``prior_row`` of the plain steps' mean time (no plain step seen
    yet: relative units, a step of one row costs 1). A verify step never costs less than a plain
    step of as many rows (a fit over a few wide windows, extrapolated down, can fall to zero).
    The prior is the device's: ``PRIOR_ROW`` (1/64: a GPU's rows are nearly free) or
    ``PRIOR_ROW_CPU`` (the default model's rows on a small CPU; docs/BENCHMARKS.md).
    """

    PRIOR_ROW = 1 / 64
    PRIOR_ROW_CPU = 1 / 8
    # on a GPU no draft rides in a step of more windows: each draft row is a one-row window that
    # reads its conversation's KV again, and in a crowded step no measured batch gained from drafts
    # (docs/BENCHMARKS.md, "A step timeline under load")
    COMPANY_GPU = 8

    def __init__(self, prior_row: float = PRIOR_ROW, most_company: int | None = None) -> None:
        """``most_company``: the most windows a step with a draft may have (None: any)."""
        self.prior_row = prior_row
        self.most_company = most_company
        # the step being gathered runs ahead (``company``, docs/SCHEDULER.md): a turn's next window is launched before
        # its verify window's tokens come back, and is lost when that window's draft is cut short
        self.run_ahead = False
        self.plain = _Fit()
        self.verify = _Fit()
        self.windows = 1  # windows and rows of the step being gathered (``company``)
        self.rows = 1
        self.observed = 0  # decode steps the fits have taken in
        self._key: tuple | None = None  # what ``priced`` and ``room`` were last computed for
        self._priced = (0, 1, 1.0)
        self._room = True

    def observe(self, windows: Sequence[Window], seconds: float) -> None:
        """One step's windows and wall time (host work plus waiting for the device)."""
        if not windows or any(w.logits != len(w.tokens) for w in windows):
            return  # a prefill or rebase chunk rode in this step: not a decode step's cost
        rows = [len(w.tokens) for w in windows]
        n = sum(rows)
        (self.verify if max(rows) > 1 else self.plain).add(n, seconds)
        self.observed += 1

    def company(self, windows: int, rows: int, ahead: bool = False) -> None:
        """The step being gathered, as a decode turn is about to draft: ``windows`` windows and
        ``rows`` rows so far, the turn's own decode row included. The scheduler says, so the first
        step of a new batch is priced with its company, not the step before it (turns that took
        themselves for alone drafted wide windows there: docs/BENCHMARKS.md, 'CPU matmuls in C').
        ``ahead``: the scheduler runs ahead."""
        self.windows, self.rows, self.run_ahead = windows, rows, ahead

    def priced(self) -> tuple[int, int, float]:
        """The step being gathered without this turn's draft: ``(others, n0, t0)``, the other
        windows, the rows (this turn's decode row included) and the step's price (another window
        verifies: priced as a verify step). Computed once per company and observation: in a full
        batch every turn asks each step (``Governor._prices``, ``room``)."""
        # (not the fits' weights: they settle at 1 / (1 - DECAY) once enough steps are seen)
        key = (self.windows, self.rows, self.observed)
        if key != self._key:
            others = max(self.windows - 1, 0)
            others_rows = max(self.rows - 1, others)
            n0 = others_rows + 1
            t0 = self.cost(n0, others_rows > others)
            self._key, self._priced = key, (others, n0, t0)
            crowded = self.most_company is not None and self.windows > self.most_company
            self._room = not crowded and (not others or self.cost(n0 + 1, True) <= (1 + OTHERS_LOSS) * t0)
        return self._priced

    def room(self) -> bool:
        """Whether a one-token draft fits the step being gathered: alone in it, or lengthening
        the step the other windows share by at most ``OTHERS_LOSS`` (``Governor._gain``'s cap,
        whatever the turn's acceptance)."""
        self.priced()
        return self._room

    def cost(self, n: int, verify: bool) -> float:
        """Seconds for a step of ``n`` rows (relative figures are what matter)."""
        mean = self.plain.mean_t()
        slope = (mean or 1.0) * self.prior_row
        plain = self.plain.predict(n, slope)
        base = plain if plain is not None else 1.0 + slope * max(n - 1, 0)
        v = self.verify.predict(n, self._between(slope)) if verify else None
        return base if v is None else max(v, base)

    def _between(self, slope: float) -> float:
        """A verify step's cost per row where its own rows barely varied: at least the line
        through the two fits' means, plain steps against verify steps of more rows. In a full
        batch the running set hardly changes, so neither fit sees its rows vary, and the prior
        (a GPU row nearly free) let 32 turns draft: on CUDA each draft row is a one-row window
        reading its whole conversation's KV again, and those steps cost far more than the plain
        ones (docs/BENCHMARKS.md, "A step timeline under load")."""
        p, v = self.plain, self.verify
        if p.w < 0.5 or v.w < 0.5:
            return slope
        dn = v.sn / v.w - p.sn / p.w
        return max(slope, (v.st / v.w - p.st / p.w) / dn) if dn >= 1 else slope


# -- the governor -----------------------------------------------------------------------------
# Acceptance by match length: how long the newest tokens' earlier match is predicts how long the
# copy goes on (measured per bucket: docs/BENCHMARKS.md). A fresh turn starts from these priors
# (worth PRIOR_WEIGHT windows) and learns its own.
MATCH_BUCKETS = (4, 8)  # match lengths [2, 4), [4, 8), [8, ...)
ALPHA_PRIOR = (0.5, 0.7, 0.85)
PRIOR_WEIGHT = 2.0
MEMORY = 0.8  # weight of older windows in a bucket's estimate (about the last 5 windows)
RECOVER = 0.97  # per step a bucket is not drafted, its estimate moves this much back to the prior
MAX_PAUSE = 64  # longest pause (decode steps) after drafts kept failing
FAIRNESS = 3.0  # in a batch, the other turns' lost time counts this many times
# ... and no draft may lengthen a step that other windows share by more than this share: each
# of them gains nothing from it. Where a row is dear (a CPU), the gain rule alone let turns draft
# long windows beside the others and slowed a batch's slowest turn (docs/BENCHMARKS.md, 'CPU
# matmuls in C').
OTHERS_LOSS = 0.02


def match_bucket(match: int) -> int:
    return sum(match >= b for b in MATCH_BUCKETS)


class Governor:
    """Sizes one turn's drafts (see the module docstring).

    ``alpha(match)`` estimates the chance that a drafted token is accepted given the one before was,
    for drafts whose match is that long (recent windows weigh most; buckets not drafted drift back
    to their prior). For a draft of ``k`` tokens the turn expects ``E(k) = 1 + alpha + ... +
    alpha^k`` tokens from the window. The step it rides in has ``others`` other windows (about one
    token each) and ``n0`` rows without the draft: the draft is worth it when this turn's gain in
    tokens per second beats the others' loss (``FAIRNESS`` times) from the longer step, both under
    the measured ``StepCost``, and the others' step grows by at most ``OTHERS_LOSS``. After ``s`` windows in a row with nothing accepted, short matches
    pause ``2^s - 1`` decode steps (at most ``MAX_PAUSE``); a long match (8+) is drafted anyway.
    """

    def __init__(self, cost: StepCost) -> None:
        self.cost = cost
        self.hits = [a * PRIOR_WEIGHT for a in ALPHA_PRIOR]
        self.misses = [(1 - a) * PRIOR_WEIGHT for a in ALPHA_PRIOR]
        self.failures = 0  # windows in a row with no drafted token accepted
        self._pause = 0
        self._idle = 0  # decode steps passed since the estimates were last brought up to date

    @property
    def pause(self) -> int:
        """Decode steps left before short matches are drafted again."""
        self._settle()
        return self._pause

    @pause.setter
    def pause(self, steps: int) -> None:
        self._settle()
        self._pause = steps

    def alpha(self, match: int) -> float:
        self._settle()
        b = match_bucket(match)
        return self.hits[b] / (self.hits[b] + self.misses[b])

    def step(self) -> None:
        """One decode step passed: the pause counts down, undrafted estimates drift to the prior
        (applied when next read, ``_settle``: a step that cannot draft costs a counter)."""
        self._idle += 1

    def _settle(self) -> None:
        """``_idle`` steps at once: ``x -> x r + p (1 - r)`` n times is ``x r^n + p (1 - r^n)``."""
        n, self._idle = self._idle, 0
        if not n:
            return
        self._pause = max(self._pause - n, 0)
        r = RECOVER**n
        for b, a in enumerate(ALPHA_PRIOR):
            self.hits[b] = self.hits[b] * r + a * PRIOR_WEIGHT * (1 - r)
            self.misses[b] = self.misses[b] * r + (1 - a) * PRIOR_WEIGHT * (1 - r)

    def _prices(self) -> tuple[int, int, float, float]:
        """This step's ``(others, n0, t0, weight)``: the other windows, the rows without a draft,
        the step's price then, and how much the others' loss counts (``StepCost.company``)."""
        others, n0, t0 = self.cost.priced()
        return others, n0, t0, 1 + FAIRNESS * others

    def _gain(
        self, k: int, e: float, a: float, others: int, n0: int, t0: float, weight: float
    ) -> float | None:
        """This turn's extra tokens per second from a ``k``-token draft expected to give ``e``
        tokens (each drafted token kept with chance ``a`` after the one before), minus the others'
        loss from the longer step; None past the others' loss cap. Where the loop runs ahead, the
        turn's window launched after this one is lost unless all ``k`` are kept (``a ** k``)."""
        t = self.cost.cost(n0 + k, True)
        if others and t > (1 + OTHERS_LOSS) * t0:
            return None
        own = t * (2 - a**k) if self.cost.run_ahead else t
        return e / own - 1 / t0 - (weight - 1) * (t - t0) / (t * t0)

    def may_draft(self) -> bool:
        """Whether any draft can pay this step: one token at the most hopeful bucket's ``alpha``.
        The gain's sign is that of ``(e(k) - 1) t0 - weight (t(k) - t0)``, concave in ``k`` (``e``
        is, ``t`` is convex) and 0 at ``k = 0``, so no longer draft pays if one token does not;
        then the index is not even searched (in a full batch every turn asks every step).
        Run ahead, a turn's own yield per step time is ``e(k) / (2 - a^k)``, which exceeds 1 for
        any ``k`` exactly when ``a > 1/2`` (at ``a = 1/2`` it is 1 for every ``k``), so where steps
        barely grow with ``k`` one token still decides."""
        if not self.cost.room():
            return False
        a = max(self.alpha(b) for b in (2, *MATCH_BUCKETS))
        gain = self._gain(1, 1 + a, a, *self._prices())
        return gain is not None and gain > 0

    def length(self, available: int, match: int) -> int:
        """How many of ``available`` drafted tokens (from a match of ``match`` tokens) to verify
        this step (0: a plain decode row)."""
        if available <= 0 or (self.pause and match_bucket(match) < len(MATCH_BUCKETS)):
            return 0
        prices = self._prices()
        a = self.alpha(match)
        best, best_gain, e, term = 0, 0.0, 1.0, 1.0
        for k in range(1, available + 1):
            term *= a
            e += term
            gain = self._gain(k, e, a, *prices)
            if gain is None:
                break  # the step grows with k: a longer draft costs the others more still
            if gain > best_gain:
                best, best_gain = k, gain
            elif k == 1:
                return 0  # no longer draft pays either (``may_draft``)
        return best

    def update(self, drafted: int, accepted: int, match: int) -> None:
        """After a step: ``accepted`` of ``drafted`` tokens (from a match of ``match`` tokens) were
        kept."""
        if not drafted:
            return
        self._settle()
        b = match_bucket(match)
        self.hits[b] = self.hits[b] * MEMORY + accepted
        self.misses[b] = self.misses[b] * MEMORY + (1 if accepted < drafted else 0)
        if accepted:
            self.failures = 0
        else:
            self.failures += 1
            self._pause = min(2**self.failures - 1, MAX_PAUSE)

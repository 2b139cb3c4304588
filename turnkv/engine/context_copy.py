"""Context-copy speculation: drafts from the conversation itself, a governor per turn, exact
acceptance.

Long conversations repeat themselves: code being edited, a list being revised, identifiers and
quotes. ``ContextIndex`` finds where the newest tokens occurred before in the conversation (every
earlier turn's prompt and answer, plus this answer so far) and proposes the tokens that followed
them. The turn feeds its current token and the draft as one verify window (at most
``MAX_WINDOW_ROWS`` rows); the target model's logits for every row come back from one forward.

Acceptance (``Turn._verify``) walks the window's rows in order and draws each row's token exactly
as a non-speculative step would (``argmax`` when greedy, else the turn's ``Sampler`` with its own
generator); it stops at the first row whose token differs from the draft's next token, and that
token is the correction (or, after a fully accepted draft, the bonus token). For the point-mass
proposal ``q = delta(d)`` this *is* speculative sampling: ``d`` is accepted with probability
``p(d)``, and a rejected row's token is distributed as ``p`` with ``d`` removed and renormalised
(a sample of ``p`` conditioned on not being ``d``). Because every emitted token consumes exactly
one draw of the turn's generator, in order, a seeded request emits the same tokens with
speculation on or off, whatever the draft lengths were (up to logits that differ by rounding
between a one-row and a many-row forward).

``Governor`` (one per turn) sizes each draft: the length that maximises the expected tokens per
second of the whole step under the engine's measured step costs (``StepCost``: what a step of
``N`` rows costs with and without a verify window; a verify window's extra rows cost every turn in
the step) and the turn's recent acceptance, and it pauses with exponential backoff while drafts
keep failing, so free text pays almost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import numpy as np

from turnkv.config import Speculate
from turnkv.engine.step import Window
from turnkv.limits import MAX_WINDOW_ROWS

MAX_DRAFT = MAX_WINDOW_ROWS - 1  # the current token and up to 31 drafted ones in one window
CHAIN = 16  # earlier occurrences of the newest bigram examined per draft
MAX_MATCH = 64  # a match longer than this is as good as this long


class ContextIndex:
    """Every token of one conversation, indexed by bigram as hash chains (LZ77's match finder).

    ``head[(a, b)]`` is the last position ``i`` with ``tokens[i-1:i+1] == [a, b]``; ``prev[i]`` is
    the position of the occurrence before that. ``draft`` walks the chain of the newest bigram
    (at most ``CHAIN`` occurrences), extends each match backwards (at most ``MAX_MATCH`` tokens),
    and proposes what followed the longest match (the most recent among equals); where that runs
    into the newest tokens, the copy overlaps itself (a repeating loop is drafted as repeating).

    Cost (``bench/speculation.py`` measures it each run; 2-core EPYC VM under load, 2026-11-30):
    building over a 32K-token conversation takes 8.6 ms (0.26 us per token, vectorised; once per
    turn), a ``push`` plus a ``draft`` per decode step 9-20 us (one torch thread; up to 43 us with
    two contending) -- against 60-150 ms for a CPU decode step of the default model here and
    14-28 ms for an 8B shape's decode step on the H200 (docs/BENCHMARKS.md: 35-70 tok/s).
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = [int(t) for t in tokens]
        n = len(self.tokens)
        self.prev: list[int] = [-1] * n
        self.head: dict[tuple[int, int], int] = {}
        if n < 2:
            return
        t = np.asarray(self.tokens, dtype=np.int64)
        keys = t[:-1] * (1 << 32) + t[1:]  # [n-1] the bigram ending at position i+1
        order = np.argsort(keys, kind="stable")  # positions grouped by bigram, ascending within
        sk = keys[order]
        same = np.concatenate(([False], sk[1:] == sk[:-1]))  # [n-1] the previous one is the same bigram
        prev = np.full(n, -1, dtype=np.int64)
        prev[order[same] + 1] = order[np.flatnonzero(same) - 1] + 1
        self.prev = prev.tolist()
        last = np.concatenate((sk[1:] != sk[:-1], [True]))  # the last occurrence of each bigram
        ends = (order[last] + 1).tolist()
        self.head = {(self.tokens[i - 1], self.tokens[i]): i for i in ends}

    def __len__(self) -> int:
        return len(self.tokens)

    def push(self, tok: int) -> None:
        """Append one token (accepted or sampled) to the conversation."""
        toks = self.tokens
        toks.append(int(tok))
        i = len(toks) - 1
        if i == 0:
            self.prev.append(-1)
            return
        key = (toks[i - 1], toks[i])
        self.prev.append(self.head.get(key, -1))
        self.head[key] = i

    def draft(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the longest earlier match of the newest tokens, and
        that match's length (0 and no tokens when the newest bigram never occurred before)."""
        toks = self.tokens
        end = len(toks) - 1
        if limit <= 0 or end < 1:
            return [], 0
        p = self.prev[end]  # the newest bigram's previous occurrence (the head is ``end`` itself)
        best, best_len = -1, 0
        for _ in range(CHAIN):
            if p < 1:
                break
            m = 2
            while m < MAX_MATCH and p - m >= 0 and toks[p - m] == toks[end - m]:
                m += 1
            if m > best_len:
                best, best_len = p, m
                if m >= MAX_MATCH:
                    break
            p = self.prev[p]
        if best < 0:
            return [], 0
        out = toks[best + 1 : best + 1 + limit]
        period = end - best
        while len(out) < limit:  # an overlapping copy (LZ77's run): a loop goes on repeating
            out.append(out[len(out) - period])
        return out, best_len


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
    CUDA graphs replay these) and one for steps with a verify window (always eager).

    The scheduler reports every step (``observe``); only steps of decode and verify windows (every
    row asks for its logits) are counted, not prefill. Where a fit has not seen its rows vary,
    each row beyond them costs ``prior_row`` of the plain steps' mean time (no plain step seen
    yet: relative units, a step of one row costs 1). A verify step never costs less than a plain
    step of as many rows (a fit over a few wide windows, extrapolated down, can fall to zero).
    The prior is the device's: ``PRIOR_ROW`` (1/64: a GPU's rows are nearly free) or
    ``PRIOR_ROW_CPU`` (the default model on the 2-core VM with the C matmul: 8.1 ms a one-row
    step, 16.6 ms eight rows, ~1.2 ms each row more).
    """

    PRIOR_ROW = 1 / 64
    PRIOR_ROW_CPU = 1 / 8

    def __init__(self, prior_row: float = PRIOR_ROW) -> None:
        self.prior_row = prior_row
        self.plain = _Fit()
        self.verify = _Fit()
        self.windows = 1  # windows and rows of the step being gathered (``company``)
        self.rows = 1

    def observe(self, windows: Sequence[Window], seconds: float) -> None:
        """One step's windows and wall time (host work plus waiting for the device)."""
        if not windows or any(w.logits != len(w.tokens) for w in windows):
            return  # a prefill or rebase chunk rode in this step: not a decode step's cost
        rows = [len(w.tokens) for w in windows]
        n = sum(rows)
        (self.verify if max(rows) > 1 else self.plain).add(n, seconds)

    def company(self, windows: int, rows: int) -> None:
        """The step being gathered, as a decode turn is about to draft: ``windows`` windows and
        ``rows`` rows so far, the turn's own decode row included (the scheduler says, so the first
        step of a new batch is priced with its company, not the step before it: eight turns that
        each took themselves for alone drafted 54- and 84-row windows into the first steps of a
        batch of 8 on the 2-core VM, 4-6x a plain step)."""
        self.windows, self.rows = windows, rows

    def cost(self, n: int, verify: bool) -> float:
        """Seconds for a step of ``n`` rows (relative figures are what matter)."""
        mean = self.plain.mean_t()
        slope = (mean or 1.0) * self.prior_row
        plain = self.plain.predict(n, slope)
        base = plain if plain is not None else 1.0 + slope * max(n - 1, 0)
        v = self.verify.predict(n, slope) if verify else None
        return base if v is None else max(v, base)


# -- the governor -----------------------------------------------------------------------------
# Acceptance by match length: how long the newest tokens' earlier match is predicts how long the
# copy goes on. Measured with SmolLM2-135M greedy on edit / list / free-text prompts (accepted per
# drafted-and-judged token): match 2-3 tokens 0.80 / 0.62 / 0.36, 4-7 0.91 / 0.54 / 0.60, 8+ 0.97 /
# 0.67 / 0. A fresh turn starts from these priors (worth PRIOR_WEIGHT windows) and learns its own.
MATCH_BUCKETS = (4, 8)  # match lengths [2, 4), [4, 8), [8, ...)
ALPHA_PRIOR = (0.5, 0.7, 0.85)
PRIOR_WEIGHT = 2.0
MEMORY = 0.8  # weight of older windows in a bucket's estimate (about the last 5 windows)
RECOVER = 0.97  # per step a bucket is not drafted, its estimate moves this much back to the prior
MAX_PAUSE = 64  # longest pause (decode steps) after drafts kept failing
FAIRNESS = 3.0  # in a batch, the other turns' lost time counts this many times
# ... and no draft may lengthen a step that other windows share by more than this share: each
# of them gains nothing from it. On the 2-core VM's CPU a row costs ~5 % of an 8-row step, and
# the gain rule alone let turns draft 10-token windows beside the others: in a batch of 8 the
# slowest turn decoded at 0.90-0.95x its speed without speculation (bench/speculation.py).
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
        self.pause = 0

    def alpha(self, match: int) -> float:
        b = match_bucket(match)
        return self.hits[b] / (self.hits[b] + self.misses[b])

    def step(self) -> None:
        """One decode step passed: the pause counts down, undrafted estimates drift to the prior."""
        self.pause = max(self.pause - 1, 0)
        for b, a in enumerate(ALPHA_PRIOR):
            self.hits[b] = self.hits[b] * RECOVER + a * PRIOR_WEIGHT * (1 - RECOVER)
            self.misses[b] = self.misses[b] * RECOVER + (1 - a) * PRIOR_WEIGHT * (1 - RECOVER)

    def length(self, available: int, match: int) -> int:
        """How many of ``available`` drafted tokens (from a match of ``match`` tokens) to verify
        this step (0: a plain decode row)."""
        if available <= 0 or (self.pause and match_bucket(match) < len(MATCH_BUCKETS)):
            return 0
        c = self.cost
        others = max(c.windows - 1, 0)  # the step's other windows and their rows (``company``)
        others_rows = max(c.rows - 1, others)
        n0 = others_rows + 1
        t0 = c.cost(n0, others_rows > others)  # another window verifies: the step is eager anyway
        weight = 1 + FAIRNESS * others
        a = self.alpha(match)
        best, best_gain, e, term = 0, 0.0, 1.0, 1.0
        for k in range(1, available + 1):
            term *= a
            e += term
            t = c.cost(n0 + k, True)
            if others and t > (1 + OTHERS_LOSS) * t0:
                break  # the step grows with k: a longer draft costs the others more still
            # this turn's extra tokens per second minus everyone's loss from the longer step
            gain = (e - 1) / t - weight * (t - t0) / (t * t0)
            if gain > best_gain:
                best, best_gain = k, gain
            elif k == 1:
                # gain's sign is that of (e(k) - 1) t0 - weight (t(k) - t0): concave in k (e is,
                # t is convex) and 0 at k = 0, so no longer draft pays if one token does not
                # (a batch of 8 on the CPU asks 8 times a step; the 31 prices cost ~0.7 ms)
                return 0
        return best

    def update(self, drafted: int, accepted: int, match: int) -> None:
        """After a step: ``accepted`` of ``drafted`` tokens (from a match of ``match`` tokens) were
        kept."""
        if not drafted:
            return
        b = match_bucket(match)
        self.hits[b] = self.hits[b] * MEMORY + accepted
        self.misses[b] = self.misses[b] * MEMORY + (1 if accepted < drafted else 0)
        if accepted:
            self.failures = 0
        else:
            self.failures += 1
            self.pause = min(2**self.failures - 1, MAX_PAUSE)


# -- one turn's drafts ------------------------------------------------------------------------
class TurnDrafts:
    """A turn's drafting: the conversation's index, its governor, and the engine's counters."""

    def __init__(self, stats: SpeculationStats, cost: StepCost, prompt: Sequence[int]) -> None:
        self.stats = stats
        self.index = ContextIndex(prompt)
        self.governor = Governor(cost)
        self.match = 0  # the match length of the latest draft

    def draft(self, limit: int) -> list[int]:
        """The tokens to verify after the turn's newest token (at most ``limit``; maybe none)."""
        self.governor.step()
        tokens, self.match = self.index.draft(min(limit, MAX_DRAFT))
        return tokens[: self.governor.length(len(tokens), self.match)]

    def push(self, tok: int) -> None:
        self.index.push(tok)

    def verified(self, drafted: int, accepted: int, emitted: int) -> None:
        """One decode window: ``drafted`` tokens verified, ``accepted`` kept, ``emitted`` tokens
        taken from it (the accepted ones plus the correction or bonus, fewer at a stop)."""
        self.governor.update(drafted, accepted, self.match)
        self.stats.window(drafted, accepted, emitted)


WINDOW_BUCKETS = (2, 4, 8, 16, 32)  # verify windows are counted by rows, up to these sizes


class SpeculationStats:
    """Engine-wide counters (``/health.speculation``, Prometheus). Written by the engine thread;
    readers get ints that only grow (every bucket exists from the start)."""

    def __init__(self, mode: str, status: str = "on") -> None:
        self.mode = mode
        self.status = status  # "on", or "off: <why>"
        self.drafted = 0
        self.accepted = 0
        self.windows = 0  # decode windows with a draft (verify windows)
        self.forwards = 0  # decode windows of any size
        self.tokens = 0  # tokens those windows emitted
        self.by_window = {b: [0, 0, 0] for b in WINDOW_BUCKETS}  # rows <= b: windows, drafted, accepted

    def window(self, drafted: int, accepted: int, emitted: int) -> None:
        self.forwards += 1
        self.tokens += emitted
        if not drafted:
            return
        self.windows += 1
        self.drafted += drafted
        self.accepted += accepted
        rows = drafted + 1
        bucket = self.by_window[next(b for b in WINDOW_BUCKETS if rows <= b)]
        bucket[0] += 1
        bucket[1] += drafted
        bucket[2] += accepted

    def health(self) -> dict:
        """``mode``, ``status`` (``on`` or ``off: <why>``), ``drafted``, ``accepted``, ``windows``,
        ``acceptance`` (accepted / drafted),
        ``tokens_per_forward`` (decode tokens per decode window), ``by_window`` (per window-size
        bucket ``"<=b"``: ``windows``, ``drafted``, ``accepted``)."""
        return {
            "mode": self.mode,
            "status": self.status,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "windows": self.windows,
            "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "tokens_per_forward": round(self.tokens / self.forwards, 4) if self.forwards else 0.0,
            "by_window": {
                f"<={b}": {"windows": w, "drafted": d, "accepted": a}
                for b, (w, d, a) in self.by_window.items()
            },
        }


class Speculation:
    """The engine's speculation: ``--speculate auto|off``, the step cost model, the counters."""

    def __init__(self, mode: str = "auto", off_because: str | None = None, device: str = "cpu") -> None:
        """``off_because``: why ``auto`` drafts nothing on this engine (None: it drafts);
        ``device``: its type, for the step cost's prior."""
        if mode not in get_args(Speculate):
            raise ValueError(f"--speculate must be one of {', '.join(get_args(Speculate))}, not {mode!r}")
        self.enabled = mode == "auto" and off_because is None
        self.cost = StepCost(StepCost.PRIOR_ROW_CPU if device == "cpu" else StepCost.PRIOR_ROW)
        status = "on" if self.enabled else f"off: {off_because or '--speculate off'}"
        self.stats = SpeculationStats(mode, status)

    def for_turn(self, prompt: Sequence[int]) -> TurnDrafts | None:
        """A new turn's drafts over its prompt (every earlier turn plus this request), or None."""
        return TurnDrafts(self.stats, self.cost, prompt) if self.enabled else None

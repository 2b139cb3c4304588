"""Context-copy speculation: drafts from the conversation itself, a governor per turn, exact
acceptance.

Long conversations repeat themselves: code being edited, a list being revised, identifiers and
quotes. ``ContextIndex`` finds where the newest tokens occurred before in the conversation (every
earlier turn's prompt and answer, plus this answer so far) and proposes the tokens that followed
them. The turn feeds its current token and the draft as one verify window (at most
``MAX_WINDOW_ROWS`` rows); the target model's logits for every row come back from one forward.

Acceptance (``chooser.window_tokens``, then ``Turn._verify``) draws each row's token exactly as a
plain step would and stops at the first that differs from the draft's next token (the correction,
or after a fully accepted draft the bonus token). For the point-mass proposal ``q = delta(d)`` this *is* speculative
sampling: ``d`` is kept with probability ``p(d)``, and a rejected row's token is a sample of ``p``
conditioned on not being ``d``. Every emitted token consumes exactly one draw of the turn's
generator, in order, so a seeded request emits the same tokens with speculation on or off,
whatever the draft lengths were (up to logits that differ by rounding between a one-row and a
many-row forward).

``Governor`` (``governor.py``, one per turn) sizes each draft for the most tokens per second of
the whole step and pauses while drafts keep failing, so free text pays almost nothing.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import get_args

import numpy as np

from turnkv.config import Speculate
from turnkv.engine.governor import Governor, StepCost
from turnkv.limits import MAX_WINDOW_ROWS

MAX_DRAFT = MAX_WINDOW_ROWS - 1  # the current token and up to 31 drafted ones in one window
CHAIN = 16  # earlier occurrences of the newest bigram examined per draft
MAX_MATCH = 64  # a match longer than this is as good as this long


def _grouped(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(order, sk)`` of tokens ``t`` [n]: the positions i of the bigrams ``t[i], t[i+1]`` sorted by
    bigram, ascending within one, and their keys ``a << 32 | b`` in that order. One plain sort of
    ``(bigram, position)`` packed in an int64 where it fits (8x faster than a stable argsort at
    12K tokens), else the argsort."""
    n, v = len(t) - 1, int(t.max()) + 1
    if v * v * n < 1 << 62:
        packed = (t[:-1] * v + t[1:]) * n + np.arange(n)
        packed.sort()
        order, pair = np.divmod(packed, n)[::-1]
        return order, (pair // v) << 32 | pair % v
    keys = (t[:-1] << 32) | t[1:]
    order = np.argsort(keys, kind="stable")
    return order, keys[order]


class ContextIndex:
    """Every token of one conversation, indexed by bigram as hash chains (LZ77's match finder).

    ``last(a, b)`` is the last position ``i`` with ``tokens[i-1:i+1] == [a, b]``; ``prev[i]`` is
    the position of the occurrence before that. ``draft`` walks the chain of the newest bigram
    (at most ``CHAIN`` occurrences), extends each match backwards (at most ``MAX_MATCH`` tokens),
    and proposes what followed the longest match (the most recent among equals); where that runs
    into the newest tokens, the copy overlaps itself (a repeating loop is drafted as repeating).

    Building is vectorised (once per turn); a ``push`` plus a ``draft`` per decode step costs
    microseconds, small beside any decode step (``bench/speculation.py`` measures both each run;
    docs/BENCHMARKS.md).
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        t = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.tokens: list[int] = t.tolist()
        n = len(self.tokens)
        self.prev: list[int] = [-1] * n
        # the chain heads: those of the built tokens as two sorted lists (a dict of every bigram
        # was most of a long prompt's build), those of pushes since in a dict over them
        self._keys: list[int] = []  # sorted bigram keys (a << 32 | b) of the built tokens
        self._last: list[int] = []  # [len(_keys)] each one's last position
        self._head: dict[int, int] = {}  # pushes since: key -> last position
        if n < 2:
            return
        order, sk = _grouped(t)
        same = np.concatenate(([False], sk[1:] == sk[:-1]))  # [n-1] the previous one is the same bigram
        prev = np.full(n, -1, dtype=np.int64)
        prev[order[same] + 1] = order[np.flatnonzero(same) - 1] + 1
        self.prev = prev.tolist()
        last = np.concatenate((sk[1:] != sk[:-1], [True]))  # the last occurrence of each bigram
        self._keys, self._last = sk[last].tolist(), (order[last] + 1).tolist()

    def __len__(self) -> int:
        return len(self.tokens)

    def last(self, a: int, b: int) -> int:
        """The last position ``i`` with ``tokens[i-1:i+1] == [a, b]``, or -1."""
        key = a << 32 | b
        i = self._head.get(key)
        if i is not None:
            return i
        j = bisect_left(self._keys, key)
        return self._last[j] if j < len(self._keys) and self._keys[j] == key else -1

    def heads(self) -> dict[tuple[int, int], int]:
        """Every bigram's chain head, ``{(a, b): last position}`` (for tests: ``last`` is the lookup)."""
        out = {(k >> 32, k & 0xFFFFFFFF): i for k, i in zip(self._keys, self._last, strict=True)}
        out.update({(k >> 32, k & 0xFFFFFFFF): i for k, i in self._head.items()})
        return out

    def push(self, tok: int) -> None:
        """Append one token (accepted or sampled) to the conversation (``pop`` takes it back)."""
        toks = self.tokens
        toks.append(int(tok))
        i = len(toks) - 1
        if i == 0:
            self.prev.append(-1)
            return
        self.prev.append(self.last(toks[i - 1], toks[i]))
        self._head[toks[i - 1] << 32 | toks[i]] = i

    def pop(self) -> None:
        """Take back the newest token (its bigram's chain head goes back to the one before)."""
        toks = self.tokens
        i = len(toks) - 1
        p = self.prev.pop()
        if i > 0:
            key = toks[i - 1] << 32 | toks[i]
            if p < 0:  # no earlier occurrence, built or pushed: the lookup finds none again
                del self._head[key]
            else:
                self._head[key] = p
        toks.pop()

    def draft(self, limit: int, after: Sequence[int] = ()) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the longest earlier match of the newest tokens, and
        that match's length (0 and no tokens when the newest bigram never occurred before).
        ``after``: tokens taken as if pushed first (a run-ahead window's drafts follow those of
        the window in flight, not yet verified); the index is left as it was."""
        for t in after:
            self.push(t)
        try:
            return self._draft(limit)
        finally:
            for _ in after:
                self.pop()

    def _draft(self, limit: int) -> tuple[list[int], int]:
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


# -- one turn's drafts ------------------------------------------------------------------------
class TurnDrafts:
    """A turn's drafting: the conversation's index, its governor, and the engine's counters.

    Per decode step in which a draft can fit at all (``StepCost.room``, asked once per company
    by the scheduler) a turn asks ``may_draft`` (it counts the step) and only then ``draft``; its
    tokens are ``push``-ed into a list that the index takes in when it is next searched. So a
    turn in a full batch, where no draft fits, costs a list append a step: on a GPU a small
    model's batched steps are short enough that indexing every token and asking the governor in
    full each step would show (docs/BENCHMARKS.md). The index itself is built at the first
    ``draft``: a turn that never drafts (a crowded GPU step never has room) never pays for
    indexing its prompt, milliseconds for a long one at admission, when no step launches."""

    def __init__(self, stats: SpeculationStats, cost: StepCost, prompt: Sequence[int]) -> None:
        self.stats = stats
        self.index: ContextIndex | None = None  # built from ``_new`` at the first ``draft``
        self.governor = Governor(cost)
        self._new: list[int] = list(prompt)  # tokens pushed, not yet in the index

    def may_draft(self) -> bool:
        """One decode step: whether a draft may pay in it (``Governor.may_draft``)."""
        self.governor.step()
        return self.governor.may_draft()

    def draft(self, limit: int, after: Sequence[int] = (), lag: bool = False) -> tuple[list[int], int]:
        """The tokens to verify after the turn's newest token (at most ``limit``; maybe none) and
        the length of the match they were copied after (the governor's evidence, ``verified``).
        Asked after ``may_draft`` said yes.

        ``after``: the drafts of the turn's window in flight, taken as accepted. ``lag``: the
        window's first token is that window's output, still on the device (run-ahead): the
        drafts are what followed the copy's guess of it, and hold only if the guess is right."""
        if limit <= 0:
            return [], 0
        if self.index is None:
            self.index = ContextIndex(self._new)  # the prompt and what came since, vectorised
        else:
            for tok in self._new:
                self.index.push(tok)
        self._new = []
        tokens, match = self.index.draft(min(limit, MAX_DRAFT) + lag, after)
        tokens = tokens[lag:]
        return tokens[: self.governor.length(len(tokens), match)], match

    def push(self, tok: int) -> None:
        """A token taken by the turn (the index takes it in at the next ``draft``)."""
        self._new.append(tok)

    def verified(self, drafted: int, accepted: int, emitted: int, match: int) -> None:
        """One decode window: ``drafted`` tokens (copied after a match of ``match`` tokens)
        verified, ``accepted`` kept, ``emitted`` tokens taken from it (the accepted ones plus the
        correction or bonus, fewer at a stop)."""
        self.governor.update(drafted, accepted, match)
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
        self.dropped = 0  # run-ahead windows planned after a draft that was then rejected
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
        ``tokens_per_forward`` (decode tokens per decode window), ``dropped`` (windows launched
        ahead after a draft that was then rejected: computed, never committed), ``by_window``
        (per window-size bucket ``"<=b"``: ``windows``, ``drafted``, ``accepted``)."""
        return {
            "mode": self.mode,
            "status": self.status,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "windows": self.windows,
            "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "tokens_per_forward": round(self.tokens / self.forwards, 4) if self.forwards else 0.0,
            "dropped": self.dropped,
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
        cpu = device == "cpu"
        self.cost = StepCost(
            StepCost.PRIOR_ROW_CPU if cpu else StepCost.PRIOR_ROW, None if cpu else StepCost.COMPANY_GPU
        )
        status = "on" if self.enabled else f"off: {off_because or '--speculate off'}"
        self.stats = SpeculationStats(mode, status)

    def for_turn(self, prompt: Sequence[int]) -> TurnDrafts | None:
        """A new turn's drafts over its prompt (every earlier turn plus this request), or None."""
        return TurnDrafts(self.stats, self.cost, prompt) if self.enabled else None

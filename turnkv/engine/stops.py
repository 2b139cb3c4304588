"""Stop strings: text that could be the start of a stop string is held back until it cannot."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Holds back text that could be the start of a stop string; cuts at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit: str | None = None  # the stop string the text was cut at (Anthropic's stop_sequence)

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text that is final now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self.pending += text
        found = [(i, -len(s), s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            cut, _, self.hit = min(found)  # the earliest; at one place, the longest
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

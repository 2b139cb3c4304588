"""The tiered merge policy of the segmented layout, and the layout's counters.

Merge policy (``MergePolicy.next_merge``; applied after every seal, pure over the refs' row counts):

1. The first segment is the *anchor* once it holds ``anchor_rows`` rows; an anchor is never
   rewritten (it is usually the longest history, and rewriting it would copy the whole past).
2. Cascade, as in a log-structured merge tree: while the newest segment has at least
   ``1 / ratio`` of the rows of the one before it, merge the two newest. Afterwards the sizes
   more than halve (ratio 2) from old to new, so a row is copied O(log(turns)) times and a
   conversation of n rows in turns of about s rows keeps about log2(n / s) segments.
3. Hard bound: while there are more than ``soft_limit`` segments, merge the adjacent
   (non-anchor) pair with the fewest rows together; cheapest copy first.

So a conversation never holds more than ``soft_limit`` (default ``SOFT_SEGMENTS`` = 8) sealed
segments, and its views (segments + tail) never exceed ``MAX_SEGMENTS``, the fused kernel's
per-launch limit, across any number of turns (counts over random turns: docs/BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from turnkv.limits import MAX_SEGMENTS  # the fused kernel reads at most this many views per launch

SOFT_SEGMENTS = 8  # the default policy keeps at most this many sealed segments (+1 tail <= MAX_SEGMENTS)
ANCHOR_ROWS = 512  # by default a first segment this long is never rewritten by a merge
MERGE_RATIO = 2  # by default cascade while newest * MERGE_RATIO >= the segment before it


@dataclass
class SegmentStats:
    """Counters of one layout (shared by all its caches); ``health()`` is what ``/health`` shows.

    ``max_segments`` is the most sealed segments any one cache held after its merges.
    """

    seals: int = 0
    merges: int = 0
    max_segments: int = 0
    sealed_rows: int = 0  # rows copied by seals
    merged_rows: int = 0  # rows copied by merges
    grown_rows: int = 0  # rows copied when a tail (or contiguous buffer) outgrew its capacity

    def health(self) -> dict[str, int]:
        return {"seals": self.seals, "merges": self.merges, "max_segments": self.max_segments}


@dataclass(frozen=True)
class MergePolicy:
    """The tiered merge policy of the module docstring. Invariant: ``3 <= soft_limit < MAX_SEGMENTS``
    (room for the tail's view in one fused launch, and a mergeable pair past an anchor)."""

    soft_limit: int = SOFT_SEGMENTS
    anchor_rows: int = ANCHOR_ROWS
    ratio: float = MERGE_RATIO

    def __post_init__(self) -> None:
        if not 3 <= self.soft_limit < MAX_SEGMENTS:
            raise ValueError(f"soft_limit {self.soft_limit} outside [3, {MAX_SEGMENTS})")

    def next_merge(self, sizes: Sequence[int]) -> int | None:
        """Merge refs ``i`` and ``i + 1`` next, or None to stop.

        ``sizes`` are the refs' row counts, oldest first. Applying it until None leaves at most
        ``soft_limit`` entries and never picks an anchored first entry.
        """
        first = 1 if sizes and sizes[0] >= self.anchor_rows else 0
        if len(sizes) - first < 2:
            return None
        if sizes[-1] * self.ratio >= sizes[-2]:
            return len(sizes) - 2
        if len(sizes) > self.soft_limit:
            return min(range(first, len(sizes) - 1), key=lambda i: sizes[i] + sizes[i + 1])
        return None


DEFAULT_POLICY = MergePolicy()

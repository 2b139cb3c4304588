"""Detaching a bank hit from the segments it would pin: copy the few rows a hit uses.

A hit is ``snapshot.prefix(n)``: references into banked segments. A reference to the first ``n``
rows of a segment keeps the *whole* segment alive. When two conversations share only a short
prefix (every ChatML chat starts with the same 3 tokens ``<|im_start|>system\\n``), a 3-row hit
into another conversation's 517-row segment pins 517 rows to save 3, and makes that idle entry
impossible to evict.

The rule, by bytes (all rows of one segment have the same size): a reference of ``n`` rows into a
segment of ``R`` rows that nothing else keeps alive is *short* when ``2 n < R`` -- it would pin more
rows it does not use than rows it uses. Copying its ``n`` rows into a fresh segment costs ``n`` rows
and lets the other ``R`` go with their entry; referencing costs nothing but pins ``R``. The bank
(``SessionBank.admit``) decides when to pay for the copy; this module only plans and makes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from turnkv.kv.segments import SegmentedSnapshot, SegmentRef, merge_refs


def held_segment_ids(items: Iterable[object]) -> set[int]:
    """Ids of the segments behind snapshots and live caches (anything with ``segments()``)."""
    out: set[int] = set()
    for item in items:
        segments = getattr(item, "segments", None)
        if segments is not None:
            out.update(seg.id for seg in segments())
    return out


@dataclass(frozen=True)
class DetachPlan:
    """Which refs of a hit are copied. ``referenced``: the refs kept as references (what the hit
    still pins, for the bank's measure); ``copied_rows``: rows the copy will allocate."""

    refs: tuple[SegmentRef, ...]
    copy: tuple[bool, ...]
    copied_rows: int

    @property
    def referenced(self) -> SegmentedSnapshot:
        return SegmentedSnapshot(r for r, c in zip(self.refs, self.copy, strict=True) if not c)

    def build(self) -> SegmentedSnapshot:
        """The hit with its copied refs replaced by fresh segments (adjacent ones become one)."""
        if not self.copied_rows:
            return SegmentedSnapshot(self.refs)
        out: list[SegmentRef] = []
        run: list[SegmentRef] = []
        for r, c in zip(self.refs, self.copy, strict=True):
            if c:
                run.append(r)
                continue
            if run:
                out.append(merge_refs(run))
                run = []
            out.append(r)
        if run:
            out.append(merge_refs(run))
        return SegmentedSnapshot(out)


def plan_detach(snapshot: SegmentedSnapshot, held: set[int], every_partial: bool) -> DetachPlan:
    """Plan which refs of ``snapshot`` to copy.

    A ref is copied when its segment is not in ``held`` (ids kept alive anyway), it covers only part
    of the segment, and either it is short (``2 n < R``) or ``every_partial``. A ref covering a whole
    segment is never copied (the copy would cost as much as it frees).
    """
    refs = snapshot.refs
    copy = tuple(
        r.segment.id not in held
        and r.n < r.segment.num_rows
        and (every_partial or 2 * r.n < r.segment.num_rows)
        for r in refs
    )
    return DetachPlan(refs, copy, sum(r.n for r, c in zip(refs, copy, strict=True) if c))

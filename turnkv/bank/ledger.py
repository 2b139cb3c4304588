"""The bank's running count of unique bytes: a reference count per segment over the banked entries.

A segment held by several entries (a shared system prompt, forks, every snapshot of one
conversation) counts once while any entry holds it; ``add`` and ``remove`` cost O(the entry's
segments), so the bank's eviction loop, ``unique_bytes`` and ``/health`` never re-measure every
entry at a decision. ``check`` recounts from scratch (the tests and
``SessionBank.check_integrity``).
"""

from __future__ import annotations

from collections.abc import Iterable

from turnkv.kv.cache import Snapshot


class SegmentLedger:
    """Reference counts of the segments behind a multiset of snapshots; ``total`` is their bytes."""

    def __init__(self) -> None:
        self._count: dict[int, int] = {}  # segment id -> holders
        self._bytes: dict[int, int] = {}  # segment id -> nbytes, while held
        self.total = 0

    def add(self, snapshot: Snapshot) -> None:
        for seg in snapshot.segments():
            held = self._count.get(seg.id, 0)
            if held == 0:
                self._bytes[seg.id] = seg.nbytes
                self.total += seg.nbytes
            self._count[seg.id] = held + 1

    def remove(self, snapshot: Snapshot) -> None:
        for seg in snapshot.segments():
            held = self._count[seg.id] - 1
            if held:
                self._count[seg.id] = held
            else:
                del self._count[seg.id]
                self.total -= self._bytes.pop(seg.id)

    def beside(self, items: Iterable[object]) -> int:
        """Unique bytes ``items`` (snapshots, live caches) add to the ledger's: their segments the
        ledger does not hold, each once, plus the live caches' private buffers."""
        extra: dict[int, int] = {}
        private = 0
        for item in items:
            for seg in item.segments():
                if seg.id not in self._count:
                    extra[seg.id] = seg.nbytes
            private += item.private_bytes()
        return private + sum(extra.values())

    def check(self, snapshots: Iterable[Snapshot]) -> None:
        """Raise unless the counts equal a recount over ``snapshots`` (all the ledger's holders)."""
        count: dict[int, int] = {}
        total = 0
        for snap in snapshots:
            for seg in snap.segments():
                if seg.id not in count:
                    total += seg.nbytes
                count[seg.id] = count.get(seg.id, 0) + 1
        if count != self._count or total != self.total:
            raise AssertionError(f"bank ledger drifted: {self.total} bytes counted, {total} held")

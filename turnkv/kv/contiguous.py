"""The contiguous layout: the honest baseline, one growing buffer per conversation.

This is what a server without segments does, kept so every claim about segments is measured
against it in the same run (``--kv-layout contiguous``):

- one buffer ``[L, Hkv, cap, D]`` per cache with amortised growth (a growth copies every row);
- ``snapshot()`` copies the rows into a private segment, so each snapshot costs its full bytes;
- ``restore(snapshot)`` copies the rows into a fresh buffer (on first use, sized by ``presize``, so a
  restore followed by a turn pays one copy, not two);
- ``trim`` moves the end (O(1)); ``seal`` only counts.

Snapshots are ``SegmentedSnapshot`` objects holding one ref to their own copied ``Segment``, so
``unique_bytes`` and both layouts' ``restore`` accept the snapshots of either layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from turnkv.kv.cache import KVShape, KVWindow
from turnkv.kv.segments import (
    Segment,
    SegmentedSnapshot,
    SegmentStats,
    check_segment,
    grown_capacity,
)


class ContiguousKV:
    """A live cache in one buffer (implements ``KVCache``); a window has exactly one view.

    Rows ``[0, n)`` are committed, ``[n, n + m)`` the open window. Until the first access that needs
    the buffer, a restored cache reads its rows from ``source`` (a snapshot it will copy).
    """

    def __init__(
        self,
        shape: KVShape,
        stats: SegmentStats | None = None,
        source: SegmentedSnapshot | None = None,
    ) -> None:
        self.shape = shape
        self.stats = stats if stats is not None else SegmentStats()
        self._k: torch.Tensor | None = None  # [L, Hkv, cap, D]
        self._v: torch.Tensor | None = None
        self._source = source if source is not None and source.num_tokens else None
        if self._source is not None:
            for seg in self._source.segments():
                check_segment(shape, seg)
        self._tokens: list[int] = list(source.tokens) if source is not None else []
        self._n = len(self._tokens)
        self._m = 0
        self._planned = 0
        self._dirty = False  # rows committed since the last seal

    @property
    def num_tokens(self) -> int:
        return self._n

    @property
    def tokens(self) -> list[int]:
        """A copy of the committed token ids (one per row)."""
        return list(self._tokens)

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def segments(self) -> tuple[Segment, ...]:
        # A restored cache keeps its source's segments alive until it copies them.
        return self._source.segments() if self._source is not None else ()

    def private_bytes(self) -> int:
        return self.capacity * self.shape.bytes_per_row

    def presize(self, rows: int) -> None:
        """At most ``rows`` more rows come this turn: the next allocation holds exactly them."""
        self._planned = max(self._planned, self._n + max(rows, 0))

    def open_window(self, m: int) -> KVWindow:
        """Open rows ``[n, n + m)``: one view ``[L, Hkv, n + m, D]`` of the buffer (grown if needed)."""
        if m < 1:
            raise ValueError(f"open_window({m})")
        rows = self._n + m
        self._ensure(rows)
        self._m = m
        assert self._k is not None and self._v is not None
        return KVWindow(((self._k[:, :, :rows], self._v[:, :, :rows]),), self._n, m)

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(k, v)]``: one zero-copy view ``[L, Hkv, n, D]`` of the committed rows (none if empty)."""
        if self._n == 0:
            return []
        self._ensure(self._n)
        assert self._k is not None and self._v is not None
        return [(self._k[:, :, : self._n], self._v[:, :, : self._n])]

    def commit(self, tokens: Sequence[int]) -> None:
        if len(tokens) > self._m:
            raise ValueError(f"commit of {len(tokens)} ids into a window of {self._m} rows")
        self._n += len(tokens)
        self._tokens.extend(int(t) for t in tokens)
        self._m = 0
        self._dirty = self._dirty or bool(tokens)

    def trim(self, n: int) -> None:
        """Keep rows ``[0, n)``: O(1) apart from the token list; no row moves."""
        if not 0 <= n <= self._n:
            raise ValueError(f"trim({n}) of a cache of {self._n} rows")
        self._n = n
        self._m = 0
        del self._tokens[n:]
        if self._source is not None:
            self._source = self._source.prefix(n) if n else None

    def seal(self) -> None:
        """Counts a turn; the rows stay where they are."""
        self._m = 0
        if self._dirty:
            self.stats.seals += 1
            self._dirty = False
        self.stats.max_segments = max(self.stats.max_segments, 1 if self._n else 0)

    def share_prefix(self) -> None:
        """Nothing is shared: a restore copies (``copies_on_restore``)."""

    def snapshot(self) -> SegmentedSnapshot:
        """A copy of rows ``[0, n)`` in a new private segment."""
        if self._n == 0:
            return SegmentedSnapshot()
        self._ensure(self._n)
        assert self._k is not None and self._v is not None
        k = self._k[:, :, : self._n].clone(memory_format=torch.contiguous_format)  # [L, Hkv, n, D]
        v = self._v[:, :, : self._n].clone(memory_format=torch.contiguous_format)
        return SegmentedSnapshot.of(Segment(k, v, tuple(self._tokens)))

    def fork(self) -> ContiguousKV:
        """An independent cache with a copy of the rows."""
        return ContiguousKV(self.shape, self.stats, self.snapshot())

    def _ensure(self, need: int) -> None:
        """Make the buffer hold ``need`` rows: first materialise a restore, else grow by copying."""
        if self._k is not None and need <= self.capacity:
            return
        s = self.shape
        cap = grown_capacity(need, self.capacity, self._planned)
        k = torch.empty((s.num_layers, s.num_kv_heads, cap, s.head_dim), dtype=s.dtype, device=s.device)
        v = torch.empty_like(k)
        if self._k is not None and self._v is not None:
            k[:, :, : self._n].copy_(self._k[:, :, : self._n])
            v[:, :, : self._n].copy_(self._v[:, :, : self._n])
            self.stats.grown_rows += self._n
        elif self._source is not None:
            offset = 0
            for r in self._source.refs:
                k[:, :, offset : offset + r.n].copy_(r.segment.k[:, :, : r.n])
                v[:, :, offset : offset + r.n].copy_(r.segment.v[:, :, : r.n])
                offset += r.n
            self._source = None
        self._k, self._v = k, v


class ContiguousLayout:
    """Makes contiguous caches of one shape; ``stats`` has the same keys as the segmented layout's."""

    name = "contiguous"
    copies_on_restore = True  # admission prices a restore's rows when the layout copies them

    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self.stats = SegmentStats()

    def counters(self) -> dict[str, int]:
        """``seals``, ``merges``, ``max_segments`` for ``/health.segments``."""
        return self.stats.health()

    def new(self) -> ContiguousKV:
        return ContiguousKV(self.shape, self.stats)

    def restore(self, snapshot: SegmentedSnapshot) -> ContiguousKV:
        """A live cache with a copy of ``snapshot``'s rows (made on first use)."""
        if not isinstance(snapshot, SegmentedSnapshot):
            raise TypeError(f"cannot restore a {type(snapshot).__name__}")
        return ContiguousKV(self.shape, self.stats, snapshot)

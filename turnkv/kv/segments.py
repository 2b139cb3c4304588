"""The segmented layout: a conversation's KV rows as immutable per-turn segments plus one tail.

A ``Segment`` holds the rows of one finished turn (or of a merge of several) for every layer and is
never written after it is built. A ``SegmentRef`` names the first ``n`` rows of a segment, so a
snapshot, a fork or a rollback is a short list of references: none of them copies KV rows.
``ConversationKV`` is the live cache of the ``KVCache`` contract: its refs plus one mutable tail
that grows in place during the current turn; ``seal()`` copies the tail's rows into a new segment.

The merge policy that keeps a conversation short lives in ``turnkv.kv.merge``.

A merge writes a *new* segment; snapshots taken before keep references to the old ones, so no
snapshot ever sees a change. Merged copies are the only KV memory a merge allocates (and while an
older snapshot still holds the old segments, both count in ``unique_bytes``).

``snapshot()`` seals first (a snapshot covers every committed row, as with the contiguous layout);
the engine calls ``seal()`` at the end of a turn, so the bank's snapshot then copies nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from turnkv.kv.cache import KVShape, KVWindow
from turnkv.kv.merge import (  # noqa: F401  (re-exported: the layout's public names)
    ANCHOR_ROWS,
    DEFAULT_POLICY,
    MAX_SEGMENTS,
    MERGE_RATIO,
    SOFT_SEGMENTS,
    MergePolicy,
    SegmentStats,
)

TAIL_MIN_ROWS = 64  # smallest tail allocation; avoids regrowing for every decode step
TAIL_GROWTH = 1.5  # amortised growth factor of a tail (or a contiguous buffer)

_ids = itertools.count(1)
_last_id = 0


def segments_created() -> int:
    """How many segments this process has built (ids are 1..this); tests use it to prove no copy."""
    return _last_id


@dataclass(frozen=True, eq=False)
class Segment:
    """Immutable K/V rows of all layers for ``T`` consecutive tokens.

    ``k``, ``v``: ``[L, Hkv, T, D]`` (row axis 2, so ``k[l]`` is one layer's ``[Hkv, T, D]``);
    ``tokens``: the ``T`` token ids. ``id`` is unique in the process. Nothing writes the tensors after
    construction. Equality and hashing are by identity, so a set of segments dedupes shared ones.
    """

    k: torch.Tensor = field(repr=False)
    v: torch.Tensor = field(repr=False)
    tokens: tuple[int, ...] = field(repr=False)
    # a copy still filling k and v (a CUDA event: a restore from the RAM tier); None: they hold the
    # rows. Readers on the compute stream join it first (``join_copies``), the host never waits.
    ready: object | None = field(default=None, repr=False)
    id: int = field(init=False)

    def __post_init__(self) -> None:
        global _last_id
        if self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise ValueError(
                f"k/v must be equal [L, Hkv, T, D]; got {tuple(self.k.shape)}, {tuple(self.v.shape)}"
            )
        if self.k.dtype != self.v.dtype or self.k.device != self.v.device:
            raise ValueError("k and v must share dtype and device")
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if self.k.shape[2] != len(self.tokens):
            raise ValueError(f"{self.k.shape[2]} rows but {len(self.tokens)} token ids")
        sid = next(_ids)
        _last_id = sid
        object.__setattr__(self, "id", sid)

    @property
    def num_rows(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def __repr__(self) -> str:
        return f"Segment(id={self.id}, rows={self.num_rows}, nbytes={self.nbytes})"


def copying(segments: Iterable[Segment]) -> bool:
    """Whether a copy still fills one of ``segments`` (its event has not completed); never blocks."""
    return any(s.ready is not None and not s.ready.query() for s in segments)


def join_copies(segments: Iterable[Segment], steps: bool = True) -> None:
    """Order the current stream after every copy still filling ``segments``: what it runs
    afterwards reads the rows (the GPU waits, not the host). ``steps``: this is the steps' stream,
    and the copies are forgotten: every other stream that reads a segment later orders itself
    after an event recorded on the steps' stream (a mirror, a disk write). Any other stream
    forgets a copy only once it has completed."""
    for s in segments:
        ev = s.ready
        if ev is None:
            continue
        done = ev.query()
        if s.k.is_cuda and not done:
            torch.cuda.current_stream(s.k.device).wait_event(ev)
        if steps or done:
            object.__setattr__(s, "ready", None)


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """The first ``n`` rows of ``segment`` (``0 <= n <= segment.num_rows``); a zero-copy view."""

    segment: Segment
    n: int

    def __post_init__(self) -> None:
        if not 0 <= self.n <= self.segment.num_rows:
            raise ValueError(f"ref of {self.n} rows into a segment of {self.segment.num_rows}")

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of all layers, each ``[L, Hkv, n, D]``, views into the segment."""
        seg = self.segment
        if self.n == seg.num_rows:
            return seg.k, seg.v
        return seg.k[:, :, : self.n], seg.v[:, :, : self.n]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.segment.tokens[: self.n]


class HoldsKV(Protocol):
    """What ``unique_bytes`` needs: the shared segments an item references and its private bytes."""

    def segments(self) -> tuple[Segment, ...]: ...

    def private_bytes(self) -> int: ...


class SegmentedSnapshot:
    """An immutable tuple of refs; the rows ``[0, num_tokens)`` of a conversation at one moment.

    Building one, ``prefix`` and ``segments`` cost O(number of refs) and copy no rows; ``tokens`` is
    concatenated once, on first use. The contiguous layout's snapshots are this type too (one ref to
    a private copied segment), so both layouts restore from either.
    """

    __slots__ = ("_tokens", "num_tokens", "refs")

    def __init__(self, refs: Iterable[SegmentRef] = ()) -> None:
        self.refs: tuple[SegmentRef, ...] = tuple(r for r in refs if r.n > 0)
        self.num_tokens: int = sum(r.n for r in self.refs)
        self._tokens: tuple[int, ...] | None = None

    @classmethod
    def of(cls, segment: Segment) -> SegmentedSnapshot:
        """A snapshot of one whole segment (e.g. rows loaded from the disk tier)."""
        return cls((SegmentRef(segment, segment.num_rows),))

    @property
    def tokens(self) -> tuple[int, ...]:
        if self._tokens is None:
            self._tokens = tuple(itertools.chain.from_iterable(r.tokens for r in self.refs))
        return self._tokens

    def prefix(self, n: int) -> SegmentedSnapshot:
        """The first ``n`` rows: refs past ``n`` dropped, the one across ``n`` shortened; no copy."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"prefix({n}) of a snapshot of {self.num_tokens} rows")
        return SegmentedSnapshot(_cut_refs(self.refs, n))

    def segments(self) -> tuple[Segment, ...]:
        return tuple(dict.fromkeys(r.segment for r in self.refs))

    def private_bytes(self) -> int:
        return 0

    def read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[start, stop)`` of all layers as ``(k, v)`` ``[L, Hkv, stop-start, D]``.

        A view when the range lies inside one segment, otherwise a concatenated copy (for writers
        that need a run of rows as one buffer, such as the disk tier's blocks).
        """
        if not 0 <= start <= stop <= self.num_tokens or not self.refs:
            raise ValueError(f"rows [{start}, {stop}) of a snapshot of {self.num_tokens}")
        join_copies((r.segment for r in self.refs), steps=False)  # rows restored a moment ago
        if start == stop:
            seg = self.refs[0].segment
            return seg.k[:, :, :0], seg.v[:, :, :0]
        ks, vs, offset = [], [], 0
        for r in self.refs:
            lo, hi = max(start - offset, 0), min(stop - offset, r.n)
            if lo < hi:
                ks.append(r.segment.k[:, :, lo:hi])
                vs.append(r.segment.v[:, :, lo:hi])
            offset += r.n
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def __repr__(self) -> str:
        return f"SegmentedSnapshot(rows={self.num_tokens}, segments={[r.segment.id for r in self.refs]})"


def _cut_refs(refs: Sequence[SegmentRef], n: int) -> list[SegmentRef]:
    """The refs covering rows ``[0, n)``; the ref across ``n`` is shortened, later ones dropped."""
    out, offset = [], 0
    for r in refs:
        if offset >= n:
            break
        keep = min(r.n, n - offset)
        out.append(r if keep == r.n else SegmentRef(r.segment, keep))
        offset += keep
    return out


def merge_refs(refs: Sequence[SegmentRef]) -> SegmentRef:
    """One new segment holding the rows of ``refs`` in order (a copy); the old segments are untouched."""
    k = torch.cat([r.segment.k[:, :, : r.n] for r in refs], dim=2)  # [L, Hkv, sum n, D]
    v = torch.cat([r.segment.v[:, :, : r.n] for r in refs], dim=2)
    seg = Segment(k, v, tuple(itertools.chain.from_iterable(r.tokens for r in refs)))
    return SegmentRef(seg, seg.num_rows)


def check_segment(shape: KVShape, seg: Segment) -> None:
    """Raise unless ``seg``'s rows have ``shape``'s geometry, dtype and device."""
    l_, h, _, d = seg.k.shape
    if (l_, h, d) != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
        raise ValueError(f"segment of [L, Hkv, D] = {[l_, h, d]} does not fit {shape}")
    want = torch.device(shape.device)
    here = seg.k.device
    same_device = here.type == want.type and (want.index is None or here.index in (None, want.index))
    if seg.k.dtype != shape.dtype or not same_device:
        raise ValueError(
            f"segment rows are {seg.k.dtype} on {seg.k.device}, cache is {shape.dtype} on {shape.device}"
        )


def grown_capacity(need: int, cap: int, planned: int) -> int:
    """Capacity for a buffer that must hold ``need`` rows: amortised, at least the planned size."""
    return max(need, planned, math.ceil(cap * TAIL_GROWTH), TAIL_MIN_ROWS)


class ConversationKV:
    """The live segmented cache of one conversation (implements ``KVCache``).

    State: ``refs`` (sealed rows ``[0, R)``), a tail buffer ``[L, Hkv, cap, D]`` whose first ``n_tail``
    rows are the committed rows ``[R, R + n_tail)`` of this turn, and an open window of ``m`` reserved
    rows after them. ``tokens`` has one id per committed row. Only the tail is ever written.
    The tail is allocated by the first ``open_window`` (sized by ``presize``) and released by ``seal``.
    """

    def __init__(
        self,
        shape: KVShape,
        refs: Iterable[SegmentRef] = (),
        stats: SegmentStats | None = None,
        tokens: Sequence[int] | None = None,
        policy: MergePolicy = DEFAULT_POLICY,
    ) -> None:
        self.shape = shape
        self.stats = stats if stats is not None else SegmentStats()
        self.policy = policy
        self._refs: list[SegmentRef] = [r for r in refs if r.n > 0]
        for seg in dict.fromkeys(r.segment for r in self._refs):
            check_segment(shape, seg)
        self._ref_rows = sum(r.n for r in self._refs)
        if tokens is None:
            tokens = list(itertools.chain.from_iterable(r.tokens for r in self._refs))
        self._tokens: list[int] = list(tokens)
        if len(self._tokens) != self._ref_rows:
            raise ValueError(f"{len(self._tokens)} token ids for {self._ref_rows} rows")
        self._tk: torch.Tensor | None = None  # [L, Hkv, cap, D]
        self._tv: torch.Tensor | None = None
        self._n_tail = 0
        self._m = 0  # rows reserved by the open window
        self._planned = 0  # tail rows the engine announced for this turn
        self._shared = 0  # leading refs other caches share this turn: merges leave them alone
        # [L, Hkv, n_i, D] views of every ref, rebuilt only when the refs change
        self._ref_kv = tuple(r.kv() for r in self._refs)
        if len(self._refs) > policy.soft_limit:  # only a hand-built snapshot can get here
            self._compact()
        self._note_count()

    # -- reading ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self._ref_rows + self._n_tail

    @property
    def tokens(self) -> list[int]:
        """A copy of the committed token ids (one per row)."""
        return list(self._tokens)

    @property
    def refs(self) -> tuple[SegmentRef, ...]:
        return tuple(self._refs)

    @property
    def num_segments(self) -> int:
        return len(self._refs)

    @property
    def tail_rows(self) -> int:
        return self._n_tail

    @property
    def tail_capacity(self) -> int:
        return 0 if self._tk is None else self._tk.shape[2]

    def segments(self) -> tuple[Segment, ...]:
        return tuple(dict.fromkeys(r.segment for r in self._refs))

    def private_bytes(self) -> int:
        """The tail's allocated capacity, in bytes (never shared)."""
        return self.tail_capacity * self.shape.bytes_per_row

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zero-copy ``[L, Hkv, T_i, D]`` views of the committed rows ``[0, n)``, in row order."""
        out = list(self._ref_kv)
        if self._n_tail:
            assert self._tk is not None and self._tv is not None
            out.append((self._tk[:, :, : self._n_tail], self._tv[:, :, : self._n_tail]))
        return out

    # -- one window ------------------------------------------------------------------------------
    def presize(self, rows: int) -> None:
        """At most ``rows`` more rows come this turn: the tail is then allocated for exactly that many.

        The admission prices the same number, so the caller includes any verify window that may
        reach past the last kept row; a window past this size still works but regrows (a copy).
        """
        self._planned = max(self._planned, self._n_tail + max(rows, 0))

    def open_window(self, m: int) -> KVWindow:
        """Open rows ``[n, n + m)``; grows the tail if needed (copying only its committed rows)."""
        if m < 1:
            raise ValueError(f"open_window({m})")
        need = self._n_tail + m
        if need > self.tail_capacity:
            self._grow(grown_capacity(need, self.tail_capacity, self._planned))
        self._m = m
        assert self._tk is not None and self._tv is not None
        tail = (self._tk[:, :, :need], self._tv[:, :, :need])
        return KVWindow((*self._ref_kv, tail), self.num_tokens, m)

    def commit(self, tokens: Sequence[int]) -> None:
        """Keep the first ``len(tokens)`` rows of the window as those ids; drop the rest; close it."""
        if len(tokens) > self._m:
            raise ValueError(f"commit of {len(tokens)} ids into a window of {self._m} rows")
        self._n_tail += len(tokens)
        self._tokens.extend(int(t) for t in tokens)
        self._m = 0

    # -- turns -----------------------------------------------------------------------------------
    def trim(self, n: int) -> None:
        """Keep rows ``[0, n)``. Inside the tail it moves the end; below it, refs are shortened."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"trim({n}) of a cache of {self.num_tokens} rows")
        self._m = 0
        del self._tokens[n:]
        if n >= self._ref_rows:
            self._n_tail = n - self._ref_rows
            return
        self._n_tail = 0  # the tail buffer stays allocated for the rows that follow
        self._set_refs(_cut_refs(self._refs, n))

    def seal(self) -> Segment | None:
        """End the turn: copy the tail's rows into a new segment, release the tail, then merge.

        Drops an open window. Returns the new segment (None if the tail held no rows).
        """
        self._m = 0
        n = self._n_tail
        seg = None
        if n:
            assert self._tk is not None and self._tv is not None
            k = self._tk[:, :, :n].clone(memory_format=torch.contiguous_format)  # [L, Hkv, n, D]
            v = self._tv[:, :, :n].clone(memory_format=torch.contiguous_format)
            seg = Segment(k, v, tuple(self._tokens[self._ref_rows :]))
            self.stats.seals += 1
            self.stats.sealed_rows += n
            self._set_refs([*self._refs, SegmentRef(seg, n)])
            self._n_tail = 0
            self._compact()
            self._note_count()
        self._tk = self._tv = None
        self._planned = 0
        return seg

    def share_prefix(self) -> None:
        """The refs held now are shared with other live caches (the forks of one prompt): while
        this cache stays within the soft limit, a merge never rewrites them (it would copy the
        shared rows into this cache alone)."""
        self._shared = len(self._refs)

    def snapshot(self) -> SegmentedSnapshot:
        """Seals the tail if it holds rows, then returns the refs; no copy once sealed."""
        if self._n_tail:
            self.seal()
        return SegmentedSnapshot(self._refs)

    def fork(self) -> ConversationKV:
        """An independent cache over the same rows (via ``snapshot()``, so the tail is sealed first)."""
        snap = self.snapshot()
        return ConversationKV(self.shape, snap.refs, self.stats, self._tokens, self.policy)

    # -- internals -------------------------------------------------------------------------------
    def _grow(self, cap: int) -> None:
        s = self.shape
        tk = torch.empty((s.num_layers, s.num_kv_heads, cap, s.head_dim), dtype=s.dtype, device=s.device)
        tv = torch.empty_like(tk)
        if self._n_tail:  # only this turn's committed rows move
            assert self._tk is not None and self._tv is not None
            tk[:, :, : self._n_tail].copy_(self._tk[:, :, : self._n_tail])
            tv[:, :, : self._n_tail].copy_(self._tv[:, :, : self._n_tail])
            self.stats.grown_rows += self._n_tail
        self._tk, self._tv = tk, tv

    def _set_refs(self, refs: list[SegmentRef]) -> None:
        self._refs = refs
        self._ref_rows = sum(r.n for r in refs)
        self._ref_kv = tuple(r.kv() for r in refs)

    def _compact(self) -> None:
        refs = list(self._refs)
        while True:
            skip = min(self._shared, len(refs)) if len(refs) <= self.policy.soft_limit else 0
            i = self.policy.next_merge([r.n for r in refs[skip:]])
            if i is None:
                break
            i += skip
            merged = merge_refs(refs[i : i + 2])
            refs[i : i + 2] = [merged]
            self.stats.merges += 1
            self.stats.merged_rows += merged.n
        self._set_refs(refs)

    def _note_count(self) -> None:
        self.stats.max_segments = max(self.stats.max_segments, len(self._refs))


class SegmentedLayout:
    """Makes segmented caches of one shape; ``stats`` counts seals and merges over all of them."""

    name = "segmented"
    copies_on_restore = False  # admission prices a restore's rows when the layout copies them

    def __init__(self, shape: KVShape, policy: MergePolicy = DEFAULT_POLICY) -> None:
        self.shape = shape
        self.policy = policy
        self.stats = SegmentStats()

    def counters(self) -> dict[str, int]:
        """``seals``, ``merges``, ``max_segments`` for ``/health.segments``."""
        return self.stats.health()

    def new(self) -> ConversationKV:
        return ConversationKV(self.shape, stats=self.stats, policy=self.policy)

    def restore(self, snapshot: SegmentedSnapshot) -> ConversationKV:
        """A live cache continuing from ``snapshot``: its refs, no KV memory (the tail comes lazily)."""
        if not isinstance(snapshot, SegmentedSnapshot):
            raise TypeError(f"cannot restore a {type(snapshot).__name__}")
        return ConversationKV(self.shape, snapshot.refs, self.stats, snapshot.tokens, self.policy)


def unique_bytes(*items: HoldsKV | Segment) -> int:
    """Bytes of KV memory behind ``items``: each segment once by identity, plus private buffers."""
    seen: dict[int, Segment] = {}
    private = 0
    for item in items:
        if isinstance(item, Segment):
            seen[id(item)] = item
            continue
        for seg in item.segments():
            seen[id(seg)] = seg
        private += item.private_bytes()
    return private + sum(seg.nbytes for seg in seen.values())

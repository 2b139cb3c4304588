"""The contiguous baseline: one buffer, one view, snapshots and restores that copy."""

from __future__ import annotations

import torch

from turnkv.kv import ContiguousLayout, KVShape, SegmentedLayout, make_layout, unique_bytes
from turnkv.kv.segments import segments_created

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))


def append(cache, rows: int, gen: torch.Generator) -> torch.Tensor:
    """One window of ``rows`` rows, all kept; returns its K ``[L, Hkv, rows, D]`` (V is its negation)."""
    s = cache.shape
    start = cache.num_tokens
    k = torch.randn(s.num_layers, s.num_kv_heads, rows, s.head_dim, generator=gen)
    win = cache.open_window(rows)
    for layer in range(s.num_layers):
        win.write(layer, k[layer], -k[layer])
    cache.commit(range(start, start + rows))
    return k


def rows_of(cache, layer: int) -> torch.Tensor:
    views = cache.views()
    assert len(views) == 1
    return views[0][0][layer]


def test_views_are_one_zero_copy_view() -> None:
    cache = ContiguousLayout(SHAPE).new()
    assert cache.views() == []
    gen = torch.Generator().manual_seed(0)
    a = append(cache, 5, gen)
    b = append(cache, 3, gen)
    view = rows_of(cache, 1)
    assert torch.equal(view, torch.cat([a[1], b[1]], dim=1))
    assert view.data_ptr() == rows_of(cache, 1).data_ptr()  # the buffer itself, every call


def test_snapshot_is_a_copy_and_counts_separately() -> None:
    layout = make_layout("contiguous", SHAPE)
    cache = layout.new()
    gen = torch.Generator().manual_seed(1)
    a = append(cache, 6, gen)
    cache.seal()
    snap = cache.snapshot()
    assert snap.num_tokens == 6 and snap.tokens == tuple(range(6))
    cache.trim(2)
    append(cache, 4, gen)  # overwrites rows 2..5 of the buffer
    k, v = snap.read_rows(0, 6)
    assert torch.equal(k, a) and torch.equal(v, -a)
    assert unique_bytes(cache, snap) == (cache.capacity + 6) * SHAPE.bytes_per_row
    assert unique_bytes(cache, snap, snap.prefix(3)) == unique_bytes(cache, snap)
    assert layout.stats.seals == 1 and layout.stats.merges == 0 and layout.stats.max_segments == 1


def test_trim_is_o1_and_moves_no_row() -> None:
    cache = ContiguousLayout(SHAPE).new()
    gen = torch.Generator().manual_seed(2)
    a = append(cache, 9, gen)
    ptr, cap = rows_of(cache, 0).data_ptr(), cache.capacity
    cache.trim(4)
    assert cache.num_tokens == 4 and cache.tokens == [0, 1, 2, 3]
    assert rows_of(cache, 0).data_ptr() == ptr and cache.capacity == cap
    assert torch.equal(rows_of(cache, 0), a[0, :, :4])


def test_restore_copies_once_into_a_buffer_sized_by_plan() -> None:
    layout = ContiguousLayout(SHAPE)
    cache = layout.new()
    gen = torch.Generator().manual_seed(3)
    a = append(cache, 7, gen)
    snap = cache.snapshot()
    restored = layout.restore(snap)
    assert restored.capacity == 0  # the copy waits for first use, so plan() can size it
    restored.presize(100)
    b = append(restored, 50, gen)
    assert restored.capacity >= 107 and layout.stats.grown_rows == 0
    view = rows_of(restored, 0)
    assert torch.equal(view, torch.cat([a[0], b[0]], dim=1))
    seg = snap.refs[0].segment
    assert view.untyped_storage().data_ptr() != seg.k.untyped_storage().data_ptr()
    k, _ = snap.read_rows(0, 7)
    assert torch.equal(k, a)  # writing the restored cache left the snapshot alone


def test_snapshots_cross_layouts() -> None:
    gen = torch.Generator().manual_seed(4)
    seg_layout, con_layout = SegmentedLayout(SHAPE), ContiguousLayout(SHAPE)
    live = seg_layout.new()
    a = append(live, 5, gen)
    live.seal()
    b = append(live, 3, gen)
    snap = live.snapshot()  # two segments
    copy = con_layout.restore(snap.prefix(7))
    assert torch.equal(rows_of(copy, 1), torch.cat([a[1], b[1, :, :2]], dim=1))
    # A contiguous snapshot restores zero-copy into the segmented layout.
    csnap = copy.snapshot()
    created = segments_created()
    back = seg_layout.restore(csnap)
    assert segments_created() == created and back.num_segments == 1
    assert back.views()[0][0].data_ptr() == csnap.refs[0].segment.k.data_ptr()
    assert back.tokens == list(range(7))


def test_fork_is_an_independent_copy() -> None:
    cache = ContiguousLayout(SHAPE).new()
    gen = torch.Generator().manual_seed(5)
    a = append(cache, 4, gen)
    fork = cache.fork()
    cache.trim(1)
    append(cache, 3, gen)
    assert torch.equal(rows_of(fork, 0), a[0])
    assert unique_bytes(cache, fork) == (cache.capacity + fork.capacity) * SHAPE.bytes_per_row

"""The segmented layout: zero-copy views, seals, merges, snapshots, forks, restores and byte counts."""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnkv.kv import (
    ConversationKV,
    KVShape,
    MergePolicy,
    Segment,
    SegmentedLayout,
    SegmentedSnapshot,
    SegmentRef,
    make_layout,
    unique_bytes,
)
from turnkv.kv.segments import ANCHOR_ROWS, MAX_SEGMENTS, SOFT_SEGMENTS, segments_created

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
TINY = KVShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))


def add_turn(cache, rows: int, gen: torch.Generator, window: int = 7) -> torch.Tensor:
    """Append ``rows`` rows in windows (one row kept less in the last window); returns K ``[L, Hkv, rows, D]``."""
    s = cache.shape
    cache.presize(rows + 1)  # the last window reaches one row past the kept ones
    kept = []
    start = cache.num_tokens
    while sum(k.shape[2] for k in kept) < rows:
        m = min(window, rows - sum(k.shape[2] for k in kept))
        win = cache.open_window(m + 1)  # one extra row that the commit drops, like a rejected draft
        k = torch.randn(s.num_layers, s.num_kv_heads, m + 1, s.head_dim, generator=gen, dtype=s.dtype)
        for layer in range(s.num_layers):
            win.write(layer, k[layer], -k[layer])
        cache.commit(range(start, start + m))
        start += m
        kept.append(k[:, :, :m])
    return torch.cat(kept, dim=2)


def storages(cache_or_snap) -> set[int]:
    return {t.untyped_storage().data_ptr() for seg in cache_or_snap.segments() for t in (seg.k, seg.v)}


def history(turns: list[int], shape: KVShape = SHAPE, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    layout = SegmentedLayout(shape)
    cache = layout.new()
    rows = []
    for n in turns:
        rows.append(add_turn(cache, n, gen))
        cache.seal()
    return layout, cache, (torch.cat(rows, dim=2) if rows else None)


def test_views_are_zero_copy_and_cover_all_rows() -> None:
    _, cache, rows = history([40, 9, 3])
    gen = torch.Generator().manual_seed(1)
    win = cache.open_window(5)
    k = torch.randn(SHAPE.num_kv_heads, 5, SHAPE.head_dim, generator=gen)
    tails = set()
    for layer in range(SHAPE.num_layers):
        win.write(layer, k, k)
        views = win.layer_views(layer)
        assert len(views) == cache.num_segments + 1  # the tail is last
        tails |= {t.untyped_storage().data_ptr() for t in views[-1]}
        ptrs = {t.untyped_storage().data_ptr() for pair in views[:-1] for t in pair}
        assert ptrs <= storages(cache)
        got = torch.cat([kk for kk, _ in views], dim=1)
        assert torch.equal(got, torch.cat([rows[layer], k], dim=1))
    assert len(tails) == 2  # one K and one V tail buffer shared by all layers
    # A view of a sealed segment is the segment's memory itself, not a copy.
    first = cache.refs[0]
    assert win.layer_views(0)[0][0].data_ptr() == first.segment.k[0].data_ptr()
    assert win.views[0][0].data_ptr() == first.segment.k.data_ptr()  # all layers, one stride apart


def test_seal_copies_only_this_turns_rows_and_keeps_old_segments() -> None:
    layout, cache, _ = history([600, 100])
    before = [r.segment for r in cache.refs]
    sealed_rows = layout.stats.sealed_rows
    gen = torch.Generator().manual_seed(2)
    add_turn(cache, 30, gen)
    assert layout.stats.grown_rows == 0  # plan() sized the tail, so no growth copy
    seg = cache.seal()
    assert seg is not None and seg.num_rows == 30
    assert layout.stats.sealed_rows - sealed_rows == 30
    assert [r.segment for r in cache.refs][:2] == before
    assert cache.tail_capacity == 0 and cache.private_bytes() == 0  # the tail is released


def test_snapshot_fork_restore_prefix_trim_allocate_no_kv_memory() -> None:
    layout, cache, rows = history([300, 50, 20, 7])
    created = segments_created()
    ptrs = storages(cache)
    total = unique_bytes(cache)

    snap = cache.snapshot()  # the tail is empty: nothing to seal
    fork = cache.fork()
    again = layout.restore(snap)
    part = layout.restore(snap.prefix(333))
    cache.trim(310)  # into the second segment

    assert segments_created() == created
    for c in (fork, again, part, cache):
        assert c.tail_capacity == 0
        assert storages(c) <= ptrs
        views = [(k[1], v[1]) for k, v in c.views()]
        assert {kv.untyped_storage().data_ptr() for pair in views for kv in pair} <= ptrs
    assert unique_bytes(cache, snap, fork, again, part) == total
    assert part.num_tokens == 333 and part.tokens == list(range(333))
    got = torch.cat([k[2] for k, _ in part.views()], dim=1)
    assert torch.equal(got, rows[2, :, :333])
    assert cache.num_tokens == 310 and [r.n for r in cache.refs] == [300, 10]


def test_snapshot_seals_the_tail_first() -> None:
    layout, cache, _ = history([20])
    add_turn(cache, 5, torch.Generator().manual_seed(3))
    snap = cache.snapshot()
    assert snap.num_tokens == cache.num_tokens == 25
    assert cache.tail_rows == 0 and layout.stats.seals == 2


def test_merges_leave_old_snapshots_and_the_anchor_untouched() -> None:
    gen = torch.Generator().manual_seed(4)
    layout = SegmentedLayout(TINY)
    cache = layout.new()
    add_turn(cache, ANCHOR_ROWS + 10, gen)
    cache.seal()
    anchor = cache.refs[0].segment
    anchor_k = anchor.k.clone()
    snaps = []
    rng = random.Random(4)
    for _ in range(60):
        add_turn(cache, rng.randint(1, 400), gen, window=64)
        cache.seal()
        snap = cache.snapshot()
        snaps.append((snap, snap.read_rows(0, snap.num_tokens)[0].clone()))
        assert cache.refs[0].segment is anchor
    assert layout.stats.merges > 0
    assert torch.equal(anchor.k, anchor_k)
    for snap, k in snaps:
        assert torch.equal(snap.read_rows(0, snap.num_tokens)[0], k)
    # Every snapshot holds its own refs; the merged copies are the only extra memory.
    every = {id(s) for snap, _ in snaps for s in snap.segments()}
    assert unique_bytes(*(s for s, _ in snaps)) == sum(
        s.nbytes for s in {id(s): s for snap, _ in snaps for s in snap.segments()}.values()
    )
    assert len(every) > cache.num_segments


def test_two_hundred_turns_stay_bounded() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    layout = SegmentedLayout(TINY)
    cache = layout.new()
    counts = []
    for turn in range(200):
        rows = rng.randint(1, 3000)
        cache.open_window(rows).write(0, *torch.randn(2, 1, rows, 2, generator=gen))
        cache.commit(range(turn * 3000, turn * 3000 + rows))
        cache.seal()
        counts.append(cache.num_segments)
    typical = statistics.median(counts)
    print(f"segments over 200 turns: median {typical}, max {max(counts)}, after 12 turns {counts[11]}")
    assert max(counts) <= SOFT_SEGMENTS < MAX_SEGMENTS
    assert layout.stats.max_segments == max(counts)
    assert 3 <= typical <= 5  # what the policy is for: a handful of segments, not one, not twelve
    assert layout.stats.seals == 200 and layout.stats.merges > 0


@settings(max_examples=150, deadline=None)
@given(
    turns=st.lists(st.integers(1, 5000), min_size=1, max_size=400),
    soft=st.integers(3, MAX_SEGMENTS - 1),
    anchor=st.integers(1, 2000),
    ratio=st.sampled_from([1, 1.5, 2, 4]),
)
def test_policy_bound_holds_over_hundreds_of_turns(turns, soft, anchor, ratio) -> None:
    policy = MergePolicy(soft_limit=soft, anchor_rows=anchor, ratio=ratio)
    sizes: list[int] = []
    for rows in turns:
        sizes.append(rows)
        anchored = sizes[0] if sizes[0] >= anchor and len(sizes) > 1 else None
        while (i := policy.next_merge(sizes)) is not None:
            assert 0 <= i < len(sizes) - 1
            assert not (i == 0 and anchored is not None)  # the anchor is never rewritten
            sizes[i : i + 2] = [sizes[i] + sizes[i + 1]]
        assert len(sizes) <= soft
        assert anchored is None or sizes[0] == anchored
    assert sum(sizes) == sum(turns)


def test_policy_cascades_and_falls_back_to_the_cheapest_pair() -> None:
    policy = MergePolicy(soft_limit=4, anchor_rows=1000, ratio=2)
    assert policy.next_merge([2000, 100, 60]) == 1  # 60 * 2 >= 100: merge the newest two
    assert policy.next_merge([2000, 100, 40]) is None  # sizes halve: stop
    assert policy.next_merge([2000, 100]) is None  # the anchor is never merged
    assert policy.next_merge([900, 500]) == 0  # a small first segment may be
    assert policy.next_merge([5000, 800, 300, 60, 20]) == 3  # over the limit: cheapest pair
    with pytest.raises(ValueError):
        MergePolicy(soft_limit=MAX_SEGMENTS)


def test_a_segment_held_by_many_snapshots_counts_once() -> None:
    _, cache, _ = history([64, 16])
    snaps = [cache.snapshot() for _ in range(5)] + [cache.snapshot().prefix(70)]
    per_row = SHAPE.bytes_per_row
    assert unique_bytes(*snaps) == 80 * per_row
    assert unique_bytes(cache, *snaps) == 80 * per_row  # the tail is released after the seal
    cache.presize(10)
    cache.open_window(1)
    assert unique_bytes(cache, *snaps) == (80 + cache.tail_capacity) * per_row


def test_trim_inside_tail_and_regrow() -> None:
    _, cache, rows = history([10])
    gen = torch.Generator().manual_seed(5)
    add_turn(cache, 12, gen)
    cache.trim(15)
    assert cache.num_segments == 1 and cache.tail_rows == 5 and cache.tokens == list(range(15))
    cache.trim(4)
    assert [r.n for r in cache.refs] == [4] and cache.tail_rows == 0
    more = add_turn(cache, 3, gen)
    got = torch.cat([k[0] for k, _ in cache.views()], dim=1)
    assert torch.equal(got, torch.cat([rows[0, :, :4], more[0]], dim=1))
    cache.trim(0)
    assert cache.views() == [] and cache.num_tokens == 0


def test_rows_keep_the_shape_dtype() -> None:
    shape = KVShape(2, 1, 4, torch.bfloat16, torch.device("cpu"))
    _, cache, _ = history([5, 3], shape=shape)
    for k, v in cache.views():
        assert k.dtype == v.dtype == torch.bfloat16
    with pytest.raises(ValueError):  # a segment of another dtype does not fit
        ConversationKV(SHAPE, cache.refs)


def test_contract_misuse_raises() -> None:
    cache = SegmentedLayout(SHAPE).new()
    k = torch.zeros(SHAPE.num_kv_heads, 2, SHAPE.head_dim)
    with pytest.raises(ValueError):
        cache.open_window(0)
    win = cache.open_window(2)
    with pytest.raises(ValueError):
        win.write(0, k[:, :1], k[:, :1])  # wrong row count
    win.write(0, k, k)
    with pytest.raises(ValueError):
        cache.commit([1, 2, 3])
    with pytest.raises(ValueError):
        cache.trim(1)
    with pytest.raises(ValueError):
        Segment(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), (1,))
    with pytest.raises(ValueError):
        SegmentRef(Segment(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), (1, 2)), 3)
    with pytest.raises(ValueError):
        make_layout("paged", SHAPE)
    assert make_layout("segmented", SHAPE).name == "segmented"


def test_snapshot_read_rows_across_segments() -> None:
    _, cache, rows = history([6, 5, 4])
    snap = cache.snapshot()
    k, v = snap.read_rows(3, 13)  # spans all three segments: a copy
    assert torch.equal(k, rows[:, :, 3:13]) and torch.equal(v, -rows[:, :, 3:13])
    inner, _ = snap.read_rows(0, 2)
    assert inner.data_ptr() == snap.refs[0].segment.k.data_ptr()  # inside one segment: a view
    one = SegmentedSnapshot.of(snap.refs[0].segment)
    assert one.num_tokens == snap.refs[0].n and one.prefix(0).num_tokens == 0

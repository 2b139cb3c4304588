"""The session bank over real segmented and contiguous caches (tiny shapes, no model).

Pins: longest-prefix lookup at token granularity (against brute force), zero-copy restore for
follow-up / fork / regenerate / edit, unique-bytes accounting, LRU eviction that never touches an
entry in use or a session's newest entry, refusals that evict nothing, namespace isolation, and
the contiguous layout's restore copy in the price.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnkv.bank.budget import auto_budget_bytes
from turnkv.bank.records import Reservation
from turnkv.bank.session_bank import Refused, SessionBank, TokenIndex
from turnkv.kv.cache import KVShape
from turnkv.kv.contiguous import ContiguousLayout
from turnkv.kv.segments import SegmentedLayout, segments_created, unique_bytes

SHAPE = KVShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
ROW = SHAPE.bytes_per_row  # 64 bytes


def _measure(held):
    return unique_bytes(*held)


def _bank(budget_rows: int = 10_000, layout: str = "segmented") -> SessionBank:
    return SessionBank(budget_rows * ROW, ROW, _measure, copy_on_restore=layout == "contiguous")


def _append(cache, tokens: list[int], seed: int = 0) -> None:
    """One turn of rows for ``tokens`` (random K/V), sealed as the engine does."""
    g = torch.Generator().manual_seed(seed)
    cache.presize(len(tokens))
    win = cache.open_window(len(tokens))
    for layer in range(SHAPE.num_layers):
        k = torch.randn(SHAPE.num_kv_heads, len(tokens), SHAPE.head_dim, generator=g)
        win.write(layer, k, -k)
    cache.commit(tokens)
    cache.seal()


def _conversation(layout, *turns: list[int]):
    cache = layout.new()
    for i, t in enumerate(turns):
        _append(cache, t, seed=i)
    return cache


# -- the index --------------------------------------------------------------------------------


def _brute(seqs: dict[int, tuple[int, ...]], q: tuple[int, ...]) -> int:
    best = 0
    for s in seqs.values():
        n = 0
        while n < min(len(s), len(q)) and s[n] == q[n]:
            n += 1
        best = max(best, n)
    return best


@settings(max_examples=150, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8),
    queries=st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=6),
    drop=st.sets(st.integers(0, 7)),
)
def test_index_longest_prefix_matches_brute_force(seqs, queries, drop):
    index = TokenIndex()
    live = {}
    for i, s in enumerate(seqs):
        index.insert(s, i)
        live[i] = tuple(s)
    for i in sorted(drop):
        if i in live:
            index.remove(live.pop(i), i)
    for q in queries:
        n, ids = index.longest(q)
        assert n == _brute(live, tuple(q))
        if n:
            assert ids and all(live[i][:n] == tuple(q[:n]) for i in ids)
            assert ids == {i for i, s in live.items() if s[:n] == tuple(q[:n])}
        whole = index.prefixes_of(q)
        assert whole == {i for i, s in live.items() if tuple(q[: len(s)]) == s}
    assert index.empty == (not live)


# -- restore without copies -------------------------------------------------------------------


def test_follow_up_fork_regenerate_and_edit_restore_without_copying():
    layout = SegmentedLayout(SHAPE)
    bank = _bank()
    t1, t2 = [1, 2, 3, 4, 5], [6, 7, 8, 9]
    cache = _conversation(layout, t1, t2)
    bank.insert("ns", cache.snapshot())
    banked = {s.id for s in cache.snapshot().segments()}
    before = segments_created()

    cases = {
        "follow-up": ([*t1, *t2, 10, 11], 9),
        "fork": ([*t1, *t2, 12], 9),
        "regenerate": ([*t1, *t2], 8),  # the last prompt row is always recomputed
        "edit turn 2": ([*t1, 6, 7, 99, 98], 7),  # cut inside segment 2: a ref to its first 2 rows
        "edit turn 1": ([1, 2, 50], 2),
    }
    for name, (prompt, cached) in cases.items():
        lease = bank.admit("ns", prompt, Reservation(4))
        assert lease.cached == cached, name
        assert lease.snapshot.tokens == tuple(prompt[:cached]), name
        assert {s.id for s in lease.snapshot.segments()} <= banked, name
        live = layout.restore(lease.snapshot)
        lease.attach(live)
        assert live.tokens == prompt[:cached]
        assert all(v[0].data_ptr() >= 0 for v in live.views())
        bank.finish(lease, None)
    assert segments_created() == before, "admission and restore must not build segments"
    assert bank.stats.hits == len(cases) and bank.stats.misses == 0


def test_restored_views_alias_the_banked_rows():
    layout = SegmentedLayout(SHAPE)
    bank = _bank()
    cache = _conversation(layout, [1, 2, 3], [4, 5, 6])
    bank.insert("ns", cache.snapshot())
    lease = bank.admit("ns", [1, 2, 3, 4, 9], Reservation(1))
    live = layout.restore(lease.snapshot)
    views = [(k[0], v[0]) for k, v in live.views()]
    banked = [(k[0], v[0]) for k, v in cache.views()]
    # the same segments (the merge policy may have joined the two turns), the last one cut short
    assert [k.data_ptr() for k, _ in views] == [k.data_ptr() for k, _ in banked]
    assert sum(k.shape[1] for k, _ in views) == 4
    assert torch.equal(torch.cat([k for k, _ in views], 1), torch.cat([k for k, _ in banked], 1)[:, :4])


def test_namespaces_are_isolated():
    layout = SegmentedLayout(SHAPE)
    bank = _bank()
    bank.insert("alice", _conversation(layout, [1, 2, 3, 4]).snapshot())
    assert bank.lookup("alice", [1, 2, 3, 4, 5])[0] == 4
    assert bank.lookup("bob", [1, 2, 3, 4, 5]) == (0, None)
    lease = bank.admit("bob", [1, 2, 3, 4, 5], Reservation(1))
    assert lease.cached == 0 and lease.snapshot is None
    assert bank.stats.misses == 1


# -- accounting and eviction ------------------------------------------------------------------


def test_shared_segments_count_once():
    layout = SegmentedLayout(SHAPE)
    bank = _bank()
    base = _conversation(layout, list(range(10)))
    a, b = base.fork(), base.fork()
    _append(a, [100, 101], seed=1)
    _append(b, [200, 201, 202], seed=2)
    bank.insert("ns", a.snapshot())
    bank.insert("ns", b.snapshot())
    assert len(bank) == 2
    assert bank.unique_bytes() == (10 + 2 + 3) * ROW


def test_superseded_prefix_entry_is_dropped():
    layout = SegmentedLayout(SHAPE)
    bank = _bank()
    cache = _conversation(layout, [1, 2, 3])
    bank.insert("ns", cache.snapshot())
    _append(cache, [4, 5], seed=1)
    bank.insert("ns", cache.snapshot())
    assert len(bank) == 1
    assert bank.lookup("ns", [1, 2, 3, 4, 5, 6])[0] == 5


def test_lru_eviction_spares_entries_in_use():
    layout = SegmentedLayout(SHAPE)
    bank = _bank(budget_rows=40)
    snaps = [_conversation(layout, [i * 100 + j for j in range(10)]).snapshot() for i in range(3)]
    for s in snaps:
        bank.insert("ns", s)
    assert len(bank) == 3
    old = bank.admit("ns", [*snaps[0].tokens, 7], Reservation(1))  # pins entry 0, now most recent
    # 3 x 10 rows banked; 12 more rows need the room of one entry: the LRU idle one is entry 1
    lease = bank.admit("ns", [999] * 11, Reservation(1))
    assert bank.stats.evictions == 1
    assert bank.lookup("ns", snaps[0].tokens)[0] == 10
    assert bank.lookup("ns", snaps[1].tokens)[0] == 0
    assert bank.lookup("ns", snaps[2].tokens)[0] == 10
    bank.finish(lease)
    bank.finish(old)


def test_a_shared_prefix_is_held_but_does_not_pin_the_rest_of_the_entry():
    layout = SegmentedLayout(SHAPE)
    bank = _bank(budget_rows=50)
    system = list(range(30))
    base = _conversation(layout, system)
    branch = base.fork()
    _append(branch, list(range(100, 110)), seed=1)  # 30 shared rows + 10 of its own (no merge)
    bank.insert("ns", branch.snapshot())
    # a new conversation sharing only the 30 system rows: 15 more rows need 5 freed
    lease = bank.admit("ns", [*system, *range(500, 505)], Reservation(10))
    assert lease.cached == 30 and not lease.pinned
    assert bank.stats.evictions == 1 and len(bank) == 0  # the branch went ...
    assert bank.unique_bytes(live=True) == 30 * ROW  # ... but the restored prefix is still held
    live = layout.restore(lease.snapshot)
    lease.attach(live)
    _append(live, [*range(500, 505)], seed=2)
    bank.finish(lease, live.snapshot())
    assert bank.lookup("ns", [*system, 500])[0] == 31


def test_refusal_evicts_nothing_and_a_small_turn_then_fits():
    layout = SegmentedLayout(SHAPE)
    bank = _bank(budget_rows=30)
    snaps = [_conversation(layout, [i * 100 + j for j in range(10)]).snapshot() for i in range(2)]
    for s in snaps:
        bank.insert("ns", s)
    with pytest.raises(Refused) as err:
        bank.admit("ns", list(range(500, 540)), Reservation(10))
    assert err.value.needed_bytes == 50 * ROW
    assert err.value.available_bytes == 30 * ROW  # every idle entry could go, and still too little
    assert len(bank) == 2 and bank.stats.evictions == 0 and bank.stats.refusals == 1
    lease = bank.admit("ns", [*snaps[1].tokens, 1, 2], Reservation(4))  # 6 rows: fits beside both
    assert lease.cached == 10 and bank.stats.evictions == 0
    bank.finish(lease)
    assert bank.lookup("ns", snaps[0].tokens)[0] == 10


def test_session_newest_entry_is_protected():
    layout = SegmentedLayout(SHAPE)
    bank = _bank(budget_rows=25)
    first = _conversation(layout, list(range(10))).snapshot()
    bank.insert("ns", first, session="s1")
    other = _conversation(layout, list(range(100, 110))).snapshot()
    bank.insert("ns", other)  # more recent than s1's entry, but not protected
    lease = bank.admit("ns", list(range(200, 209)), Reservation(1))  # needs 10 rows of 5 free
    assert bank.lookup("ns", first.tokens)[0] == 10
    assert bank.lookup("ns", other.tokens)[0] == 0
    bank.finish(lease)
    # a newer entry of the same session moves the protection; the old one becomes evictable
    newer = _conversation(layout, list(range(300, 305))).snapshot()
    bank.insert("ns", newer, session="s1")
    lease = bank.admit("ns", list(range(400, 414)), Reservation(1))
    assert bank.lookup("ns", first.tokens)[0] == 0
    assert bank.lookup("ns", newer.tokens)[0] == 5
    bank.finish(lease)


def test_finish_banks_the_turn_and_counts_the_live_cache():
    layout = SegmentedLayout(SHAPE)
    bank = _bank()
    cache = _conversation(layout, list(range(10)))
    bank.insert("ns", cache.snapshot())
    lease = bank.admit("ns", [*range(10), 10, 11], Reservation(3))
    live = layout.restore(lease.snapshot)
    lease.attach(live)
    live.presize(100)
    live.open_window(1)  # the tail is allocated for the planned rows and counted while live
    assert bank.unique_bytes(live=True) == (10 + 100) * ROW
    assert bank.unique_bytes(live=False) == 10 * ROW
    live.trim(10)
    _append(live, [10, 11, 12], seed=3)  # 3 rows after 10: no merge, one new segment
    assert bank.unique_bytes(live=True) == 13 * ROW
    eid = bank.finish(lease, live.snapshot())
    assert eid is not None and len(bank) == 1  # the 10-token entry is superseded
    assert bank.unique_bytes() == 13 * ROW
    assert bank.finish(lease, live.snapshot()) is None  # idempotent


# -- the contiguous baseline ------------------------------------------------------------------


def test_contiguous_restore_copy_is_priced_and_entries_do_not_share():
    seg, con = _bank(layout="segmented"), _bank(layout="contiguous")
    for bank, layout in ((seg, SegmentedLayout(SHAPE)), (con, ContiguousLayout(SHAPE))):
        base = _conversation(layout, list(range(20)))
        a, b = base.fork(), base.fork()
        _append(a, [50, 51], seed=1)
        _append(b, [60], seed=2)
        bank.insert("ns", a.snapshot())
        bank.insert("ns", b.snapshot())
    assert seg.unique_bytes() == (20 + 2 + 1) * ROW  # the forks share the 20 rows
    assert con.unique_bytes() == (22 + 21) * ROW  # every snapshot is its own copy
    prompt = [*range(20), 70, 71]
    a = seg.admit("ns", prompt, Reservation(5))
    b = con.admit("ns", prompt, Reservation(5))
    assert a.cached == b.cached == 20
    assert a.needed_bytes == (2 + 5) * ROW
    assert b.needed_bytes == (2 + 5 + 20) * ROW


def test_activation_bytes_are_priced():
    bank = _bank()
    lease = bank.admit("ns", [1, 2, 3], Reservation(2, activation=lambda rows, hist: 1000 * rows + hist))
    assert lease.needed_bytes == 5 * ROW + 3000


def test_auto_budget_is_a_share_of_available_ram():
    budget = auto_budget_bytes("cpu")
    assert 0 < budget < 1 << 50


def test_the_running_byte_count_equals_a_full_re_measure_through_turns_and_evictions():
    """Issue 9: unique bytes are kept per segment as entries come and go; the full re-measure
    (``check_integrity``) agrees after inserts, supersedes, forks, turns and evictions."""
    layout = SegmentedLayout(SHAPE)
    bank = _bank(budget_rows=250)  # four of the six 63-row conversations fit
    convs = []
    for c in range(6):
        base = [1, 2, 3, *range(100 * c, 100 * c + 60)]
        cache = _conversation(layout, base)
        bank.insert("ns", cache.snapshot())
        bank.check_integrity()
        convs.append((cache, base))
    for c, (_, base) in enumerate(convs):
        prompt = [*base, 900 + c, 901]
        lease = bank.admit("ns", prompt, Reservation(4))  # early ones were evicted: a miss
        live = layout.restore(lease.snapshot) if lease.snapshot is not None else layout.new()
        lease.attach(live)
        live.trim(lease.cached)
        _append(live, prompt[lease.cached :], seed=c)
        bank.check_integrity()
        assert bank.unique_bytes(live=True) == _measure(
            [e.snapshot for e in bank.entries()] + [x for x in (lease.snapshot, live) if x is not None]
        )
        bank.finish(lease, live.snapshot())
        bank.check_integrity()
    assert bank.stats.evictions > 0 and bank.unique_bytes(live=False) <= bank.budget_bytes

"""Both KV layouts against a plain oracle (a list of rows) under random operation sequences.

Each machine appends windows, seals (which triggers merges), trims, snapshots, forks and restores,
and after every step checks: the views concatenated equal the oracle; every snapshot taken earlier
is still bitwise what it was; every segment ever seen still holds the bytes it was built with;
``unique_bytes`` equals a count made independently over tensor storages; the segment bound holds.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from turnkv.kv import ContiguousLayout, ConversationKV, KVShape, SegmentedLayout, unique_bytes
from turnkv.kv.segments import MAX_SEGMENTS, MergePolicy, Segment, segments_created

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
MAX_SNAPSHOTS = 5
# A small policy so that short runs reach the anchor and the hard bound, not only the cascade.
SMALL_POLICY = MergePolicy(soft_limit=4, anchor_rows=20, ratio=2)
SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class Oracle:
    """The rows of a conversation as plain per-row tensors ``[L, Hkv, D]`` plus their ids."""

    def __init__(self, k: list[torch.Tensor] | None = None, v=None, tokens=None) -> None:
        self.k = list(k or [])
        self.v = list(v or [])
        self.tokens = list(tokens or [])

    def copy(self) -> Oracle:
        return Oracle(self.k, self.v, self.tokens)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[Hkv, n, D]`` of one layer."""
        if not self.k:
            empty = torch.empty(SHAPE.num_kv_heads, 0, SHAPE.head_dim)
            return empty, empty
        return torch.stack(self.k, dim=2)[layer], torch.stack(self.v, dim=2)[layer]


def cat_views(
    views: list[tuple[torch.Tensor, torch.Tensor]], layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of all-layer views ``[L, Hkv, T_i, D]``, concatenated: ``[Hkv, sum T_i, D]``."""
    if not views:
        empty = torch.empty(SHAPE.num_kv_heads, 0, SHAPE.head_dim)
        return empty, empty
    return torch.cat([k[layer] for k, _ in views], dim=1), torch.cat([v[layer] for _, v in views], dim=1)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (dedupe by storage address, not by segment)."""
    seen = {}
    for t in tensors:
        st_ = t.untyped_storage()
        seen[st_.data_ptr()] = st_.nbytes()
    return sum(seen.values())


class LayoutMachine(RuleBasedStateMachine):
    def make_layout(self):
        raise NotImplementedError

    @initialize(seed=st.integers(0, 2**31 - 1), turns=st.lists(st.integers(1, 30), max_size=8))
    def setup(self, seed: int, turns: list[int]) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.layout = self.make_layout()
        self.cache = self.layout.new()
        self.oracle = Oracle()
        self.snaps: list[tuple[object, Oracle]] = []  # (snapshot, what it held when taken)
        self.others: list[tuple[object, Oracle]] = []  # caches left behind by forks
        self.seen: dict[int, tuple[Segment, torch.Tensor, torch.Tensor]] = {}
        self.next_token = 0
        # A history of sealed turns first, so that short runs start with several segments.
        for rows in turns:
            self.append(rows, rows, plan=False)
            self.cache.seal()

    # -- operations ------------------------------------------------------------------------------
    @rule(m=st.integers(1, 30), keep=st.integers(0, 30), plan=st.booleans())
    def append(self, m: int, keep: int, plan: bool) -> None:
        keep = min(keep, m)
        if plan:
            self.cache.presize(m)
        win = self.cache.open_window(m)
        assert win.start == self.cache.num_tokens and win.rows == m
        ks = torch.randn(SHAPE.num_layers, SHAPE.num_kv_heads, m, SHAPE.head_dim, generator=self.gen)
        vs = torch.randn(ks.shape, generator=self.gen)
        for layer in range(SHAPE.num_layers):
            win.write(layer, ks[layer], vs[layer])
            got_k, got_v = cat_views(list(win.views), layer)
            want_k, want_v = self.oracle.layer(layer)
            assert torch.equal(got_k, torch.cat([want_k, ks[layer]], dim=1))
            assert torch.equal(got_v, torch.cat([want_v, vs[layer]], dim=1))
        tokens = list(range(self.next_token, self.next_token + keep))
        self.next_token += keep
        self.cache.commit(tokens)
        for i in range(keep):
            self.oracle.k.append(ks[:, :, i])
            self.oracle.v.append(vs[:, :, i])
        self.oracle.tokens.extend(tokens)

    @rule()
    def seal(self) -> None:
        self.cache.seal()

    @rule(frac=st.floats(0, 1))
    def trim(self, frac: float) -> None:
        n = int(frac * self.cache.num_tokens)
        before = segments_created()
        self.cache.trim(n)
        assert segments_created() == before  # a rollback never builds a segment
        del self.oracle.k[n:], self.oracle.v[n:], self.oracle.tokens[n:]

    @rule()
    def snapshot(self) -> None:
        snap = self.cache.snapshot()
        self.snaps = [*self.snaps, (snap, self.oracle.copy())][-MAX_SNAPSHOTS:]

    @rule()
    def fork(self) -> None:
        child = self.cache.fork()
        self.others = [*self.others, (self.cache, self.oracle.copy())][-2:]
        self.cache = child

    @precondition(lambda self: bool(self.snaps))
    @rule(pick=st.integers(0, MAX_SNAPSHOTS - 1), frac=st.floats(0, 1))
    def restore(self, pick: int, frac: float) -> None:
        snap, held = self.snaps[pick % len(self.snaps)]
        n = int(frac * snap.num_tokens)
        before = segments_created()
        self.cache = self.layout.restore(snap.prefix(n))
        assert segments_created() == before  # restore and prefix build no segment
        self.oracle = Oracle(held.k[:n], held.v[:n], held.tokens[:n])

    # -- invariants ------------------------------------------------------------------------------
    def _check_cache(self, cache, oracle: Oracle) -> None:
        assert cache.num_tokens == len(oracle.tokens)
        assert cache.tokens == oracle.tokens
        for layer in range(SHAPE.num_layers):
            got_k, got_v = cat_views(cache.views(), layer)
            want_k, want_v = oracle.layer(layer)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)

    @invariant()
    def live_caches_match_their_oracles(self) -> None:
        self._check_cache(self.cache, self.oracle)
        for cache, oracle in self.others:
            self._check_cache(cache, oracle)

    @invariant()
    def snapshots_never_change(self) -> None:
        for snap, held in self.snaps:
            assert snap.num_tokens == len(held.tokens)
            assert list(snap.tokens) == held.tokens
            if snap.num_tokens:
                k, v = snap.read_rows(0, snap.num_tokens)  # [L, Hkv, n, D]
                assert torch.equal(k, torch.stack(held.k, dim=2))
                assert torch.equal(v, torch.stack(held.v, dim=2))

    @invariant()
    def sealed_segments_are_never_written(self) -> None:
        holders = [self.cache, *(c for c, _ in self.others), *(s for s, _ in self.snaps)]
        for holder in holders:
            for seg in holder.segments():
                if seg.id not in self.seen:
                    self.seen[seg.id] = (seg, seg.k.clone(), seg.v.clone())
        for seg, k, v in self.seen.values():
            assert torch.equal(seg.k, k) and torch.equal(seg.v, v)

    @invariant()
    def unique_bytes_is_exact(self) -> None:
        caches = [self.cache, *(c for c, _ in self.others)]
        snaps = [s for s, _ in self.snaps]
        tensors = []
        for holder in caches + snaps:
            for seg in holder.segments():
                tensors += [seg.k, seg.v]
        row = SHAPE.num_layers * SHAPE.num_kv_heads * SHAPE.head_dim * 4 * 2  # k and v, fp32
        private = sum(self._buffer_rows(c) for c in caches) * row
        assert unique_bytes(*caches, *snaps) == storage_bytes(tensors) + private

    def _buffer_rows(self, cache) -> int:
        return cache.tail_capacity

    def teardown(self) -> None:
        # Visible with --hypothesis-show-statistics: how much of the space the runs reached.
        stats = self.layout.stats
        event(f"seals: {min(stats.seals, 5)}{'+' if stats.seals >= 5 else ''}")
        event(f"merged: {stats.merges > 0}")
        event(f"max segments: {stats.max_segments}")
        event(f"snapshots held: {len(self.snaps)}")


class SegmentedMachine(LayoutMachine):
    def make_layout(self):
        return SegmentedLayout(SHAPE, SMALL_POLICY)

    @invariant()
    def segment_count_is_bounded(self) -> None:
        for cache in [self.cache, *(c for c, _ in self.others)]:
            assert isinstance(cache, ConversationKV)
            assert cache.num_segments <= SMALL_POLICY.soft_limit
            assert len(cache.views()) + 1 <= MAX_SEGMENTS  # a window adds the tail's view
        assert self.layout.stats.max_segments <= SMALL_POLICY.soft_limit


class ContiguousMachine(LayoutMachine):
    def make_layout(self):
        return ContiguousLayout(SHAPE)

    def _buffer_rows(self, cache) -> int:
        return cache.capacity

    @invariant()
    def one_view(self) -> None:
        assert len(self.cache.views()) == (1 if self.cache.num_tokens else 0)


SegmentedMachine.TestCase.settings = SETTINGS
ContiguousMachine.TestCase.settings = SETTINGS
TestSegmented = SegmentedMachine.TestCase
TestContiguous = ContiguousMachine.TestCase

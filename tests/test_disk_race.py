"""The disk tier's eviction racing its restores: a block evicted while it is restored is a clean miss.

The writer thread evicts for the byte budget (``--disk-bytes``) while admissions restore blocks
from the same store. A restore pins the keys it looks up, so the evictor takes other blocks (the
store may stay over its budget until the pin ends); a block that goes all the same (its file
removed under the server, here: the pin disabled) ends the run as a miss counted in
``disk.vanished``. Neither is ever ``corrupt``, and a turn restored meanwhile answers as one
computed from scratch.

Oracles: the interleaving that the H200 hit (an eviction landing exactly between a restore's
lookup and its read) is forced by an event handshake inside ``store.get``; the stress test runs
restores of overlapping prefixes on several threads against a writer that evicts after every
write, for a bounded number of rounds, and checks every restored row against the rows written.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import torch
from disk_helpers import GIB, first_logits, prompt, synthetic, tiny_engine, turn

from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.session_bank import SessionBank
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef, unique_bytes

SHAPE = KVShape(2, 1, 8, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def _evict_between_lookup_and_read(tier: DiskTier, churn: SegmentedSnapshot) -> threading.Event:
    """Make the next restore's reads wait until ``churn`` is written and the writer has evicted
    for it: the first read writes it and waits for the queue to drain; every read of that restore
    starts only after. Returns an event set once that happened."""
    get, done, mu = tier.store.get, threading.Event(), threading.Lock()

    def hooked(key, *a, **kw):
        with mu:  # the first reader of the restore churns; the others wait for it
            if not done.is_set():
                tier.write_behind("churn", churn)
                assert tier.flush(30)
                done.set()
        return get(key, *a, **kw)

    tier.store.get = hooked
    return done


@pytest.mark.parametrize("pinned", [True, False])
def test_an_eviction_between_lookup_and_read_is_never_corrupt(engine, tmp_path, monkeypatch, pinned):
    """Pinned (the tier as it is): the evictor skips the blocks being restored and the whole run
    loads. Unpinned (what an out-of-process deletion looks like): the run ends at the first block
    gone, counted in ``vanished``. Both answer as recomputed; neither counts ``corrupt``."""
    tier = DiskTier.open(tmp_path, engine.info.fingerprint, engine.shape, GIB)
    row = engine.shape.bytes_per_row
    writer = SessionBank(GIB, row, lambda held: unique_bytes(*held), tier=tier)
    history = prompt(800)
    turn(engine, writer, "ns", history, max_tokens=1)
    assert tier.flush(30)
    [entry] = writer.entries()
    assert tier.store.count == 3  # 801 rows: 3 whole blocks
    tier.budget_bytes = tier.store.nbytes  # room for exactly these 3 blocks
    if not pinned:
        monkeypatch.setattr(tier.store, "pinned", lambda keys: contextlib.nullcontext())
    follow = [*entry.tokens, *prompt(20, seed=1)]
    want, _ = first_logits(engine, None, "ns", follow)
    churn = synthetic(engine.shape, prompt(2 * B, seed=7))  # 2 newer blocks: 2 evictions
    done = _evict_between_lookup_and_read(tier, churn)

    fresh = SessionBank(GIB, row, lambda held: unique_bytes(*held), tier=tier)  # memory holds nothing
    got, cached = first_logits(engine, fresh, "ns", follow)

    assert done.is_set()
    h = tier.health()
    assert h["evictions"] == 2 and h["corrupt"] == 0 and h["faults"] == 0
    if pinned:  # the evictor took the churn blocks instead: over budget only while pinned
        assert (cached, h["vanished"], h["hits"]) == (3 * B, 0, 1)
    else:  # the two deepest went first: the head block loads, the rest is recomputed
        assert (cached, h["vanished"], h["hits"]) == (B, 1, 1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(), want.argmax())
    tier.close()


def _rows(tokens: list[int]) -> SegmentedSnapshot:
    """Rows that are a function of (position, token id) only, so any conversation sharing a
    prefix writes identical bytes for it (blocks are keyed by that prefix)."""
    s = SHAPE
    pos = torch.arange(len(tokens), dtype=torch.float32)
    ids = torch.tensor(tokens, dtype=torch.float32)
    base = (ids * 1e-3 + pos)[None, None, :, None]  # [1, 1, rows, 1]
    k = base + torch.arange(s.num_layers * s.head_dim, dtype=torch.float32).reshape(s.num_layers, 1, 1, -1)
    k = k.expand(s.num_layers, s.num_kv_heads, len(tokens), s.head_dim).contiguous()
    seg = Segment(k, -k, tuple(tokens))
    return SegmentedSnapshot([SegmentRef(seg, seg.num_rows)])


def test_restores_racing_a_constantly_evicting_writer_read_only_right_rows(tmp_path):
    """Three threads restore overlapping prefixes (a shared 2-block system prompt, then each
    conversation's own blocks) while a fourth keeps writing conversations into a budget of 4
    blocks, so the writer evicts after nearly every write. Every restored row is the row written,
    nothing is corrupt or vanished (the pins make the race impossible), and the run is bounded."""
    tier = DiskTier.open(tmp_path, "fp", SHAPE, GIB)
    system = list(range(2 * B))
    convs = [system + [10_000 + c] * B + [20_000 + c] * (B * (c % 2)) for c in range(6)]
    want = {c: _rows(t) for c, t in enumerate(convs)}
    tier.write_behind("ns", want[0])
    assert tier.flush(30)
    tier.budget_bytes = 4 * (tier.store.nbytes // tier.store.count)
    stop, errors, restored = threading.Event(), [], []
    deadline = time.monotonic() + 60

    def churn() -> None:
        rng = random.Random(1)
        while not stop.is_set() and time.monotonic() < deadline:
            tier.write_behind("ns", want[rng.randrange(len(convs))])
            tier.flush(10)

    def restore(seed: int) -> None:
        rng = random.Random(seed)
        try:
            rounds = 0  # at least 40, and on until the writer has evicted a few times
            while (rounds < 40 or tier.stats.evictions < 8) and time.monotonic() < deadline:
                rounds += 1
                c = rng.randrange(len(convs))
                snap = tier.extend("ns", convs[c], None)
                if snap is None:
                    continue
                n = snap.num_tokens
                assert n % B == 0 and 0 < n <= len(convs[c])
                for got, exp in zip(snap.read_rows(0, n), want[c].read_rows(0, n), strict=True):
                    assert torch.equal(got, exp), (c, n)
                restored.append(n)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    writer = threading.Thread(target=churn, daemon=True)
    readers = [threading.Thread(target=restore, args=(s,), daemon=True) for s in range(3)]
    writer.start()
    for t in readers:
        t.start()
    for t in readers:
        t.join(90)
    stop.set()
    writer.join(30)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in (writer, *readers))
    h = tier.health()
    assert h["corrupt"] == 0 and h["vanished"] == 0 and h["faults"] == 0
    assert restored and h["hits"] == len(restored)
    assert h["evictions"] >= 8 and h["writes"] > tier.store.count  # the writer evicted all along
    tier.close()

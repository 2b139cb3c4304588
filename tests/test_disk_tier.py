"""The disk tier behind the bank: restore, dedupe, isolation, faults, the write queue, the budgets.

Oracles: rows loaded from disk are bit-identical to the rows that were banked; a turn that
restored from disk gets the logits (within one rounding of the segmented merge) and the greedy
tokens of a turn computed from scratch; counters say exactly what happened.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
from disk_helpers import GIB, bank_over, first_logits, prompt, synthetic, tiny_engine, turn

from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.records import Reservation
from turnkv.bank.session_bank import Refused, SessionBank
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef, unique_bytes

SHAPE = KVShape(2, 1, 8, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def test_restore_after_restart_equals_recompute(engine, tmp_path):
    history = prompt(700)
    a = bank_over(engine, tmp_path)
    turn(engine, a, "ns", history)
    [entry] = a.entries()
    a.tier.close()
    follow = [*entry.tokens, *prompt(40, seed=1)]  # what the client sends next
    b = bank_over(engine, tmp_path)  # a new process: an empty bank over the same directory
    got, cached = first_logits(engine, b, "ns", follow)
    want, _ = first_logits(engine, None, "ns", follow)
    assert cached == (len(entry.tokens) // B) * B == 512
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(), want.argmax())
    h = b.tier.health()
    assert (h["hits"], h["hit_tokens"], h["corrupt"]) == (1, 512, 0)
    out = turn(engine, b, "ns", follow)[0]
    c = SessionBank(GIB, engine.shape.bytes_per_row, lambda held: unique_bytes(*held))
    assert out == turn(engine, c, "ns", follow)[0]  # greedy tokens as without any cache
    b.tier.close()


def test_loaded_rows_are_the_banked_rows_bit_for_bit(engine, tmp_path):
    a = bank_over(engine, tmp_path)
    turn(engine, a, "ns", prompt(600))
    [entry] = a.entries()
    a.tier.close()
    b = bank_over(engine, tmp_path)
    lease = b.admit("ns", list(entry.tokens), Reservation(1))
    assert lease.cached == 512
    for got, want in zip(lease.snapshot.read_rows(0, 512), entry.snapshot.read_rows(0, 512), strict=True):
        assert torch.equal(got, want)
    assert len(lease.snapshot.segments()) == 1  # one sealed segment for the whole run
    b.finish(lease, None)
    b.tier.close()


def test_a_short_memory_hit_is_extended_from_disk(engine, tmp_path):
    long = prompt(1100)
    a = bank_over(engine, tmp_path)
    turn(engine, a, "ns", long, max_tokens=1)  # 4 whole blocks on disk
    a.tier.close()
    memory_only = SessionBank(GIB, engine.shape.bytes_per_row, lambda h: unique_bytes(*h))
    turn(engine, memory_only, "ns", long[:300], max_tokens=1)
    [short] = memory_only.entries()
    b = bank_over(engine, tmp_path)
    b.insert("ns", short.snapshot)  # memory holds 300 rows, the disk 1024
    lease = b.admit("ns", long, Reservation(1))
    assert lease.cached == 4 * B  # memory's 300 rows cut to 256, then blocks 1-3 from disk
    first = lease.snapshot.refs[0]
    assert first.segment is short.snapshot.refs[0].segment and first.n == B  # memory rows: no copy
    assert b.tier.health()["hit_tokens"] == 3 * B
    b.finish(lease, None)
    b.tier.close()


def test_dedupe_across_conversations(tmp_path):
    tier = DiskTier.open(tmp_path, "fp", SHAPE, GIB)
    system = list(range(2 * B))
    for c in range(5):
        tokens = system + [1000 + c] * B + [7]
        tier.write_behind("ns", synthetic(SHAPE, tokens, seed=0, cuts=(2 * B,)))
        tier.flush()
    one = tier.store.nbytes // tier.store.count
    h = tier.health()
    assert (h["blocks"], h["writes"], h["dedupe_hits"]) == (2 + 5, 7, 8)
    assert h["bytes"] == 7 * one  # the shared 512-token prefix is on disk once, not five times
    tier.close()


def test_namespaces_never_share_or_read_each_others_blocks(engine, tmp_path):
    tokens = prompt(600)
    a = bank_over(engine, tmp_path)
    turn(engine, a, "tenant-a", tokens)
    a.tier.flush()
    written = a.tier.store.count
    a.tier.close()
    b = bank_over(engine, tmp_path)
    assert first_logits(engine, b, "tenant-b", tokens)[1] == 0
    assert b.tier.health()["misses"] == 1 and b.tier.health()["hits"] == 0
    turn(engine, b, "tenant-b", tokens)
    b.tier.flush()
    assert b.tier.store.count == 2 * written and b.tier.health()["dedupe_hits"] == 0
    b.tier.close()


@pytest.mark.parametrize("other", ["dtype", "model"])
def test_another_dtype_or_model_never_reads_these_blocks(engine, tmp_path, other):
    tokens = prompt(600)
    a = bank_over(engine, tmp_path)
    turn(engine, a, "ns", tokens)
    a.tier.close()
    if other == "dtype":
        them = tiny_engine("bfloat16")
    else:
        them = tiny_engine()
        them.info = dataclasses.replace(them.info, fingerprint="another-model")
    b = bank_over(them, tmp_path)
    assert first_logits(them, b, "ns", tokens)[1] == 0
    h = b.tier.health()
    assert (h["hits"], h["misses"], h["corrupt"]) == (0, 1, 0)  # not even found, let alone read
    b.tier.close()


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _foreign(path):
    from safetensors.torch import save

    path.write_bytes(save({"weight": torch.zeros(3)}))


def _unlink(path):
    path.unlink()


@pytest.mark.parametrize(
    ("damage", "counter"),
    [(_flip, "corrupt"), (_truncate, "corrupt"), (_foreign, "corrupt"), (_unlink, "vanished")],
)
def test_a_bad_block_is_a_miss_removed_and_counted(engine, tmp_path, damage, counter):
    """Bad bytes are ``corrupt``; a file removed under the server is ``vanished`` (nothing is bad)."""
    tokens = prompt(900)
    a = bank_over(engine, tmp_path)
    turn(engine, a, "ns", tokens)
    a.tier.close()
    b = bank_over(engine, tmp_path)
    keys = [i.key for i in sorted(b.tier.store.iterate(), key=lambda i: i.depth)]
    assert len(keys) == 3
    damage(b.tier.store.path(keys[1]))
    got, cached = first_logits(engine, b, "ns", tokens)
    assert cached == B  # block 0 only: the run ends before the bad block
    want, _ = first_logits(engine, None, "ns", tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    h = b.tier.health()
    assert (h["corrupt"], h["vanished"]) == ((1, 0) if counter == "corrupt" else (0, 1))
    assert not b.tier.store.has(keys[1]) and not b.tier.store.path(keys[1]).exists()
    b.tier.close()


def test_write_failures_are_counted_logged_once_and_serving_goes_on(engine, tmp_path, monkeypatch, caplog):
    bank = bank_over(engine, tmp_path)

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bank.tier.store, "put_many", full)
    with caplog.at_level(logging.WARNING, logger="turnkv.bank.disk"):
        for seed in range(2):
            turn(engine, bank, "ns", prompt(800, seed=seed))
        bank.tier.flush()
    h = bank.tier.health()
    assert (h["write_failures"], h["writes"], h["blocks"]) == (6, 0, 0)
    assert len([r for r in caplog.records if "write failed" in r.message]) == 1
    assert turn(engine, bank, "ns", prompt(800, seed=0))[2] == 799  # the memory bank still serves
    bank.tier.close()


def test_a_full_queue_drops_and_counts_and_never_blocks(tmp_path, monkeypatch):
    tier = DiskTier.open(tmp_path, "fp", SHAPE, GIB, queue_blocks=2)
    gate = threading.Event()
    put = tier.store.put_many
    monkeypatch.setattr(tier.store, "put_many", lambda *a, **kw: gate.wait(30) and put(*a, **kw))
    snap = synthetic(SHAPE, list(range(5 * B)))
    tier.write_behind("ns", snap)  # returns although the writer is stuck on the disk
    h = tier.health()
    assert (h["queued"], h["dropped_writes"]) == (2, 3)
    assert tier.held() == [snap]  # the bank counts what the queue keeps alive
    gate.set()
    assert tier.flush(30)
    assert tier.health()["writes"] == 2 and tier.held() == []
    assert {i.depth for i in tier.store.iterate()} == {0, 1}  # the chain's head was kept
    tier.close()


def test_dropped_writes_are_logged_at_most_once_a_minute_with_their_count(tmp_path, monkeypatch, caplog):
    tier = DiskTier.open(tmp_path, "fp", SHAPE, GIB, queue_blocks=1)
    gate = threading.Event()
    put = tier.store.put_many
    monkeypatch.setattr(tier.store, "put_many", lambda *a, **kw: gate.wait(30) and put(*a, **kw))
    now = [1000.0]
    monkeypatch.setattr(tier._every, "clock", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="turnkv.bank.disk"):
        for c in range(4):  # 2 blocks each into a queue of 1: 1, 2, 2, then 2 dropped
            now[0] += 61 if c == 3 else 1
            tier.write_behind("ns", synthetic(SHAPE, [c * 10_000 + t for t in range(2 * B)]))
    lines = [r.getMessage() for r in caplog.records if "write queue full" in r.getMessage()]
    assert len(lines) == 2 and ": 1 block write(s) dropped" in lines[0]  # the first at once
    assert ": 6 block write(s) dropped" in lines[1]  # a minute later, everything since the first line
    assert tier.health()["dropped_writes"] == 7
    gate.set()
    assert tier.flush(30)
    tier.close()


def test_queued_writes_count_as_used_bank_memory(tmp_path, monkeypatch):
    tier = DiskTier.open(tmp_path, "fp", SHAPE, GIB)
    gate = threading.Event()
    monkeypatch.setattr(tier.store, "put_many", lambda *a, **kw: gate.wait(30))
    bank = SessionBank(GIB, SHAPE.bytes_per_row, lambda h: unique_bytes(*h), tier=tier)
    snap = synthetic(SHAPE, list(range(2 * B)))
    tier.write_behind("ns", snap)
    assert len(bank) == 0 and bank.unique_bytes(live=True) == unique_bytes(snap)
    gate.set()
    tier.flush(30)
    assert bank.unique_bytes(live=True) == 0
    tier.close()


def test_admission_prices_the_loaded_rows(engine, tmp_path):
    tokens = prompt(600)
    a = bank_over(engine, tmp_path)
    turn(engine, a, "ns", tokens, max_tokens=1)
    a.tier.close()
    row = engine.shape.bytes_per_row
    tier = DiskTier.open(tmp_path, engine.info.fingerprint, engine.shape, GIB)
    # 600 rows do not fit 300 rows of budget, whether they are loaded or computed
    for t in (tier, None):
        with pytest.raises(Refused) as err:
            SessionBank(300 * row, row, lambda h: unique_bytes(*h), tier=t).admit(
                "ns", tokens, Reservation(1)
            )
    assert err.value.needed_bytes == (len(tokens) + 1) * row  # without the tier: all rows new
    small = SessionBank(300 * row, row, lambda h: unique_bytes(*h), tier=tier)
    with pytest.raises(Refused) as err:
        small.admit("ns", tokens, Reservation(1))
    assert (err.value.needed_bytes, err.value.available_bytes) == ((len(tokens) - 512 + 1) * row, 0)
    roomy = SessionBank(700 * row, row, lambda h: unique_bytes(*h), tier=tier)
    lease = roomy.admit("ns", tokens, Reservation(1))
    assert lease.cached == 512 and roomy.unique_bytes(live=True) == 512 * row
    roomy.finish(lease, None)
    tier.close()


def test_the_disk_budget_evicts_least_recently_used_blocks(tmp_path):
    one = DiskTier.open(tmp_path, "fp", SHAPE, GIB)
    one.write_behind("ns", synthetic(SHAPE, list(range(B))))
    one.flush()
    size = one.store.nbytes
    one.store.evict(0)
    one.close()
    tier = DiskTier.open(tmp_path, "fp", SHAPE, 3 * size)
    for c in range(3):  # 3 conversations of 2 blocks each into room for 3 blocks
        tier.write_behind("ns", synthetic(SHAPE, [c * 10_000 + t for t in range(2 * B)]))
        tier.flush()
    h = tier.health()
    assert (h["bytes"], h["blocks"], h["evictions"]) == (3 * size, 3, 3)
    depths = sorted(i.depth for i in tier.store.iterate())
    assert depths == [0, 0, 1]  # the newest conversation whole, the older one's head
    tier.close()


def test_the_contiguous_layout_restores_from_disk_too(engine, tmp_path):
    from dataclasses import replace

    from turnkv.engine.engine import Engine

    contiguous = Engine(engine.loaded, replace(engine.cfg, kv_layout="contiguous"))
    tokens = prompt(600)
    a = bank_over(contiguous, tmp_path)
    turn(contiguous, a, "ns", tokens)
    a.tier.close()
    b = bank_over(contiguous, tmp_path)
    got, cached = first_logits(contiguous, b, "ns", [*tokens, 3])
    want, _ = first_logits(contiguous, None, "ns", [*tokens, 3])
    assert cached == 512
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    b.tier.close()


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))],
)
def test_under_tensor_parallelism_queued_rows_leave_the_snapshot_at_once(tmp_path, monkeypatch, device):
    """With ``agree`` set (one tier per rank), a queued write copies its rows to host memory when
    it is queued -- on CUDA on a stream of its own, after the kernels that made the rows -- so the
    bank counts nothing for it, and the blocks written are the snapshot's rows bit for bit."""
    shape = dataclasses.replace(SHAPE, device=torch.device(device))
    tier = DiskTier.open(tmp_path, "fp", shape, GIB, agree=lambda n: n)
    gate = threading.Event()
    put = tier.store.put_many
    monkeypatch.setattr(tier.store, "put_many", lambda *a, **kw: gate.wait(30) and put(*a, **kw))
    tokens = list(range(3 * B + 5))
    ref = synthetic(dataclasses.replace(shape, device=torch.device("cpu")), tokens, seed=3, cuts=(B + 7,))
    want = [ref.read_rows(d * B, (d + 1) * B) for d in range(3)]  # block 1 spans both segments
    refs = []
    for r in ref.refs:
        k, v = (t.to(device) for t in (r.segment.k, r.segment.v))
        if device == "cuda":  # rows still being made when the write is queued
            spin = torch.randn(2048, 2048, device=device)
            for _ in range(30):
                spin = torch.tanh(spin @ spin)
            k = k + 0 * spin[0, 0]
        refs.append(SegmentRef(Segment(k, v, r.segment.tokens), r.n))
    tier.write_behind("ns", SegmentedSnapshot(refs))
    assert tier.held() == []  # nothing for the bank to count
    gate.set()
    assert tier.flush(30)
    blocks = {info.depth: tier.store.get(info.key) for info in tier.store.iterate()}
    assert sorted(blocks) == [0, 1, 2]
    for d, (k, v) in enumerate(want):
        assert torch.equal(blocks[d].k, k) and torch.equal(blocks[d].v, v), d
    tier.close()

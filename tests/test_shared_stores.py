"""Block stores that replicas share (``dir:PATH`` and Redis) under the disk tier's fault tests.

Oracles as in test_disk_tier: a turn restored through another process's store instance gets the
logits of a recompute; a bad block (flipped bit, truncated, foreign bytes) is a miss that ends the
run, is removed and counted ``corrupt``; a missing one ends the run as a plain miss; the byte budget evicts
least recently used blocks, a chain's end first; concurrent writers of one key leave one whole
block and no temp file; a Redis that does not answer leaves the bank serving, degraded on health.
"""

from __future__ import annotations

import threading

import pytest
import torch
from disk_helpers import GIB, first_logits, prompt, synthetic, tiny_engine, turn
from redis_helpers import free_port, redis_server

from turnkv.bank import shared_stores
from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.session_bank import SessionBank
from turnkv.bank.shared_stores import RedisStore, SharedDirStore, open_store
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import unique_bytes

SHAPE = KVShape(2, 1, 8, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(params=["dir", "redis"])
def spec(request, tmp_path):
    """A fresh store's ``--disk-store`` spec (each Redis test on a database flushed first)."""
    if request.param == "dir":
        return f"dir:{tmp_path / 'shared'}"
    url = request.getfixturevalue("redis_url")
    store = open_store(url)
    store._redis.flushdb()
    store.close()
    return url


def bank(engine, spec: str, budget: int = GIB) -> SessionBank:
    """A bank over a store instance of its own: what one replica process holds."""
    tier = DiskTier.open(open_store(spec), engine.info.fingerprint, engine.shape, budget)
    return SessionBank(GIB, engine.shape.bytes_per_row, lambda held: unique_bytes(*held), tier=tier)


def rewrite(store, key: str, change) -> None:
    """Replace block ``key``'s stored bytes by ``change(bytes)`` (None: remove the block's bytes)."""
    if isinstance(store, SharedDirStore):
        path = store.path(key)
        data = change(path.read_bytes())
        path.unlink() if data is None else path.write_bytes(data)
    else:
        raw = store._block + key
        data = change(store._redis.get(raw))
        store._redis.delete(raw) if data is None else store._redis.set(raw, data)


def _flip(data: bytes) -> bytes:
    i = len(data) - 1000
    return data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :]


def _foreign(data: bytes) -> bytes:
    from safetensors.torch import save

    return save({"weight": torch.zeros(3)})


DAMAGE = [(_flip, "corrupt"), (lambda d: d[:-100], "corrupt"), (_foreign, "corrupt"), (lambda d: None, None)]


def test_another_process_restores_what_one_wrote(engine, spec):
    """Two banks over two instances of one store at once (two replicas): B restores A's turn."""
    a, b = bank(engine, spec), bank(engine, spec)
    turn(engine, a, "ns", prompt(700))
    a.tier.flush()
    [entry] = a.entries()
    follow = [*entry.tokens, *prompt(40, seed=1)]
    got, cached = first_logits(engine, b, "ns", follow)
    want, _ = first_logits(engine, None, "ns", follow)
    assert cached == 512
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert b.tier.health()["hit_tokens"] == 512 and b.tier.health()["degraded"] is None
    a.tier.close()
    b.tier.close()


@pytest.mark.parametrize(("damage", "counter"), DAMAGE, ids=["flip", "truncate", "foreign", "missing"])
def test_a_bad_block_is_a_miss_removed_and_counted(engine, spec, damage, counter):
    tokens = prompt(900)
    a = bank(engine, spec)
    turn(engine, a, "ns", tokens)
    a.tier.close()
    b = bank(engine, spec)
    store = b.tier.store
    keys = [i.key for i in sorted(store.iterate(), key=lambda i: i.depth)]
    assert len(keys) == 3
    rewrite(store, keys[1], damage)
    got, cached = first_logits(engine, b, "ns", tokens)
    assert cached == B  # block 0 only: the run ends before the bad block
    want, _ = first_logits(engine, None, "ns", tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    h = b.tier.health()
    # a block whose bytes are gone is no longer listed: a plain miss, nothing bad
    assert (h["corrupt"], h["vanished"]) == ((1, 0) if counter == "corrupt" else (0, 0))
    assert not store.has(keys[1]) and keys[1] not in {i.key for i in store.iterate()}
    b.tier.close()


def test_the_budget_evicts_least_recently_used_blocks_a_chain_end_first(spec):
    one = DiskTier.open(open_store(spec), "fp", SHAPE, GIB)
    one.write_behind("ns", synthetic(SHAPE, list(range(B))))
    one.flush()
    size = one.store.nbytes
    one.store.evict(0)
    assert one.store.nbytes == 0 and one.store.count == 0
    one.close()
    tier = DiskTier.open(open_store(spec), "fp", SHAPE, 3 * size)
    for c in range(3):  # 3 conversations of 2 blocks each into room for 3 blocks
        tier.write_behind("ns", synthetic(SHAPE, [c * 10_000 + t for t in range(2 * B)]))
        tier.flush()
    h = tier.health()
    assert (h["bytes"], h["blocks"], h["evictions"]) == (3 * size, 3, 3)
    assert sorted(i.depth for i in tier.store.iterate()) == [0, 0, 1]
    tier.close()


def test_concurrent_writers_of_one_block_leave_one_whole_block(spec):
    """Replicas writing the same prefix at once: one verified block, no temp file, sizes agree."""
    stores = [open_store(spec) for _ in range(4)]
    tier = DiskTier.open(stores[0], "fp", SHAPE, GIB)
    snap = synthetic(SHAPE, list(range(2 * B)))
    tier.write_behind("ns", snap)
    tier.flush()
    blocks = [stores[0].get(i.key) for i in stores[0].iterate()]
    for b in blocks:
        stores[0].delete(b.key)
    threads = [threading.Thread(target=lambda s=s: [s.put(b) for b in blocks]) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = open_store(spec)
    assert {i.key for i in fresh.iterate()} == {b.key for b in blocks}
    assert all(torch.equal(fresh.get(b.key).k, b.k) for b in blocks)
    if isinstance(fresh, SharedDirStore):
        assert not list(fresh.blocks.glob("*/.*.tmp"))
    assert fresh.count == 2 and fresh.nbytes == sum(i.nbytes for i in fresh.iterate())
    tier.close()


def test_redis_unreachable_keeps_serving_and_says_so(engine, monkeypatch):
    """No Redis at the address: the tier opens degraded, turns are served (the bank's own hits),
    health names the store."""
    monkeypatch.setattr(shared_stores, "RETRY_S", 0.0)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    store = RedisStore(url, timeout_s=0.2)
    tier = DiskTier.open(store, engine.info.fingerprint, engine.shape, GIB)
    b = SessionBank(GIB, engine.shape.bytes_per_row, lambda held: unique_bytes(*held), tier=tier)
    tokens = prompt(600)
    turn(engine, b, "ns", tokens)
    [entry] = b.entries()
    assert turn(engine, b, "ns", list(entry.tokens))[2] == len(entry.tokens) - 1  # the bank serves
    h = tier.health()
    assert "unreachable" in h["degraded"] and str(port) in h["degraded"] and h["faults"] >= 1
    assert h["writes"] == 0
    tier.close()


def test_a_batch_of_blocks_is_written_whole_in_one_put_many(spec):
    """Five blocks in one writer batch (on Redis one pipelined round trip, each block its own
    script): every block is stored once and restores to the rows written."""
    tier = DiskTier.open(open_store(spec), "fp", SHAPE, GIB, batch_blocks=8)
    ids = list(range(5 * B))
    snap = synthetic(SHAPE, ids, seed=3)
    tier.write_behind("ns", snap)
    assert tier.flush(30)
    h = tier.health()
    assert (h["writes"], h["blocks"], h["write_failures"], h["dropped_writes"]) == (5, 5, 0, 0)
    got = tier.extend("ns", [*ids, 1], None)
    assert got is not None and got.num_tokens == 5 * B
    assert all(
        torch.equal(a, b) for a, b in zip(got.read_rows(0, 5 * B), snap.read_rows(0, 5 * B), strict=True)
    )
    tier.close()


@pytest.mark.parametrize("bad", [None, 0, 5, 10])
def test_parallel_reads_restore_the_written_bits_and_stop_at_a_corrupt_block(spec, bad):
    """Four readers, a read-ahead window of 8 and 11 blocks: the restore is the written rows bit
    for bit, or ends exactly before the damaged block (counted, removed) while reads of later
    blocks are still in flight; it never returns a row of the bad block or after it."""
    shape = KVShape(3, 2, 16, torch.bfloat16, torch.device("cpu"))
    ids = prompt(11 * B + 7)
    snap = synthetic(shape, ids, seed=bad or 0)
    writer = DiskTier.open(open_store(spec), "fp", shape, GIB)
    writer.write_behind("ns", snap)
    assert writer.flush(30)
    keys = [i.key for i in sorted(writer.store.iterate(), key=lambda i: i.depth)]
    writer.close()
    reader = DiskTier.open(open_store(spec), "fp", shape, GIB, load_threads=4)
    if bad is not None:
        rewrite(reader.store, keys[bad], _flip)
    got = reader.extend("ns", ids, None)
    rows = 11 * B if bad is None else bad * B
    assert (got.num_tokens if got is not None else 0) == rows
    if rows:
        want = snap.refs[0].segment
        (ref,) = got.refs
        assert torch.equal(ref.segment.k.view(torch.int16), want.k[:, :, :rows].view(torch.int16))
        assert torch.equal(ref.segment.v.view(torch.int16), want.v[:, :, :rows].view(torch.int16))
    assert reader.stats.corrupt == (bad is not None)
    assert (bad is None) or not reader.store.has(keys[bad])
    reader.close()

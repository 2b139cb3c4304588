"""The writer's batches: durable together, then visible together; a crash inside one loses nothing durable.

Pins: ``put_many`` commits its rows in one transaction only after every file of the batch is
written, fsynced and renamed (the fsyncs come before the first row); a crash between the files and
the commit leaves files without rows, which reconcile adopts when they verify and removes when
they do not; a torn batch (some files renamed, one a temp file, one never begun) keeps every block
committed before it and every renamed file, and removes the temp file; the tier writes several
blocks per batch on several threads and every block reads back bit for bit; each file's
writeback starts as soon as its bytes are in, and what was written stays in the page cache (a
restore on this host next reads it from memory, not from the disk).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest
import torch
from test_disk_store import KEYS, SHAPE, chain_block, files

import turnkv.bank.disk_files as disk_files
from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS, encode_block
from turnkv.bank.disk_store import LocalDirStore
from turnkv.bank.shared_stores import SharedDirStore
from turnkv.kv.cache import KVShape

STORES = {"local": LocalDirStore, "shared": SharedDirStore}


def test_a_batch_is_fsynced_before_its_rows_are_committed_in_one_transaction(tmp_path, monkeypatch):
    store = LocalDirStore(tmp_path / "kv")
    events: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(disk_files.os, "fsync", lambda fd: (events.append("fsync"), fsync(fd))[1])
    sql = []
    store._db.set_trace_callback(sql.append)
    assert all(n > 0 for n in store.put_many([chain_block(d) for d in range(4)]))
    statements = [s.split()[0] for s in sql]
    # one transaction; which blocks are stored is known in memory (``has`` asks no SQL)
    assert statements == ["BEGIN"] + ["INSERT"] * 4 + ["COMMIT"]
    assert events.count("fsync") >= 4 + 1  # every file and its directory
    assert store.count == 4 and all(store.get(k).k.eq(d).all() for d, k in enumerate(KEYS[:4]))
    store.close()


def test_a_crash_between_the_files_and_the_commit_is_adopted_at_start(tmp_path, monkeypatch):
    store = LocalDirStore(tmp_path / "kv")
    store.put(chain_block(0))
    real = store._db

    class CrashAtCommit:  # the process dies as the batch's transaction commits
        def execute(self, q, *a):
            if q == "COMMIT":
                raise SystemExit("killed")
            return real.execute(q, *a)

    store._db = CrashAtCommit()
    try:
        store.put_many([chain_block(d) for d in (1, 2, 3)])
    except SystemExit:
        pass
    store._db = real
    store.close()
    assert len(files(store)) == 4  # the batch's files are durable, its rows never committed
    again = LocalDirStore(tmp_path / "kv")
    assert not again.has(KEYS[1])  # rolled back: not visible before reconcile
    assert again.reconcile()["adopted"] == 3
    assert all(again.get(KEYS[d]).k.eq(d).all() for d in range(4))
    again.close()


def test_a_torn_batch_keeps_what_was_durable_and_removes_the_rest(tmp_path):
    store = LocalDirStore(tmp_path / "kv")
    store.put_many([chain_block(0), chain_block(1)])  # an earlier batch: durable and committed
    store.close()
    # what a kill -9 in the middle of the next batch leaves: blocks 2 and 3 renamed (not yet
    # committed), block 4 still a temp file, block 5 not begun, and a renamed file whose bytes are bad
    for d in (2, 3):
        path = store.path(KEYS[d])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_block(chain_block(d)))
    tmp = store.path(KEYS[4]).parent
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / f".{KEYS[4]}.123.0.tmp").write_bytes(encode_block(chain_block(4))[:1000])
    bad = store.path(KEYS[5])
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(encode_block(chain_block(5))[:-7])
    again = LocalDirStore(tmp_path / "kv")
    fixed = again.reconcile()
    assert (fixed["adopted"], fixed["temp_files"], fixed["orphan_files"]) == (2, 1, 1)
    assert [again.has(k) for k in KEYS] == [True] * 4 + [False] * 2
    assert all(again.get(KEYS[d]).k.eq(d).all() for d in range(4))
    again.close()


def test_several_writers_write_batches_and_every_block_reads_back(tmp_path):
    tier = DiskTier.open(tmp_path, "fp", SHAPE, 1 << 30, writers=3, batch_blocks=4)
    dims = (SHAPE.num_layers, SHAPE.num_kv_heads, BLOCK_TOKENS, SHAPE.head_dim)
    want = {}
    for c in range(6):
        tokens = tuple(range(c * 10_000, c * 10_000 + 5 * BLOCK_TOKENS))
        rows = {d: (torch.full(dims, c * 10.0 + d), torch.full(dims, -c * 10.0 - d)) for d in range(5)}
        tier.write_host(f"c{c}", tokens, rows)
        want[c] = (tokens, rows)
    assert tier.flush(60)
    h = tier.health()
    assert (h["writes"], h["write_failures"], h["dropped_writes"], h["queued"]) == (30, 0, 0, 0)
    for c, (tokens, rows) in want.items():
        got = tier.extend(f"c{c}", [*tokens, 1], None)
        assert got is not None and got.num_tokens == 5 * BLOCK_TOKENS
        for d, (k, v) in rows.items():
            gk, gv = got.read_rows(d * BLOCK_TOKENS, (d + 1) * BLOCK_TOKENS)
            assert torch.equal(gk, k) and torch.equal(gv, v)
    tier.close()


@pytest.mark.parametrize("kind", sorted(STORES))
def test_each_file_s_writeback_starts_before_the_fsyncs_and_no_page_is_dropped(tmp_path, monkeypatch, kind):
    store = STORES[kind](tmp_path / "kv")
    events: list[str] = []
    real_advise, real_fsync = getattr(os, "posix_fadvise", None), os.fsync
    real_writeback = disk_files._sync_file_range()

    def advise(fd: int, offset: int, n: int, advice: int) -> None:  # DONTNEED was how it started
        events.append(f"advise {advice}")
        real_advise(fd, offset, n, advice)

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    def writeback(fd: int, offset: int, n: int, flags: int) -> int:
        events.append(f"writeback {offset} {n} {flags}")
        return real_writeback(fd, offset, n, flags)

    if real_advise is not None:
        monkeypatch.setattr(disk_files.os, "posix_fadvise", advise)
    monkeypatch.setattr(disk_files.os, "fsync", fsync)
    if real_writeback is not None:
        monkeypatch.setattr(disk_files, "_sync_file_range", lambda: writeback)
    assert all(n > 0 for n in store.put_many([chain_block(d) for d in range(3)]))
    assert f"advise {getattr(os, 'POSIX_FADV_DONTNEED', -1)}" not in events, events
    if real_writeback is not None:  # Linux: each whole file's writeback, all before the first fsync
        assert events[: events.index("fsync")] == ["writeback 0 0 2"] * 3, events
    assert all(store.get(KEYS[d]).k.eq(d).all() for d in range(3))
    store.close()


def _resident(path: os.PathLike) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` of a mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    c = ctypes
    libc.mmap.restype = c.c_void_p
    libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
    libc.munmap.argtypes = [c.c_void_p, c.c_size_t]
    libc.mincore.argtypes = [c.c_void_p, c.c_size_t, c.c_char_p]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore of a file mapping: Linux")
def test_blocks_just_written_are_still_in_the_page_cache(tmp_path):
    # 16 MiB blocks: with DONTNEED, pages written back while the batch was written were dropped
    # (on the 2-core VM from 0 to 100 % of each file, 60 % of 32 MiB blocks on average)
    shape = KVShape(16, 8, 128, torch.bfloat16, torch.device("cpu"))
    tier = DiskTier.open(SharedDirStore(tmp_path / "kv"), "fp", shape, 1 << 30, batch_blocks=4)
    dims = (shape.num_layers, shape.num_kv_heads, BLOCK_TOKENS, shape.head_dim)
    g = torch.Generator().manual_seed(0)
    bits = [torch.randint(-(2**15), 2**15, dims, dtype=torch.int16, generator=g) for _ in range(8)]
    rows = {d: (bits[2 * d].view(torch.bfloat16), bits[2 * d + 1].view(torch.bfloat16)) for d in range(4)}
    tier.write_host("ns", tuple(range(4 * BLOCK_TOKENS)), rows)
    assert tier.flush(60) and tier.health()["writes"] == 4
    paths = [tier.store.path(info.key) for info in tier.store.iterate()]
    assert len(paths) == 4
    shares = [_resident(p) for p in paths]
    assert min(shares) > 0.95, shares  # a reclaim under memory pressure may take a few pages
    tier.close()

"""The local-directory block store: the BlockStore contract, durability order, reconcile, LRU, lock.

Pins: put/get/has/delete/iterate agree with one another and with the byte and block counts; a
failed write (injected at write, fsync or rename) leaves no row, no block file and no temp file;
reconcile removes temp files, adopts a file without a row that verifies (a crash between the rename
and the row) and removes one that does not, and drops rows without files (or of the wrong size);
eviction frees least recently used blocks and, among one chain's, the deepest first, never a
pinned one; a block deleted after its lookup (row or file) is ``BlockGone``, not bad; one process
per directory; the directories a write needs are made again when they were deleted, and an entry
of the wrong kind where a block or its directory goes is replaced and counted.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import turnkv.bank.disk_store as disk_store
from turnkv.bank.disk_blocks import BLOCK_TOKENS, ROOT_KEY, Block, BlockError, block_context, block_keys
from turnkv.bank.disk_store import BlockGone, LocalDirStore, StoreBusy
from turnkv.kv.cache import KVShape

SHAPE = KVShape(2, 1, 4, torch.float32, torch.device("cpu"))
CTX = block_context("fp", SHAPE)
TOKENS = list(range(6 * BLOCK_TOKENS))
KEYS = block_keys(CTX, "ns", TOKENS)


def chain_block(depth: int) -> Block:
    k = torch.full((2, 1, BLOCK_TOKENS, 4), float(depth))
    parent = KEYS[depth - 1] if depth else ROOT_KEY
    tokens = tuple(TOKENS[depth * BLOCK_TOKENS : (depth + 1) * BLOCK_TOKENS])
    return Block(KEYS[depth], parent, CTX, depth, tokens, k, -k)


@pytest.fixture
def store(tmp_path):
    s = LocalDirStore(tmp_path / "kv")
    yield s
    s.close()


def files(store: LocalDirStore) -> list[str]:
    return sorted(p.name for p in store.blocks.rglob("*") if p.is_file())


def test_put_get_has_delete_iterate(store):
    b = chain_block(0)
    assert not store.has(b.key) and store.count == 0
    size = store.put(b)
    assert size > b.nbytes and store.has(b.key)
    assert store.put(b) == 0  # already there: nothing written
    got = store.get(b.key)
    assert torch.equal(got.k, b.k) and torch.equal(got.v, b.v) and got.tokens == b.tokens
    [info] = list(store.iterate())
    assert (info.key, info.parent, info.depth, info.nbytes) == (b.key, ROOT_KEY, 0, size)
    assert (store.count, store.nbytes) == (1, size) and store.path(b.key).stat().st_size == size
    store.delete(b.key)
    store.delete(b.key)  # absent: a no-op
    assert not store.has(b.key) and files(store) == [] and (store.count, store.nbytes) == (0, 0)
    with pytest.raises(BlockGone, match="no longer in the index"):
        store.get(b.key)


def test_a_row_whose_file_is_missing_is_gone_not_a_crash(store):
    b = chain_block(0)
    store.put(b)
    store.path(b.key).unlink()
    with pytest.raises(BlockGone, match="deleted before it was read"):
        store.get(b.key)


def test_a_block_deleted_during_its_read_is_gone_not_bad(store, monkeypatch):
    """The row goes first, then the file (``delete``): a read that lost the race is a miss."""
    import turnkv.bank.disk_store as ds

    b = chain_block(0)
    store.put(b)
    decode = ds.decode_block

    def deleted_first(path, *a, **kw):  # the evictor's whole delete lands between has() and open
        store.delete(b.key)
        return decode(path, *a, **kw)

    monkeypatch.setattr(ds, "decode_block", deleted_first)
    with pytest.raises(BlockGone):
        store.get(b.key)


def test_a_bad_file_with_its_row_is_bad_not_gone(store):
    b = chain_block(0)
    store.put(b)
    store.path(b.key).write_bytes(b"not a block")
    with pytest.raises(BlockError) as err:
        store.get(b.key)
    assert not isinstance(err.value, BlockGone)


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_a_failed_write_leaves_nothing_behind(store, monkeypatch, where):
    def fail(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "write":
        monkeypatch.setattr("turnkv.bank.disk_store.write_block", _full_disk_write)
    else:
        monkeypatch.setattr(f"turnkv.bank.disk_store.os.{where}", fail)
    with pytest.raises(OSError):
        store.put(chain_block(0))
    monkeypatch.undo()
    assert not store.has(KEYS[0]) and files(store) == [] and store.count == 0
    store.put(chain_block(0))  # and the store still works
    assert store.has(KEYS[0])


def _full_disk_write(block, path) -> None:
    """A block write that fails half way, as on a full disk: part of the temp file is there."""
    with open(path, "wb") as f:
        f.write(b"half a blo")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_reconcile_removes_orphans_and_temp_files_and_drops_rows_without_files(tmp_path):
    s = LocalDirStore(tmp_path / "kv")
    for d in range(4):
        s.put(chain_block(d))
    orphan = s.path("ab" * 32)  # a file whose index row never made it (a crash before the row)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(s.path(KEYS[0]).read_bytes())
    temp = s.path(KEYS[0]).parent / f".{KEYS[0]}.123.0.tmp"  # a crash mid-write
    temp.write_bytes(b"half a blo")
    s.path(KEYS[1]).unlink()  # a row whose file is gone
    with open(s.path(KEYS[2]), "ab") as f:  # a file of the wrong size
        f.write(b"x")
    s.delete(KEYS[3])
    s.put(chain_block(4))
    s._db.execute("DELETE FROM blocks WHERE key = ?", (KEYS[4],))  # a crash between rename and row
    s.close()
    s = LocalDirStore(tmp_path / "kv")
    assert s.count == 3  # rows are not trusted until reconciled
    fixed = s.reconcile()
    assert fixed == {
        "temp_files": 1,
        "orphan_files": 1,
        "missing_files": 1,
        "bad_size": 1,
        "adopted": 1,
        "bad_entries": 0,
    }
    assert {i.key for i in s.iterate()} == {KEYS[0], KEYS[4]}
    assert files(s) == sorted(k + ".safetensors" for k in (KEYS[0], KEYS[4]))
    assert s.count == 2 and s.nbytes == sum(s.path(k).stat().st_size for k in (KEYS[0], KEYS[4]))
    assert torch.equal(s.get(KEYS[4]).k, chain_block(4).k)  # the adopted block reads back
    assert s.reconcile() == dict.fromkeys(fixed, 0)
    s.close()


def test_eviction_is_lru_and_keeps_the_head_of_a_chain(store):
    for d in range(4):
        store.put(chain_block(d), at=100.0)  # one turn's chain: used at the same moment
    size = store.nbytes // 4
    assert store.evict(store.nbytes) == 0
    assert store.evict(3 * size) == 1
    assert {i.key for i in store.iterate()} == set(KEYS[:3])  # the deepest went first
    store.touch([KEYS[2]], at=200.0)
    assert store.evict(size) == 2
    assert {i.key for i in store.iterate()} == {KEYS[2]}  # the recently used one stayed
    assert store.count == 1 and store.nbytes == size and len(files(store)) == 1


def test_eviction_skips_pinned_blocks_until_the_pin_ends(store):
    for d in range(3):
        store.put(chain_block(d), at=100.0 + d)
    size = store.nbytes // 3
    with store.pinned(KEYS[:2]), store.pinned([KEYS[0], KEYS[5]]):  # pins nest; absent keys too
        assert store.evict(0) == 1  # only the unpinned block goes: over budget meanwhile
        assert {i.key for i in store.iterate()} == set(KEYS[:2])
    with store.pinned([KEYS[0]]):
        assert store.evict(size) == 1
    assert {i.key for i in store.iterate()} == {KEYS[0]}
    assert store.evict(0) == 1 and store.count == 0


def test_lookups_never_wait_behind_the_index_and_evictions_unlink_outside_it(store, monkeypatch):
    """The engine thread asks ``has``/``run_length`` at every turn's end and admission: with the
    directory's lock this process is its one writer, so they answer from memory while another
    thread holds the index (a writer's transaction), and agree with the index afterwards."""
    for d in range(3):
        store.put(chain_block(d), at=100.0 + d)
    held, answered = threading.Event(), []

    def writer_holding_the_index():
        with store._mu:
            held.set()
            ok = threading.Event()
            answered.append(ok)
            ok.wait(10)  # until the lookups below are answered

    t = threading.Thread(target=writer_holding_the_index)
    t.start()
    held.wait(10)
    assert [store.has(k) for k in KEYS[:4]] == [True, True, True, False]
    assert store.run_length(KEYS) == 3
    answered[0].set()
    t.join()
    unlinked_under_lock = []
    real = disk_store.remove
    monkeypatch.setattr(
        disk_store,
        "remove",
        lambda p: (unlinked_under_lock.append(store._mu._is_owned()), real(p))[1],
    )
    assert store.evict(0) == 3
    assert unlinked_under_lock == [False] * 3  # the files went after the rows, outside the lock
    assert not any(store.has(k) for k in KEYS) and store.count == 0 and files(store) == []
    other = LocalDirStore(store.root, lock=False)  # a reader beside the owner asks the index
    assert other.run_length(KEYS) == 0
    other.close()


def test_one_process_per_directory(tmp_path):
    a = LocalDirStore(tmp_path / "kv")
    with pytest.raises(StoreBusy, match="--disk-dir"):
        LocalDirStore(tmp_path / "kv")
    a.close()
    LocalDirStore(tmp_path / "kv").close()


def test_an_index_of_another_schema_is_rebuilt_from_the_blocks(tmp_path):
    s = LocalDirStore(tmp_path / "kv")
    s.put(chain_block(0))
    s._db.execute("PRAGMA user_version=99")
    s.close()
    s = LocalDirStore(tmp_path / "kv")
    assert s.count == 1 and s.rebuilt is not None and "version 99" in s.rebuilt.reason
    assert s.has(KEYS[0]) and not any(s.reconcile().values())
    s.close()


def test_deleting_the_blocks_directory_at_run_time_fails_no_later_write(store):
    import shutil

    store.put(chain_block(0))
    shutil.rmtree(store.blocks)
    assert store.put(chain_block(1)) > 0  # the directories are made again
    assert torch.equal(store.get(KEYS[1]).k, chain_block(1).k)
    with pytest.raises(BlockGone):  # a miss, not a bad block
        store.get(KEYS[0])  # its file went with the directory: a miss
    store.delete(KEYS[0])
    assert store.put(chain_block(0)) > 0 and store.get(KEYS[0]).depth == 0


def test_a_directory_at_a_block_path_is_replaced_and_counted(store):
    target = store.path(KEYS[0])
    (target / "inside").mkdir(parents=True)  # a directory where the block's file goes
    assert store.put(chain_block(0)) > 0 and target.is_file()
    assert store.bad_entries == 1 and torch.equal(store.get(KEYS[0]).k, chain_block(0).k)


def test_a_file_where_a_block_directory_goes_is_replaced_and_counted(store):
    (store.blocks / KEYS[1][:2]).write_bytes(b"a file where a block directory goes")
    assert store.put(chain_block(1)) > 0 and store.bad_entries == 1
    assert store.get(KEYS[1]).key == KEYS[1]


def test_reconcile_removes_and_counts_entries_of_the_wrong_kind(store):
    store.put(chain_block(0))
    target = store.path(KEYS[0])
    target.unlink()
    (target / "inside").mkdir(parents=True)  # a directory at an indexed block's path
    stray = store.path(KEYS[3])
    stray.parent.mkdir(exist_ok=True)
    (stray / "deep").mkdir(parents=True)  # and at a path without a row
    (store.blocks / "zz").write_bytes(b"not a directory")
    fixed = store.reconcile()
    assert (fixed["bad_entries"], fixed["missing_files"]) == (3, 1)
    assert list(store.blocks.rglob("*")) == [p for p in store.blocks.rglob("*") if p.is_dir()]
    assert store.count == 0 and store.put(chain_block(0)) > 0 and store.has(KEYS[0])


def test_a_block_directory_that_is_not_a_directory_is_a_missing_block(store):
    b = chain_block(0)
    store.put(b)
    sub = store.path(b.key).parent
    for f in sub.iterdir():
        f.unlink()
    sub.rmdir()
    sub.write_bytes(b"not a directory")
    with pytest.raises(BlockError):
        store.get(b.key)
    store.delete(b.key)
    assert not store.has(b.key)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_block_directory_is_a_missing_block(store):
    b = chain_block(0)
    store.put(b)
    store.path(b.key).parent.chmod(0)
    try:
        with pytest.raises(BlockError):
            store.get(b.key)
        store.delete(b.key)  # the row goes even if the file cannot
        assert not store.has(b.key)
    finally:
        store.path(b.key).parent.chmod(0o755)

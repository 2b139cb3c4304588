"""Block files of format version 1 (SHA-256 checksums) in a store that version 2 opens.

Pins: the keys cover the format version, so a version-1 block is never looked up; in every store
(a local directory with its index, a shared directory, Redis) it is no corruption: the tier opens
over it without a fault, a ``corrupt`` count or a warning, the least-recently-used eviction takes
it before the version-2 block, and the version-2 block restores. A rebuild of a lost index
removes version-1 files and counts them apart from the files that fail verification.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from redis_helpers import redis_server
from test_disk_blocks import SHAPE, TOKENS, _block, _same, _version_1

from turnkv.bank import disk_blocks, disk_store, shared_stores
from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS, Block, block_context, block_keys, decode_bytes, encode_block
from turnkv.bank.disk_store import LocalDirStore


def _pair(monkeypatch) -> tuple[Block, Block]:
    """(a version-2 block, the version-1 block of the same rows: another context, another key)."""
    block = _block()
    with monkeypatch.context() as m:
        m.setattr(disk_blocks, "FORMAT_VERSION", 1)
        v1_context = block_context("fp", SHAPE)
    v1_key = block_keys(v1_context, "ns", TOKENS, 1)[0]
    assert v1_key != block.key
    return block, dataclasses.replace(block, key=v1_key, context=v1_context)


@pytest.fixture(params=["local", "dir", "redis"])
def store_at(request, tmp_path):
    """A function that opens the same store again, of each kind."""
    if request.param == "redis":
        with redis_server() as url:
            yield request.param, lambda: shared_stores.RedisStore(url, prefix="t:")
        return
    cls = LocalDirStore if request.param == "local" else shared_stores.SharedDirStore
    yield request.param, lambda: cls(tmp_path / "kv")


def _put_as_version_1(monkeypatch, kind: str, store, old: Block) -> None:
    """``store.put(old)`` as turnkv before format 2 did it: the store's own put, its bytes v1's."""
    with monkeypatch.context() as m:
        if kind == "redis":
            m.setattr(shared_stores, "encode_block", _version_1)
        else:
            module = disk_store if kind == "local" else shared_stores
            m.setattr(module, "write_block", lambda b, path: Path(path).write_bytes(_version_1(b)))
        assert store.put(old, at=1000.0) > 0  # used long ago: before the upgrade


def test_a_version_1_block_is_no_corruption_and_the_lru_evicts_it_first(store_at, monkeypatch, caplog):
    kind, open_store = store_at
    block, old = _pair(monkeypatch)
    store = open_store()
    _put_as_version_1(monkeypatch, kind, store, old)
    size = store.put(block)
    assert store.count == 2 and store.nbytes > size
    store.close()
    caplog.set_level(logging.WARNING)
    tier = DiskTier.open(open_store(), "fp", SHAPE, budget_bytes=size)  # a restarted server, v2
    try:
        s = tier.stats
        assert (s.corrupt, s.faults, s.vanished, s.evictions) == (0, 0, 0, 1), s
        assert not tier.store.has(old.key) and tier.store.has(block.key)
        seg = tier.extend("ns", TOKENS[:BLOCK_TOKENS], None)
        assert seg is not None and seg.num_tokens == BLOCK_TOKENS
        assert torch.equal(seg.refs[0].segment.k, block.k) and tier.stats.corrupt == 0
        warnings = [r.getMessage() for r in caplog.records if r.name.startswith("turnkv")]
        assert warnings == [], warnings
    finally:
        tier.close()
        tier.store.close()


def test_a_version_1_block_read_by_its_key_is_refused_as_another_version(monkeypatch):
    """Only a scan meets a v1 file; read by its key it is refused, never taken for a v2 block."""
    _, old = _pair(monkeypatch)
    with pytest.raises(disk_blocks.OtherVersion, match="format version 1, not 2"):
        decode_bytes(_version_1(old), old.key)
    assert _same(decode_bytes(encode_block(_block()), _block().key), _block())


def test_a_rebuild_counts_version_1_files_apart_from_damaged_ones(tmp_path, monkeypatch, caplog):
    block, old = _pair(monkeypatch)
    store = LocalDirStore(tmp_path / "kv")
    _put_as_version_1(monkeypatch, "local", store, old)
    store.put(block)
    bad = _block(seed=1, depth=1)
    store.put(bad)
    path = store.path(bad.key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one bit of its payload
    path.write_bytes(bytes(data))
    store.close()
    (tmp_path / "kv" / "index.sqlite").unlink()  # lost: the next start rebuilds from the files
    caplog.set_level(logging.INFO, logger="turnkv.bank.disk_index")
    store = LocalDirStore(tmp_path / "kv")
    r = store.rebuilt
    assert (r.kept, r.dropped, r.other_version) == (1, 1, 1), r
    assert [i.key for i in store.iterate()] == [block.key] and not store.path(old.key).exists()
    [line] = [x.getMessage() for x in caplog.records if x.name == "turnkv.bank.disk_index"]
    assert "1 kept, 1 dropped (failed verification), 1 of another format version" in line, line
    store.close()

"""``bench/shared_restore.py`` reads the disk tier's real ``/health.disk`` fields: its durability
wait says durable exactly when a writer's blocks are in the shared store, and its restore time
agrees with the reader's own counters. Real tiers over one ``SharedDirStore`` directory, each
with a store instance of its own (what two processes hold)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from disk_helpers import GIB, prompt, synthetic

from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.shared_stores import SharedDirStore
from turnkv.kv.cache import KVShape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import shared_restore as bench

SHAPE = KVShape(4, 2, 64, torch.float32, torch.device("cpu"))  # 1 MiB of rows per block


def tier(root: Path) -> DiskTier:
    return DiskTier.open(SharedDirStore(root), "fp", SHAPE, GIB)


def test_durable_after_the_writes_and_restore_time_matches_the_reader(tmp_path):
    writer, reader = tier(tmp_path), tier(tmp_path)
    tokens = prompt(3 * B + 10)
    before = writer.health()
    assert not bench.durable(before, before, 3)
    writer.write_behind("ns", synthetic(SHAPE, tokens))
    assert writer.flush(30)
    after = writer.health()
    assert bench.durable(before, after, 3) and bench.lost(before, after) == 0
    assert not bench.durable(before, after, 4)  # only 3 whole blocks were written
    again = writer.health()
    writer.write_behind("ns", synthetic(SHAPE, tokens))  # already stored: settled as dedupe hits
    assert writer.flush(30) and bench.durable(again, writer.health(), 3)

    r0 = reader.health()
    assert reader.extend("ns", tokens, None).num_tokens == 3 * B
    r1 = reader.health()
    rows, seconds = bench.restore_time(r0, r1, after["bytes"] / after["blocks"])
    assert rows == 3 * B
    assert seconds == pytest.approx(reader.stats.restore_s, rel=0.05)  # the file's header: < 1 %
    writer.close()
    reader.close()

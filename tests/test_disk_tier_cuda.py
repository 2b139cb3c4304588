"""The disk tier's restore on CUDA: blocks read into the pinned ring (``disk_staging``), verified
there and copied to the device while later blocks are read, each tensor one 2-D copy into its
rows (run by hand on a GPU; skipped elsewhere). The restore's logic is tested on CPU tensors in tests/test_disk_tier.py."""

from __future__ import annotations

import pytest
import torch
from disk_helpers import GIB, prompt
from test_ram_tier_cuda import _device_rows

from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.shared_stores import SharedDirStore
from turnkv.kv.cache import KVShape

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPE = KVShape(4, 2, 64, torch.bfloat16, torch.device("cuda"))
BLOCKS = 11  # more than the ring's slots (2 x load_threads = 4): every slot is reused


def _tiers(root):
    writer = DiskTier.open(SharedDirStore(root), "fp", SHAPE, GIB)
    reader = DiskTier.open(SharedDirStore(root), "fp", SHAPE, GIB, load_threads=2)
    return writer, reader


@cuda
def test_a_restore_through_the_ring_is_the_written_rows_bit_for_bit_in_one_allocation(tmp_path):
    writer, reader = _tiers(tmp_path)
    assert reader._staging.slots == 4 and reader._staging.k.is_pinned()
    ids = prompt(BLOCKS * B + 5)
    snap = _device_rows(ids, seed=3)
    writer.write_behind("ns", snap)
    assert writer.flush(60)
    for _ in range(2):  # the second restore reuses slots whose last copies were the first's
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
        got = reader.extend("ns", ids, None)
        assert got is not None and got.num_tokens == BLOCKS * B
        (ref,) = got.refs
        want = snap.refs[0].segment
        torch.cuda.synchronize()
        # the segment's k and v, nothing per block (copy_ into a block's strided rows allocated
        # a device temporary for each tensor)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - allocated == 2
        assert torch.equal(ref.segment.k.view(torch.int16), want.k[:, :, : BLOCKS * B].view(torch.int16))
        assert torch.equal(ref.segment.v.view(torch.int16), want.v[:, :, : BLOCKS * B].view(torch.int16))
    assert reader.stats.corrupt == 0 and reader.stats.hits == 2
    writer.close()
    reader.close()


@cuda
def test_a_corrupt_block_ends_the_run_and_the_rows_before_it_are_exact(tmp_path):
    writer, reader = _tiers(tmp_path)
    ids = prompt(BLOCKS * B + 5)
    snap = _device_rows(ids, seed=4)
    writer.write_behind("ns", snap)
    assert writer.flush(60)
    keys = [i.key for i in sorted(reader.store.iterate(), key=lambda i: i.depth)]
    path = reader.store.path(keys[7])
    data = bytearray(path.read_bytes())
    data[-600] ^= 0x01  # a payload byte (v, the last tensor in the file)
    path.write_bytes(bytes(data))
    got = reader.extend("ns", ids, None)
    assert got is not None and got.num_tokens == 7 * B
    torch.cuda.synchronize()
    k = got.refs[0].segment.k
    assert torch.equal(k.view(torch.int16), snap.refs[0].segment.k[:, :, : 7 * B].view(torch.int16))
    assert reader.stats.corrupt == 1 and not path.exists()
    writer.close()
    reader.close()

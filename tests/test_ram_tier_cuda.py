"""The host-RAM tier on CUDA: pinned slots, side-stream copies, the compute stream joining the
copy's event (``Segment.ready``), one 2-D copy a block, and the disk fed from pinned RAM (run by hand on a GPU; skipped elsewhere). The
tier's logic is tested on CPU tensors in tests/test_ram_tier.py, whose helpers these reuse."""

from __future__ import annotations

import pytest
import torch
from disk_helpers import GIB, first_logits, prompt, turn
from test_ram_tier import _as_cold, _bank, _forget

from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.ram import RamTier
from turnkv.bank.session_bank import SessionBank
from turnkv.config import EngineConfig
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef, unique_bytes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_SHAPE = KVShape(4, 2, 64, torch.bfloat16, torch.device("cuda"))


def _device_rows(tokens: list[int], seed: int) -> SegmentedSnapshot:
    s = CUDA_SHAPE
    g = torch.Generator(device="cuda").manual_seed(seed)
    dims = (s.num_layers, s.num_kv_heads, len(tokens), s.head_dim)
    k = torch.randn(dims, generator=g, device="cuda").to(s.dtype)
    seg = Segment(k, -k, tuple(tokens))
    return SegmentedSnapshot([SegmentRef(seg, seg.num_rows)])


@cuda
def test_cuda_slots_are_pinned_and_restores_read_the_rows_without_a_host_wait():
    ram = RamTier("fp", CUDA_SHAPE, 8)
    assert all(t.is_pinned() for chunk in ram.pool.chunks for t in chunk)
    ids = list(range(3 * B))
    snap = _device_rows(ids, seed=1)
    ram.write_behind("ns", snap)  # D2H on the side stream, after the rows' kernels
    got = ram.extend("ns", [*ids, 1], None)  # H2D on the side stream; this stream waits on it
    assert got is not None and got.num_tokens == 3 * B and got.refs[0].segment.k.is_cuda
    k, v = got.read_rows(0, 3 * B)  # read on the compute stream, no synchronize in between
    wk, wv = snap.read_rows(0, 3 * B)
    assert torch.equal(k, wk) and torch.equal(v, wv)
    assert ram.flush() and ram.held() == [] and ram.health()["restore_gbps"] > 0


@cuda
def test_cuda_a_slot_being_restored_is_never_overwritten_by_the_next_write():
    """Two slots: a restore's H2D is launched, then writes that need both slots follow at once.
    The restore's slots stay pinned until its copy's event passes, so the rows are right."""
    ram = RamTier("fp", CUDA_SHAPE, 2)
    ids = list(range(2 * B))
    snap = _device_rows(ids, seed=2)
    ram.write_behind("ns", snap)
    for round_ in range(20):
        got = ram.extend("ns", [*ids, 1], None)
        if got is None:  # evicted by an earlier round once its copy was done: write it again
            ram.write_behind("ns", snap)
            continue
        ram.write_behind("ns", _device_rows([50_000 + round_] * (2 * B), seed=3 + round_))
        k, _ = got.read_rows(0, got.num_tokens)
        assert torch.equal(k, snap.read_rows(0, got.num_tokens)[0]), round_
    assert ram.flush() and all(s.pins == 0 for s in ram._slots.values())


@cuda
def test_cuda_a_turn_restored_from_ram_answers_as_cold(tmp_path):
    from turnkv.runtime import load_engine

    engine = load_engine(EngineConfig(model="random:test", device="cuda", dtype="float32"), progress=False)
    bank = _bank(engine, 8, tmp_path)
    ids = prompt(3 * B + 7, seed=6)
    cold, _ = first_logits(engine, None, "ns", ids)
    turn(engine, bank, "ns", ids)
    _forget(bank)
    warm, cached = first_logits(engine, bank, "ns", ids)
    assert cached == 3 * B and _as_cold(warm, cold)
    assert bank.tier.flush(30) and bank.tier.disk.health()["writes"] == 3  # fed from pinned RAM
    bank.tier.close()
    again = SessionBank(
        GIB,
        engine.shape.bytes_per_row,
        lambda h: unique_bytes(*h),
        tier=DiskTier.open(tmp_path, engine.info.fingerprint, engine.shape, GIB),
    )
    warm, cached = first_logits(engine, again, "ns", ids)  # what RAM fed the disk restores too
    assert cached == 3 * B and _as_cold(warm, cold)
    again.tier.close()


@cuda
def test_a_block_goes_into_its_rows_of_a_segment_as_one_2d_copy_with_copy_s_bits():
    from turnkv.bank import h2d

    assert h2d._cudart() is not None  # torch's runtime was found: the 2-D path is the one tested
    for dtype, (L, H, T, D) in ((torch.bfloat16, (3, 2, 3 * B, 64)), (torch.float32, (2, 4, 2 * B + 5, 8))):
        dst = torch.zeros((L, H, T, D), dtype=dtype, device="cuda")
        want = torch.zeros_like(dst)
        stream = torch.cuda.Stream()
        for j in range(T // B):
            src = torch.randn((L, H, B, D)).to(dtype).pin_memory()
            with torch.cuda.stream(stream):
                h2d.copy_block(dst[:, :, j * B : (j + 1) * B], src, stream)
            want[:, :, j * B : (j + 1) * B].copy_(src)
        stream.synchronize()
        assert torch.equal(dst, want)


@cuda
def test_cuda_a_pool_carved_from_a_pinned_reserve_is_page_locked_and_restores_the_rows(monkeypatch):
    """The reserve pins on its own threads (``HostReserve``); the tier's ``k``/``v`` are halves of
    its chunks, page-locked through the chunk's registration, and copies in and out are right."""
    import turnkv.bank.ram_pool as ram_module
    from turnkv.bank.host_memory import HostReserve

    block = B * CUDA_SHAPE.bytes_per_row
    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 2 * block)
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    reserve = HostReserve(8 * block, 2 * block)  # pinned
    ram = RamTier("fp", CUDA_SHAPE, 8, None, reserve)
    ram.pool.grow_behind()
    assert ram.pool.wait_whole() and len(ram.pool.bases) == 4 and reserve.failed is None
    assert all(t.is_pinned() for chunk in ram.pool.chunks for t in chunk)
    ids = list(range(7 * B))
    snap = _device_rows(ids, seed=9)
    ram.write_behind("ns", snap)
    got = ram.extend("ns", [*ids, 1], None)
    assert got is not None and got.num_tokens == 7 * B
    k, v = got.read_rows(0, 7 * B)
    wk, wv = snap.read_rows(0, 7 * B)
    assert torch.equal(k, wk) and torch.equal(v, wv)
    assert ram.flush()

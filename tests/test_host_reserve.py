"""The RAM tier's pool taken early (``host_memory.HostReserve``): chunks faulted and registered on
threads of their own from before the model loads, handed out in order; the tier carves its
chunks out of them and behaves as with memory of its own. On a CPU the chunks are plain pages
(the registration is CUDA's only difference, tested on the device by hand)."""

from __future__ import annotations

import threading

import pytest
import torch
from disk_helpers import GIB, first_logits, prompt, tiny_engine, turn

import turnkv.bank.host_memory as host_memory
import turnkv.bank.ram_pool as ram_module
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.host_memory import HostReserve
from turnkv.bank.ram import RamTier
from turnkv.bank.ram_budget import open_ram, start_reserve
from turnkv.bank.session_bank import SessionBank
from turnkv.bank.tiers import TierChain
from turnkv.config import EngineConfig
from turnkv.kv.segments import unique_bytes


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def _inside(t: torch.Tensor, bases: list[torch.Tensor]) -> bool:
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(b.data_ptr() <= lo and hi <= b.data_ptr() + b.numel() for b in bases)


def test_a_reserve_hands_out_its_chunks_in_order_then_none():
    r = HostReserve(10 * 4096 + 300, 4096, pinned=False)
    sizes = []
    while (t := r.take()) is not None:
        assert t.dtype == torch.uint8 and not t.any()  # faulted: every page written (zeros)
        sizes.append(t.numel())
    assert sizes == [4096] * 10 + [300]
    assert r.wait() is not None and r.made == 11 and r.failed is None
    assert r.take() is None  # and stays exhausted


def test_a_failed_registration_stops_the_reserve_with_the_drivers_reason(monkeypatch):
    calls = []

    def register(t):
        calls.append(t)
        if len(calls) > 2:
            raise RuntimeError("cudaHostRegister of 0 MiB failed: out of memory")
        return t

    monkeypatch.setattr(host_memory, "_register", register)
    r = HostReserve(10 * 4096, 4096, pinned=True)
    got = [r.take(), r.take(), r.take()]
    assert [t is not None for t in got] == [True, True, False]
    r.wait()
    assert "out of memory" in r.failed and r.made == 2
    assert len(calls) <= 5  # it stopped faulting soon after (two chunks queued at most)


def test_a_closed_reserve_stops_and_hands_out_nothing():
    r = HostReserve(1000 * (1 << 16), 1 << 16, pinned=False)
    r.close()
    assert r.take() is None and r.made <= r.count and r.seconds is not None


def _bank(engine, ram: RamTier) -> SessionBank:
    return SessionBank(GIB, engine.shape.bytes_per_row, lambda h: unique_bytes(*h), tier=TierChain(ram, None))


def test_a_pool_carved_from_a_reserve_restores_a_lost_turn_as_if_computed_cold(engine, monkeypatch):
    block = B * engine.shape.bytes_per_row
    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 2 * block)  # chunks of two blocks
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    reserve = HostReserve(8 * block, 2 * block, pinned=False)
    ram = RamTier(engine.info.fingerprint, engine.shape, 8, None, reserve)
    ram.pool.grow_behind()
    assert (
        ram.pool.wait_whole() and ram.pool.pool_bytes == ram.budget_bytes and ram.pool.pin_seconds is not None
    )
    bases = ram.pool.bases
    assert len(bases) == 4 and all(_inside(k, bases) and _inside(v, bases) for k, v in ram.pool.chunks)
    assert len({t.data_ptr() for kv in ram.pool.chunks for t in kv}) == 8  # k and v apart, no overlap

    bank = _bank(engine, ram)
    ids = prompt(3 * B + 40, seed=1)
    cold, _ = first_logits(engine, None, "ns", ids)
    turn(engine, bank, "ns", ids)
    for entry in bank.entries():
        bank._remove(entry)  # only the RAM tier holds it now
    warm, cached = first_logits(engine, bank, "ns", ids)
    assert cached == 3 * B
    torch.testing.assert_close(warm, cold, atol=1e-4, rtol=1e-4)


def test_a_tier_whose_reserve_ends_short_allocates_the_rest_itself(engine, monkeypatch):
    block = B * engine.shape.bytes_per_row
    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 2 * block)
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    reserve = HostReserve(3 * block, 2 * block, pinned=False)  # one whole chunk, one too short
    ram = RamTier(engine.info.fingerprint, engine.shape, 6, None, reserve)
    ram.pool.grow_behind()
    assert ram.pool.wait_whole() and ram.pool.pool_bytes == ram.budget_bytes and ram.pool.grow_failed is None
    assert len(ram.pool.bases) == 1 and len(ram.pool.chunks) == 3


def test_a_servers_tier_takes_its_budget_from_the_reserve_started_before_the_load(monkeypatch, tmp_path):
    from turnkv.runtime import build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    started = []
    real = start_reserve

    def spy(cfg):
        r = real(cfg)
        started.append(r)
        return r

    monkeypatch.setattr("turnkv.bank.ram_budget.start_reserve", spy)
    cfg = EngineConfig(model="random:test", device="cpu", dtype="float32", ram_bytes="8M", no_disk=True)
    rt = build(cfg, "serve", progress=False)
    [reserve] = started
    ram = rt.bank.tier.ram
    assert reserve is not None and ram.reserve is reserve and reserve.total == 8 << 20
    report = rt.warm_up()
    doc = report.doc()
    assert set(doc["phase_steps"]) == set(doc["phases"]) and all(
        len(v) == 3 for v in doc["phase_steps"].values()
    )
    steps, captured, compiled = doc["phase_steps"]["smoke"]
    assert steps >= 1 and captured == compiled == 0  # the CPU's one turn: no graphs, no JIT
    assert ram.pool.whole and ram.budget_bytes <= 8 << 20 and ram.pool.pool_bytes == ram.budget_bytes
    assert (
        ram.pool.bases
        and report.ram_pin_s is not None
        and report.doc()["ram_pin_s"] >= report.doc()["ram_s"] >= 0
    )


def test_no_tier_no_reserve_and_a_tier_too_small_for_a_block_lets_its_reserve_go(engine):
    assert start_reserve(EngineConfig(device="cpu")) is None  # auto is off on a CPU device
    assert start_reserve(EngineConfig(device="cpu", ram_bytes="0")) is None
    reserve = HostReserve(1024, 1024, pinned=False)
    tier, why = open_ram(engine, None, reserve)
    assert tier is None and "smaller than one block" in why and reserve.take() is None


def test_an_allocator_that_fails_ends_the_reserve_with_its_reason_and_never_hangs_a_taker(monkeypatch):
    def no_memory(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes")

    monkeypatch.setattr(host_memory.torch, "zeros", no_memory)
    r = HostReserve(10 * 4096, 4096, pinned=False)
    got: list = []
    taker = threading.Thread(target=lambda: got.append(r.take()), daemon=True)
    taker.start()
    taker.join(10)
    assert not taker.is_alive() and got == [None]
    assert "can't allocate memory" in r.failed and r.made == 0


def test_a_tier_that_cannot_be_had_lets_its_reserve_go(engine, monkeypatch):
    def no_memory(*a, **k):
        raise MemoryError("no pages")

    monkeypatch.setattr(ram_module, "host_empty", no_memory)
    block = B * engine.shape.bytes_per_row
    reserve = HostReserve(4 * block, 16, pinned=False)  # chunks too small for a block: the tier allocates
    tier, why = open_ram(engine, None, reserve)
    assert tier is None and "failed" in why
    assert reserve.take() is None  # closed: its chunks went with it


def test_a_reserve_that_stops_gives_the_pool_its_reason_and_no_chunk_is_allocated_beside_it(
    engine, monkeypatch
):
    block = B * engine.shape.bytes_per_row
    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 2 * block)
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    calls = []

    def register(t):
        calls.append(t)
        if len(calls) > 1:
            raise RuntimeError("cudaHostRegister failed: out of memory (driver limit)")
        return t

    def allocate(*a, **k):  # the pool's own allocation: the driver would refuse it the same way
        raise AssertionError("allocated beside a reserve that had stopped")

    monkeypatch.setattr(host_memory, "_register", register)
    monkeypatch.setattr(ram_module, "host_empty", allocate)
    reserve = HostReserve(6 * block, 2 * block, pinned=True)
    ram = RamTier(engine.info.fingerprint, engine.shape, 6, None, reserve)
    ram.pool.grow_behind()
    assert ram.pool.wait_whole(10)
    assert len(ram.pool.chunks) == 1 and "driver limit" in ram.pool.grow_failed


def test_closing_a_pool_whose_grower_waits_for_the_reserve_allocates_nothing(engine, monkeypatch):
    block = B * engine.shape.bytes_per_row
    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 2 * block)
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    zeros, made = host_memory.torch.zeros, []
    reserve: list[HostReserve] = []

    def slow_zeros(*a, **k):  # the first chunk at once, the next ones only once the pool closes
        made.append(1)
        while len(made) > 1 and not (reserve and reserve[0]._closing):  # (its thread may run first)
            threading.Event().wait(0.005)
        return zeros(*a, **k)

    allocated = []

    def allocate(*a, **k):  # a chunk of its own while closing (the grower's thread would hide a raise)
        allocated.append(a)
        return torch.empty(a[0], dtype=a[1])

    monkeypatch.setattr(host_memory.torch, "zeros", slow_zeros)
    monkeypatch.setattr(ram_module, "host_empty", allocate)
    reserve.append(HostReserve(6 * block, 2 * block, pinned=False))
    ram = RamTier(engine.info.fingerprint, engine.shape, 6, None, reserve[0])
    ram.pool.grow_behind()
    threading.Event().wait(0.05)  # the grower waits in take()
    closer = threading.Thread(target=ram.pool.close, daemon=True)
    closer.start()
    closer.join(10)
    assert (
        not closer.is_alive()
        and allocated == []
        and len(ram.pool.chunks) == 1
        and ram.pool.grow_failed is None
    )

"""The host-RAM tier (``bank.ram``) and the chain GPU bank -> RAM -> disk -> gone (``bank.tiers``).

On a CPU device the bank already lives in RAM, so ``--ram-bytes auto`` is off there, but the tier
itself runs on CPU tensors (the pinned memory and the side-stream copies are CUDA's only
difference): these tests drive it end to end. Oracles: a restored turn's logits equal the logits
of the same prompt computed from scratch (cached == uncached: to float tolerance, since the cold
run prefills in other chunks, and the same greedy token), restored rows equal the banked rows bit
for bit (or the rows written: a function of each row's token and position), and the slot counts
follow from the budget in blocks.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from disk_helpers import GIB, first_logits, prompt, tiny_engine, turn

from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.ram import RAM_KEYS, RamTier
from turnkv.bank.ram_budget import max_ram_bytes, open_ram, ram_budget
from turnkv.bank.records import Reservation
from turnkv.bank.session_bank import SessionBank
from turnkv.bank.tiers import TierChain, extend_by_tier, tier_health
from turnkv.config import ConfigError, EngineConfig
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef, unique_bytes

SHAPE = KVShape(2, 1, 8, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def _bank(engine, blocks: int, directory=None) -> SessionBank:
    disk = DiskTier.open(directory, engine.info.fingerprint, engine.shape, GIB) if directory else None
    ram = RamTier(engine.info.fingerprint, engine.shape, blocks, disk)
    return SessionBank(GIB, engine.shape.bytes_per_row, lambda h: unique_bytes(*h), tier=TierChain(ram, disk))


def _forget(bank: SessionBank) -> None:
    """The GPU bank loses every entry (as its own eviction would): only the tiers hold them."""
    for entry in bank.entries():
        bank._remove(entry)


def _rows(tokens: list[int]) -> SegmentedSnapshot:
    """Rows that are a function of (token, position): any row restored from the wrong slot differs."""
    s = SHAPE
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (torch.tensor(tokens, dtype=torch.float32) * 1e-3 + pos)[None, None, :, None]
    k = base + torch.arange(s.num_layers * s.head_dim, dtype=torch.float32).reshape(s.num_layers, 1, 1, -1)
    k = k.expand(s.num_layers, s.num_kv_heads, len(tokens), s.head_dim).contiguous()
    seg = Segment(k, -k, tuple(tokens))
    return SegmentedSnapshot([SegmentRef(seg, seg.num_rows)])


def _as_cold(warm: torch.Tensor, cold: torch.Tensor) -> bool:
    torch.testing.assert_close(warm, cold, atol=1e-4, rtol=1e-4)
    return torch.equal(warm.argmax(), cold.argmax())


def _same_rows(got: SegmentedSnapshot, want: SegmentedSnapshot) -> bool:
    n = got.num_tokens
    gk, gv = got.read_rows(0, n)
    wk, wv = want.read_rows(0, n)
    return torch.equal(gk, wk) and torch.equal(gv, wv)


def test_a_turn_the_bank_lost_restores_from_ram_as_if_computed_cold(engine):
    bank = _bank(engine, 8)
    ids = prompt(3 * B + 40, seed=1)
    cold, _ = first_logits(engine, None, "ns", ids)
    turn(engine, bank, "ns", ids)
    _forget(bank)
    warm, cached = first_logits(engine, bank, "ns", ids)
    h = bank.tier.ram.health()
    assert cached == 3 * B and _as_cold(warm, cold)
    assert (h["hits"], h["hit_tokens"], h["blocks"], h["dropped"]) == (1, 3 * B, 3, 0)
    assert h["restore_gbps"] > 0


def test_restored_rows_are_the_banked_rows_bit_for_bit(engine):
    bank = _bank(engine, 8)
    ids = prompt(2 * B + 5, seed=5)
    turn(engine, bank, "ns", ids)
    [entry] = bank.entries()
    _forget(bank)
    lease = bank.admit("ns", list(entry.tokens), Reservation(1))
    assert lease.cached == 2 * B and len(lease.snapshot.segments()) == 1  # one new sealed segment
    assert _same_rows(lease.snapshot, entry.snapshot)
    bank.finish(lease, None)


def test_the_chain_evicts_bank_to_ram_to_disk_and_restores_from_each(engine, tmp_path):
    """RAM of 3 blocks behind the bank, the disk behind RAM: the newest conversation comes back
    from RAM, an older one RAM evicted comes back from disk, and both answer as cold."""
    bank = _bank(engine, 3, tmp_path)
    old, new = prompt(2 * B + 9, seed=2), prompt(3 * B + 9, seed=3)
    turn(engine, bank, "ns", old)
    assert bank.tier.flush(30)  # old's blocks are on disk: RAM may reuse their slots
    turn(engine, bank, "ns", new)  # needs all 3 slots: old's 2 blocks leave RAM
    assert bank.tier.flush(30)
    ram, disk = bank.tier.ram, bank.tier.disk
    assert ram.resident("ns", old) == 0 and ram.resident("ns", new) == 3
    assert disk.health()["writes"] == 5  # fed from RAM's slots before they were reused
    _forget(bank)
    for ids, source in ((new, "ram"), (old, "disk")):
        cold, _ = first_logits(engine, None, "ns", ids)
        before = tier_health(bank.tier)[source]["hit_tokens"]
        warm, cached = first_logits(engine, bank, "ns", ids)
        assert _as_cold(warm, cold) and cached == (len(ids) // B) * B
        assert tier_health(bank.tier)[source]["hit_tokens"] - before == cached, source
    assert disk.health()["corrupt"] == 0
    bank.tier.close()


def test_ram_continues_where_memory_stops_and_disk_where_ram_stops(engine, tmp_path):
    """A prompt whose first block only the bank holds, the next two RAM, the rest disk."""
    bank = _bank(engine, 8, tmp_path)
    ids = prompt(5 * B + 3, seed=4)
    turn(engine, bank, "ns", ids)
    assert bank.tier.flush(30)
    ram = bank.tier.ram
    with ram._lock:  # RAM loses the last two blocks (its own eviction order: the chain's end)
        for _ in range(2):
            leaf = next(i for i in ram._leaves)
            ram._evict(leaf)
    _forget(bank)
    cold, _ = first_logits(engine, None, "ns", ids)
    warm, cached = first_logits(engine, bank, "ns", ids)
    h = tier_health(bank.tier)
    assert _as_cold(warm, cold) and cached == 5 * B
    assert h["ram"]["hit_tokens"] == 3 * B and h["disk"]["hit_tokens"] == 2 * B
    got, rows = extend_by_tier(bank.tier, "ns", ids[:-1], None)  # what each tier brought back
    assert got is not None and got.num_tokens == 5 * B and rows == {"ram": 3 * B, "disk": 2 * B}
    bank.tier.close()


def test_lru_by_conversation_the_least_recent_loses_its_end_first():
    ram = RamTier("fp", SHAPE, 6)
    a, b, c = ([t] * (2 * B) for t in (1, 2, 3))
    for conv in (a, b, c):
        ram.write_behind("ns", _rows(conv))
    assert ram.extend("ns", a, None) is not None  # a is now the most recent
    ram.write_behind("ns", _rows([4] * B))  # one slot: b's end goes
    assert [ram.resident("ns", x) for x in (a, b, c)] == [2, 1, 2]
    ram.write_behind("ns", _rows([5] * (2 * B)))  # two more: b's head, then c's end
    assert [ram.resident("ns", x) for x in (a, b, c)] == [2, 0, 1]
    assert ram.health()["evictions"] == 3 and ram.health()["blocks"] == 6


def test_a_shared_prefix_is_stored_once_and_evicted_last():
    """Ten conversations start with one 2-block system prompt; RAM holds 4 blocks. The prompt's
    blocks are stored once and stay while the conversations after it come and go."""
    ram = RamTier("fp", SHAPE, 4)
    system = [7] * (2 * B)
    convs = [system + [100 + c] * B for c in range(10)]
    for conv in convs:
        ram.write_behind("ns", _rows(conv))
        assert ram.resident("ns", system) == 2
    h = ram.health()
    assert h["blocks"] == 4 and h["dedupe_hits"] == 2 * 9  # the system blocks, written once
    assert [ram.resident("ns", c) for c in convs[-2:]] == [3, 3]
    got = ram.extend("ns", convs[0] + [1], None)
    assert got is not None and got.num_tokens == 2 * B and _same_rows(got, _rows(system))


def test_the_pool_starts_with_its_first_chunks_and_grows_behind_the_steps_across_chunks(monkeypatch):
    """At start the pool holds its first chunks (a full pool drops, never allocates on the
    caller's thread); ``grow_behind`` adds the rest on a thread of its own, and a restore reads
    across the chunks."""
    import turnkv.bank.ram_pool as ram_module

    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 2 * B * SHAPE.bytes_per_row)  # two slots a chunk
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    ram = RamTier("fp", SHAPE, 5)
    assert len(ram.pool.chunks) == 1 and not ram.pool.whole  # only the first chunk at start
    ids = list(range(5 * B))
    ram.write_behind("ns", _rows(ids))
    assert len(ram.pool.chunks) == 1 and ram.health()["blocks"] == 2 and ram.health()["dropped"] == 3
    ram.pool.grow_behind()
    assert ram.pool.wait_whole(30) and len(ram.pool.chunks) == 3  # 2 + 2 + 1 slots
    ram.write_behind("ns", _rows(ids))
    assert ram.health()["blocks"] == 5
    got = ram.extend("ns", [*ids, 1], None)
    assert got is not None and got.num_tokens == 5 * B and _same_rows(got, _rows(ids))


def test_close_stops_the_grower_at_its_next_chunk(monkeypatch):
    import threading

    import turnkv.bank.ram_pool as ram_module

    monkeypatch.setattr(ram_module, "CHUNK_BYTES", B * SHAPE.bytes_per_row)  # one slot a chunk
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    ram = RamTier("fp", SHAPE, 50)
    gate = threading.Event()
    real = ram_module.host_empty

    def slow(*a, **kw):  # each chunk waits for the test
        gate.wait(5)
        return real(*a, **kw)

    monkeypatch.setattr(ram_module, "host_empty", slow)
    ram.pool.grow_behind()
    closer = threading.Thread(target=ram.close)
    closer.start()
    gate.set()
    closer.join(10)
    assert not closer.is_alive() and len(ram.pool.chunks) < 50  # it stopped well short of its budget


def test_a_pool_that_stops_growing_keeps_its_slots_and_says_why_on_health(monkeypatch):
    import turnkv.bank.ram_pool as ram_module

    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 2 * B * SHAPE.bytes_per_row)
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    ram = RamTier("fp", SHAPE, 6)

    def no_memory(*a, **kw):
        raise RuntimeError("CUDA error: out of memory\nmore lines")

    monkeypatch.setattr(ram_module, "host_empty", no_memory)
    ram.pool.grow_behind()
    assert ram.pool.wait_whole(30)  # stopped: whole as far as it goes
    reason = ram.health()["reason"]
    assert "stopped at" in reason and "out of memory" in reason and "\n" not in reason
    monkeypatch.undo()
    ram.write_behind("ns", _rows(list(range(3 * B))))
    assert ram.health()["blocks"] == 2  # the first chunk still serves


def test_namespaces_never_share_a_block():
    ram = RamTier("fp", SHAPE, 8)
    ids = [3] * (2 * B)
    ram.write_behind("a", _rows(ids))
    assert ram.extend("b", ids, None) is None and ram.health()["misses"] == 1
    ram.write_behind("b", _rows(ids))
    assert ram.health()["blocks"] == 4


def test_a_ram_too_small_for_a_turn_keeps_the_head_and_counts_the_rest():
    ram = RamTier("fp", SHAPE, 2)
    ids = list(range(4 * B))
    ram.write_behind("ns", _rows(ids))  # 4 blocks into 2 slots: never evicts its own chain
    h = ram.health()
    assert ram.resident("ns", ids) == 2 and h["dropped"] == 2 and h["evictions"] == 0


def test_a_block_the_disk_has_not_written_yet_is_not_evicted(tmp_path):
    """RAM feeds the disk from its slots: a slot waiting for the writer keeps its rows."""
    disk = DiskTier.open(tmp_path, "fp", SHAPE, GIB)
    ram = RamTier("fp", SHAPE, 2, disk)
    first = [1] * (2 * B)
    with disk._cv:  # the writer is busy: both blocks wait in the queue
        ram.write_behind("ns", _rows(first))
        ram.write_behind("ns", _rows([2] * B))
        assert ram.resident("ns", first) == 2 and ram.health()["dropped"] == 1
    assert disk.flush(30)
    ram.write_behind("ns", _rows([2] * B))  # written now: the LRU leaf may go
    assert ram.resident("ns", first) == 1 and ram.resident("ns", [2] * B) == 1
    disk.close()


def test_concurrent_eviction_and_restore_read_only_right_rows(tmp_path):
    """Three threads restore overlapping prefixes while a fourth keeps writing conversations
    into 4 slots, evicting at nearly every write, with the disk fed behind. Every restored row
    is the row written, nothing is corrupt, and the run is bounded."""
    disk = DiskTier.open(tmp_path, "fp", SHAPE, GIB)
    ram = RamTier("fp", SHAPE, 4, disk)
    system = list(range(2 * B))
    convs = [system + [10_000 + c] * B + [20_000 + c] * (B * (c % 2)) for c in range(6)]
    want = [_rows(t) for t in convs]
    stop, errors, restored = threading.Event(), [], []
    deadline = time.monotonic() + 60

    def churn() -> None:
        rng = random.Random(1)
        while not stop.is_set() and time.monotonic() < deadline:
            ram.write_behind("ns", want[rng.randrange(len(convs))])

    def restore(seed: int) -> None:
        rng = random.Random(seed)
        try:
            rounds = 0
            while (rounds < 40 or ram.stats.evictions < 8) and time.monotonic() < deadline:
                rounds += 1
                c = rng.randrange(len(convs))
                got = ram.extend("ns", convs[c], None)
                if got is not None:
                    assert _same_rows(got, want[c]), f"conversation {c}: wrong rows"
                    restored.append(got.num_tokens)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn)] + [
        threading.Thread(target=restore, args=(s,)) for s in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not errors, errors
    assert restored and ram.stats.evictions >= 8 and time.monotonic() < deadline
    assert disk.flush(30) and disk.health()["corrupt"] == 0 and disk.health()["write_failures"] == 0
    assert all(s.pins == 0 for s in ram._slots.values())
    disk.close()


def test_health_keys_and_the_off_reason():
    ram = RamTier("fp", SHAPE, 3)
    h = ram.health()
    assert set(h) == {"enabled", "reason", "restore_gbps", *RAM_KEYS}
    assert h["budget_bytes"] == 3 * B * SHAPE.bytes_per_row and h["capacity_blocks"] == 3
    off = tier_health(TierChain(None, None, "--no-ram"))["ram"]
    assert off["enabled"] is False and off["reason"] == "--no-ram" and off["blocks"] == 0
    assert set(off) == set(h)


# -- the flag ------------------------------------------------------------------------------------
def test_auto_is_off_on_a_cpu_device_and_zero_or_no_ram_turn_it_off():
    assert ram_budget(EngineConfig(), "cpu")[0] == 0 and "CPU" in ram_budget(EngineConfig(), "cpu")[1]
    assert ram_budget(EngineConfig(ram_bytes="0"), "cpu") == (0, "--ram-bytes 0")
    assert ram_budget(EngineConfig(ram_bytes="1M", no_ram=True), "cpu") == (0, "--no-ram")
    assert ram_budget(EngineConfig(ram_bytes="1M"), "cpu") == (1 << 20, None)


def test_a_budget_larger_than_the_machine_is_one_line_naming_the_flag_and_the_maximum():
    most = max_ram_bytes()
    with pytest.raises(ValueError) as err:
        ram_budget(EngineConfig(ram_bytes=str(most + (1 << 30))), "cpu")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--ram-bytes (TURNKV_RAM_BYTES)") and str(most) in msg


def test_turnkv_serve_with_too_large_a_budget_fails_in_one_line_before_loading():
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "turnkv", "serve", "--model", "random:test", "--device", "cpu", "--port", "0"],
        env={**os.environ, "TURNKV_RAM_BYTES": "1000T", "TURNKV_NO_DISK": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert (
        lines[0].startswith("turnkv: error: --ram-bytes (TURNKV_RAM_BYTES) 1000T") and "at most" in lines[0]
    )


@pytest.mark.parametrize("bad", ["lots", "-1", "1.5X"])
def test_a_ram_bytes_that_does_not_parse_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="ram_bytes must be auto, 0"):
        EngineConfig(ram_bytes=bad)


def test_the_cli_names_the_flag_and_its_env_twin(monkeypatch):
    from turnkv.cli import build_parser, engine_config

    with pytest.raises(ConfigError, match=r"^--ram-bytes must"):
        engine_config(build_parser().parse_args(["serve", "--ram-bytes", "lots"]))
    monkeypatch.setenv("TURNKV_RAM_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"^TURNKV_RAM_BYTES must"):
        engine_config(build_parser().parse_args(["serve"]))
    monkeypatch.setenv("TURNKV_RAM_BYTES", "64M")
    monkeypatch.setenv("TURNKV_NO_RAM", "1")
    cfg = engine_config(build_parser().parse_args(["serve"]))
    assert (cfg.ram_bytes, cfg.no_ram) == ("64M", True)


def test_a_failed_allocation_leaves_the_tier_off_with_the_reason(engine, monkeypatch):
    """A first chunk the allocator cannot give (here: more than the address space) turns the tier
    off; the server goes on with the reason on /health.ram."""
    import turnkv.bank.ram_budget as rb
    import turnkv.bank.ram_pool as ram_module

    monkeypatch.setattr(rb, "ram_budget", lambda cfg, device=None: (1 << 62, None))
    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 1 << 62)
    ram, off = open_ram(engine)
    assert ram is None and "failed" in off and "\n" not in off


# -- through the server ----------------------------------------------------------------------------
def test_the_server_restores_from_ram_and_reports_it_on_health_and_metrics(tmp_path):
    """``turnkv serve --ram-bytes 16M`` on a CPU (a random model): a conversation the bank lost
    comes back from RAM with ``cached_tokens`` covering it and the answer of a cold server."""
    import httpx
    from test_server import Live

    from turnkv.models.load import build_random_model

    lm = build_random_model("test", "cpu", "float32")
    ids = prompt(2 * B + 30, seed=9)
    body = {"model": "random:test", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    srv, cold_srv = Live(lm, ram_bytes="16M", disk_dir=str(tmp_path)), Live(lm, no_disk=True)
    try:
        first = srv.post("/v1/completions", body)
        srv.idle()
        _forget(srv.server.bank)
        again = srv.post("/v1/completions", body)
        cold = cold_srv.post("/v1/completions", body)
        h = srv.health()
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        off = cold_srv.health()["ram"]
    finally:
        srv.close()
        cold_srv.close()
    assert first.status_code == again.status_code == cold.status_code == 200
    assert again.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * B
    assert again.json()["usage"]["cache_break"]["detail"].endswith(
        f"rows restored from a lower tier: ram {2 * B}"
    )
    ram = h["ram"]
    assert ram["enabled"] and ram["reason"] is None and ram["budget_bytes"] <= 16 << 20
    assert (ram["hits"], ram["hit_tokens"], ram["blocks"]) == (1, 2 * B, 2)
    assert h["disk"]["enabled"] and h["disk"]["hits"] == 0  # RAM answered first
    assert "turnkv_ram_hits_total 1.0" in metrics and "turnkv_ram_blocks 2.0" in metrics
    assert off["enabled"] is False and "CPU" in off["reason"]  # auto on a CPU device


def test_the_warm_up_pins_the_whole_pool_before_ready_and_says_how_long(monkeypatch, tmp_path):
    """``Runtime.warm_up`` pins the rest of the RAM pool first (no step, capture or request runs
    beside it); the report keeps its seconds for the startup line and ``/health``."""
    import turnkv.bank.ram_pool as ram_module
    from turnkv.config import EngineConfig
    from turnkv.runtime import build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(ram_module, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(ram_module, "START_CHUNKS", 1)
    cfg = EngineConfig(model="random:test", device="cpu", dtype="float32", ram_bytes="8M", no_disk=True)
    rt = build(cfg, "serve", progress=False)
    ram = rt.bank.tier.ram
    assert ram is not None and not ram.pool.whole and ram.pool.pool_bytes < ram.budget_bytes
    report = rt.warm_up()
    assert ram.pool.whole and ram.pool.pool_bytes == ram.budget_bytes
    assert report.ram_s is not None and report.doc()["ram_s"] >= 0


def test_a_blocks_rows_in_a_segment_are_one_pitched_copy_and_nothing_else_is():
    from turnkv.bank.h2d import pitched

    seg = torch.empty(3, 2, 600, 8, dtype=torch.bfloat16)
    src = torch.empty(3, 2, 256, 8, dtype=torch.bfloat16)
    # L * Hkv runs of 256 * D elements, one every T * D
    assert pitched(seg[:, :, 256:512], src) == (600 * 8 * 2, 256 * 8 * 2, 256 * 8 * 2, 6)
    assert pitched(seg[:, :, :256], src.transpose(0, 1).contiguous().transpose(0, 1)) is None  # src strided
    assert pitched(seg[:, :1, :256], src[:, :1]) is None  # heads cut: the pitch is not uniform
    assert pitched(seg[..., :4][:, :, :256], src[..., :4].contiguous()) is None  # rows cut

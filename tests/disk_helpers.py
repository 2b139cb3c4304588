"""Shared by the disk-tier tests and their child processes: a tiny engine, banks over a directory,
one turn through the bank as the server runs it, and synthetic snapshots."""

from __future__ import annotations

import itertools

import torch

from turnkv.bank.disk import DiskTier
from turnkv.bank.records import Reservation
from turnkv.bank.session_bank import SessionBank
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import Failed, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler, run_turn
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef, unique_bytes
from turnkv.runtime import load_engine

GIB = 1 << 30


def tiny_engine(dtype: str = "float32") -> Engine:
    return load_engine(EngineConfig(model="random:test", device="cpu", dtype=dtype), progress=False)


def bank_over(engine: Engine, directory, budget: int = GIB, **tier_kw) -> SessionBank:
    tier = DiskTier.open(directory, engine.info.fingerprint, engine.shape, budget, **tier_kw)
    return SessionBank(GIB, engine.shape.bytes_per_row, lambda held: unique_bytes(*held), tier=tier)


def prompt(n: int, seed: int = 0, vocab: int = 250) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def turn(engine: Engine, bank: SessionBank, ns: str, ids: list[int], max_tokens: int = 4):
    """One turn through the server's turn path (admit, restore, generate greedily, seal, bank):
    ``(new token ids, TurnStats, cached rows)``."""
    out, stats = [], None
    request = TurnRequest(ids, SamplingParams(ignore_eos=True), max_tokens=max_tokens, namespace=ns)
    for ev in run_turn(Scheduler(engine, bank, max_running=1), request):
        if isinstance(ev, Failed):
            raise RuntimeError(ev.message)
        if isinstance(ev, GenEvent):
            if ev.token_id is not None:
                out.append(ev.token_id)
            stats = ev.stats or stats
    return out, stats, stats.cached_tokens


def first_logits(engine: Engine, bank: SessionBank | None, ns: str, ids: list[int]):
    """Logits of the prompt's last row, restoring what the bank (and its tier) holds: ``([V], cached)``."""
    lease = bank.admit(ns, ids, Reservation(1)) if bank is not None else None
    snap = lease.snapshot if lease is not None else None
    cache = engine.restore(snap) if snap is not None else engine.new_cache()
    cached = lease.cached if lease is not None else 0
    logits = engine.prefill(cache, ids[cached:])
    if lease is not None:
        bank.finish(lease, None)
    return logits, cached


def synthetic(
    shape: KVShape, tokens: list[int], seed: int = 0, cuts: tuple[int, ...] = ()
) -> SegmentedSnapshot:
    """A snapshot of random rows for ``tokens``, split into segments at ``cuts``."""
    g = torch.Generator().manual_seed(seed)
    refs, bounds = [], [0, *cuts, len(tokens)]
    for lo, hi in itertools.pairwise(bounds):
        dims = (shape.num_layers, shape.num_kv_heads, hi - lo, shape.head_dim)
        k = torch.randn(dims, generator=g).to(shape.dtype)
        seg = Segment(k, -k, tuple(tokens[lo:hi]))
        refs.append(SegmentRef(seg, seg.num_rows))
    return SegmentedSnapshot(refs)

"""The host-RAM tier: sealed KV rows mirrored to host memory, restored when the bank lost them.

Memory is one pool of blocks of 256 tokens (``ram_pool.RamPool``: allocated in chunks, never
freed, pinned beside the model's load and whole before the server says ready). Pinned on
CUDA (copies at the bus's speed, no per-turn ``pin_memory``), plain CPU tensors on a CPU device
(where the bank already is in RAM: the tier is off there unless asked for, and CI tests its
logic with it). Blocks are keyed by the disk tier's chained keys
(``disk_blocks.block_keys``), so a block is stored once whatever number of conversations of a
namespace share it, and a key names the whole token prefix up to the block's end.

- ``write_behind`` (end of a turn): the snapshot's whole blocks that RAM lacks get a slot each and
  are copied in; on CUDA on a side stream, after an event recorded on the compute stream when the
  turn ended, so the request never waits for the copy (the snapshot is held, and counted by the
  bank, until the copy's event has passed). RAM then queues the blocks for the disk tier from
  these host rows (``DiskTier.write_host``); blocks RAM had no room for go to the disk from the
  device (``DiskTier.write_behind``).
- ``extend`` (admission, after the bank's lookup): the run of blocks RAM holds after the memory
  prefix is copied into one new sealed segment on the device; on CUDA by H2D on a stream of its
  own (allocated there: it waits neither for the steps in flight nor behind the mirrors of other
  turns, only for a mirror still filling one of its slots), each block one 2-D copy
  (``h2d.copy_block``); the segment carries the copy's event (``Segment.ready``), which the
  scheduler lets pass before the turn's first step, the other turns' steps running meanwhile.
- Eviction, when a slot is needed: only *leaves* are candidates (blocks no resident block
  continues), least recently used first. A conversation therefore loses its end first, in LRU
  order by conversation, and a prefix many conversations share (a system prompt) becomes a leaf,
  and can go, only after every conversation continuing it went. A block a restore is reading
  (pinned until its copy's event), one being copied in, and one the disk tier still has to write
  from this slot are never taken; when nothing can go, the new block is not staged (``dropped``).

Thread safety: one lock over the slots; copies run outside it, on slots pinned under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from turnkv.bank.disk_blocks import BLOCK_TOKENS, ROOT_KEY, block_context, block_keys, host_copy
from turnkv.bank.h2d import copy_block
from turnkv.bank.host_memory import HostReserve
from turnkv.bank.ram_pool import RamPool
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef

log = logging.getLogger(__name__)

RAM_KEYS = (
    "bytes",
    "budget_bytes",
    "blocks",
    "capacity_blocks",
    "hits",
    "misses",
    "hit_tokens",
    "evictions",
    "dedupe_hits",
    "dropped",
)


def disabled_ram_health(reason: str | None) -> dict:
    """``/health.ram`` without the tier: why it is off, zeros."""
    off = {"enabled": False, "reason": reason or "off", "restore_gbps": 0.0}
    return off | dict.fromkeys(RAM_KEYS, 0)


@dataclass
class RamStats:
    hits: int = 0  # admissions RAM extended
    misses: int = 0  # admissions with whole blocks beyond memory that RAM did not hold
    hit_tokens: int = 0  # rows restored from RAM
    evictions: int = 0  # blocks dropped to make room
    dedupe_hits: int = 0  # blocks of a finished turn RAM already held
    dropped: int = 0  # blocks not staged: every slot was pinned, being copied or awaiting the disk
    restore_bytes: int = 0  # bytes of timed restores ...
    restore_s: float = 0.0  # ... and their copy time


@dataclass
class _Slot:
    key: str
    parent: str
    last_used: int
    children: int = 0  # resident blocks whose parent this is (0: a leaf, an eviction candidate)
    pins: int = 0  # restores reading it
    ready: object | None = None  # CUDA event of the copy that fills it (None: filled)


@dataclass
class RamTier:
    """Blocks of host memory under ``capacity`` slots; ``below``: the disk tier it feeds, or None."""

    fingerprint: str
    shape: KVShape
    capacity: int
    below: object | None = None  # a DiskTier (write_host, write_behind, queued)
    reserve: HostReserve | None = None  # pinned chunks taken early (``host_memory.HostReserve``)
    stats: RamStats = field(default_factory=RamStats)
    name = "ram"

    def __post_init__(self) -> None:
        s = self.shape
        self.context = block_context(self.fingerprint, s)
        self.cuda = torch.device(s.device).type == "cuda"
        self.block_bytes = BLOCK_TOKENS * s.bytes_per_row  # k and v of one block
        self._free: list[int] = []
        self._warned: set[str] = set()
        self._slots: dict[int, _Slot] = {}
        self._by_key: dict[str, int] = {}
        self._leaves: set[int] = set()
        self._clock = 0
        self._lock = threading.RLock()
        self._stream = torch.cuda.Stream(torch.device(s.device)) if self.cuda else None  # D2H: mirrors
        # H2D: restores, on their own stream so that they never queue behind the mirrors of
        # finished turns (each waits for the compute stream's work when its turn ended)
        self._restore = torch.cuda.Stream(torch.device(s.device)) if self.cuda else None
        # (copy done, the rows it reads, the slots it fills)
        self._inflight: list[tuple[object, SegmentedSnapshot, list[int]]] = []
        self._releasing: list[tuple[object, list[int], object, int]] = []  # (done, pins, start, bytes)
        self.pool = RamPool(s, self.capacity, self.cuda, self.reserve, self._add_slots)

    def _add_slots(self, slots: range) -> None:
        with self._lock:
            self._free.extend(reversed(slots))  # taken from the end: lowest first

    @property
    def budget_bytes(self) -> int:
        return self.capacity * self.block_bytes

    # -- staging ----------------------------------------------------------------------------------
    def write_behind(self, namespace: str, snapshot: SegmentedSnapshot) -> None:
        """Stage the whole blocks of ``snapshot`` that RAM lacks, then feed them to the disk."""
        whole = snapshot.num_tokens // BLOCK_TOKENS
        if whole == 0:
            return
        keys = block_keys(self.context, namespace, snapshot.tokens, whole)
        with self._lock:
            self._reap()
            self._clock += 1
            chain: set[int] = set()
            staged: list[tuple[int, int]] = []  # (depth, slot)
            for depth, key in enumerate(keys):
                i = self._by_key.get(key)
                if i is None:
                    i = self._take(chain)
                    if i is None:
                        self.stats.dropped += whole - depth
                        break
                    self._place(i, key, keys[depth - 1] if depth else ROOT_KEY)
                    staged.append((depth, i))
                else:
                    self.stats.dedupe_hits += 1
                self._slots[i].last_used = self._clock
                chain.add(i)
            try:
                done = self._copy_out(snapshot, staged)
            except Exception as exc:  # a failed copy must not leave slots indexed with other rows
                for _, i in reversed(staged):
                    self._evict(i, counted=False)
                    self._free.append(i)
                self.stats.dropped += len(staged)
                self._warn(f"a copy into RAM failed ({type(exc).__name__}: {exc}); those blocks are not kept")
                staged, chain, done = [], {i for i in chain if i in self._slots}, None
            for _, i in staged:
                self._slots[i].ready = done
            resident = [(d, keys[d], self._by_key[keys[d]]) for d in range(len(chain))]
            if self.below is not None:
                rows = {d: self.pool.rows(i) for d, _, i in resident}
                self.below.write_host(namespace, tuple(snapshot.tokens), rows, self._last_done())
        if self.below is not None and len(resident) < whole:  # the rest from the device
            self.below.write_behind(namespace, snapshot)

    def _copy_out(self, snapshot: SegmentedSnapshot, staged: list[tuple[int, int]]):
        """Copy the staged blocks' rows into their slots; on CUDA an event for when that is done."""
        if not staged:
            return None
        if not self.cuda:
            for depth, i in staged:
                k, v = snapshot.read_rows(depth * BLOCK_TOKENS, (depth + 1) * BLOCK_TOKENS)
                hk, hv = self.pool.rows(i)
                host_copy(hk, k)  # not torch's copy: its thread pool competes with compute
                host_copy(hv, v)
            return None
        made = torch.cuda.Event()
        made.record()  # after the kernels that wrote these rows, on the compute stream
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(made)
            for depth, i in staged:
                k, v = snapshot.read_rows(depth * BLOCK_TOKENS, (depth + 1) * BLOCK_TOKENS)
                hk, hv = self.pool.rows(i)
                hk.copy_(k, non_blocking=True)  # device -> pinned host
                hv.copy_(v, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._inflight.append((done, snapshot, [i for _, i in staged]))  # segments outlive the copy
        return done

    def _last_done(self):
        """An event after every copy into RAM so far (they share one stream), None when all passed."""
        return self._inflight[-1][0] if self._inflight else None

    def _place(self, i: int, key: str, parent: str) -> None:
        self._slots[i] = _Slot(key, parent, self._clock)
        self._by_key[key] = i
        self._leaves.add(i)
        up = self._by_key.get(parent)
        if up is not None:
            self._slots[up].children += 1
            self._leaves.discard(up)

    def _take(self, keep: set[int]) -> int | None:
        """A free slot, else the least recently used leaf that nothing needs (evicted); None if none."""
        if self._free:
            return self._free.pop()
        below = self.below
        victims = sorted((self._slots[i].last_used, i) for i in self._leaves if i not in keep)
        for _, i in victims:
            slot = self._slots[i]
            if slot.pins or slot.ready is not None or (below is not None and below.queued(slot.key)):
                continue
            self._evict(i)
            return i
        return None

    def _evict(self, i: int, counted: bool = True) -> None:
        slot = self._slots.pop(i)
        del self._by_key[slot.key]
        self._leaves.discard(i)
        up = self._by_key.get(slot.parent)
        if up is not None:
            self._slots[up].children -= 1
            if self._slots[up].children == 0:
                self._leaves.add(up)
        self.stats.evictions += counted

    # -- restore ----------------------------------------------------------------------------------
    def extend(
        self, namespace: str, tokens: Sequence[int], prefix: SegmentedSnapshot | None
    ) -> SegmentedSnapshot | None:
        """``prefix`` (cut to a block boundary) plus the run of blocks RAM holds after it, when that
        covers more rows than ``prefix``; otherwise None (``tokens``: the rows that may be restored)."""
        have = prefix.num_tokens if prefix is not None else 0
        whole = len(tokens) // BLOCK_TOKENS
        if whole * BLOCK_TOKENS <= have:
            return None
        first = have // BLOCK_TOKENS
        keys = block_keys(self.context, namespace, tokens, whole)
        with self._lock:
            self._reap()
            run = []
            for key in keys[first:]:
                i = self._by_key.get(key)
                if i is None:
                    break
                run.append(i)
            if (first + len(run)) * BLOCK_TOKENS <= have:
                self.stats.misses += 1
                return None
            self._clock += 1
            for i in run:  # pinned: no eviction takes them until their copy is done
                self._slots[i].pins += 1
                self._slots[i].last_used = self._clock
            filling = {id(e): e for i in run if (e := self._slots[i].ready) is not None}  # mirrors in flight
        lo = first * BLOCK_TOKENS
        try:
            seg = self._copy_in(run, tuple(tokens[lo : lo + len(run) * BLOCK_TOKENS]), list(filling.values()))
        except Exception as exc:  # no device memory for the rows, a CUDA error: recompute them
            with self._lock:
                self._unpin(run)
                self.stats.misses += 1
            self._warn(f"a restore from RAM failed ({type(exc).__name__}: {exc}); its rows are recomputed")
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.hit_tokens += seg.num_rows
        base = prefix.prefix(lo).refs if prefix is not None else ()
        return SegmentedSnapshot((*base, SegmentRef(seg, seg.num_rows)))

    def _copy_in(self, run: list[int], tokens: tuple[int, ...], filling: list | None = None) -> Segment:
        """Slots ``run`` as one segment on the device; unpins them once the copy is done.
        ``filling``: the events of mirrors still copying into those slots (CUDA)."""
        s = self.shape
        dims = (s.num_layers, s.num_kv_heads, len(run) * BLOCK_TOKENS, s.head_dim)  # [L, Hkv, rows, D]
        if not self.cuda:
            k = torch.empty(dims, dtype=s.dtype, device=s.device)
            v = torch.empty_like(k)
            nbytes = 2 * k.nbytes
            t0 = time.perf_counter()
            for j, i in enumerate(run):
                lo = j * BLOCK_TOKENS
                hk, hv = self.pool.rows(i)
                host_copy(k[:, :, lo : lo + BLOCK_TOKENS], hk)
                host_copy(v[:, :, lo : lo + BLOCK_TOKENS], hv)
            with self._lock:
                self._unpin(run)
                self.stats.restore_bytes += nbytes
                self.stats.restore_s += time.perf_counter() - t0
            return Segment(k, v, tokens)
        compute = torch.cuda.current_stream()
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._restore):
            # allocated on the restore stream: the allocator never hands it memory the compute
            # stream freed, so the copy need not wait for the steps in flight (a prefill)
            k = torch.empty(dims, dtype=s.dtype, device=s.device)
            v = torch.empty_like(k)
            nbytes = 2 * k.nbytes
            for ev in filling or ():  # a mirror still filling one of these slots
                self._restore.wait_event(ev)
            start.record(self._restore)
            for j, i in enumerate(run):
                lo = j * BLOCK_TOKENS
                hk, hv = self.pool.rows(i)
                copy_block(k[:, :, lo : lo + BLOCK_TOKENS], hk, self._restore)  # pinned -> device
                copy_block(v[:, :, lo : lo + BLOCK_TOKENS], hv, self._restore)
            done.record(self._restore)
        k.record_stream(compute)  # read by the steps: freed only after the compute stream's work
        v.record_stream(compute)
        with self._lock:
            self._releasing.append((done, run, start, nbytes))
        # the compute stream joins the copy only when a step first reads these rows: the scheduler
        # keeps the turn out of steps while ``done`` is pending, so the others' steps overlap it
        return Segment(k, v, tokens, ready=done)

    def _warn(self, message: str) -> None:
        """Once per kind of failure (the first words), then debug: serving goes on either way."""
        kind = message.split("(")[0]
        (log.debug if kind in self._warned else log.warning)("KV RAM tier: %s", message)
        self._warned.add(kind)

    def _unpin(self, run: list[int]) -> None:
        for i in run:
            slot = self._slots.get(i)
            if slot is not None:
                slot.pins -= 1

    def _reap(self, wait: bool = False) -> None:
        """Finish the bookkeeping of copies that are done (``wait``: wait for all of them)."""
        while self._inflight and (wait or self._inflight[0][0].query()):
            ev, _, filled = self._inflight.pop(0)
            ev.synchronize()
            for i in filled:
                slot = self._slots.get(i)
                if slot is not None and slot.ready is ev:
                    slot.ready = None
        keep = []
        for item in self._releasing:
            done, run, start, nbytes = item
            if wait or done.query():
                done.synchronize()
                self._unpin(run)
                self.stats.restore_bytes += nbytes
                self.stats.restore_s += start.elapsed_time(done) / 1000
            else:
                keep.append(item)
        self._releasing = keep

    # -- the Tier protocol's rest -------------------------------------------------------------------
    def held(self) -> list[SegmentedSnapshot]:
        """Snapshots whose rows are still being copied into RAM (the bank counts them)."""
        with self._lock:
            self._reap()
            return [snap for _, snap, _ in self._inflight]

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            self._reap(wait=True)
        return True

    def close(self) -> None:
        self.pool.close()
        self.flush()

    def health(self) -> dict:
        """``/health.ram``: ``enabled``, the counters of ``RAM_KEYS`` and the restore rate."""
        with self._lock:
            self._reap()
            facts = asdict(self.stats) | {"blocks": len(self._slots), "capacity_blocks": self.capacity}
        facts |= {"bytes": facts["blocks"] * self.block_bytes, "budget_bytes": self.budget_bytes}
        rate = facts["restore_bytes"] / facts["restore_s"] / 1e9 if facts["restore_s"] > 0 else 0.0
        return {"enabled": True, "reason": self.pool.grow_failed, "restore_gbps": round(rate, 3)} | {
            k: int(facts[k]) for k in RAM_KEYS
        }

    def resident(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many leading whole blocks of ``tokens`` RAM holds (tests, benches)."""
        keys = block_keys(self.context, namespace, tokens)
        with self._lock:
            return next((d for d, key in enumerate(keys) if key not in self._by_key), len(keys))

"""The disk tier behind the session bank: finished turns written behind, restored after a restart.

The bank calls these methods (see ``SessionBank.tier``; on a server through ``bank.tiers.TierChain``):

- ``write_behind(namespace, snapshot)`` at the end of every turn. The snapshot's whole blocks of
  256 tokens that the store lacks are queued for the writer threads (``WRITERS``), which copy
  their rows to the host (a side stream on CUDA; segments are immutable, so reading them from
  another thread is safe) and write them in batches: a batch's files written and fsynced
  together, then its index rows in one transaction (``LocalDirStore.put_many``, ``disk_files``).
  It never blocks: when the bounded queue is full the blocks that do not fit are dropped and
  counted (``dropped_writes``, logged at most once a minute). Blocks the store already holds are
  not written again (``dedupe_hits``).
- ``write_host(namespace, tokens, rows, copied)`` instead, when the host-RAM tier (``bank.ram``)
  stands in front: the rows are already in host memory (RAM's pinned slots, filled once
  ``copied`` has passed), so the writer copies nothing from the device; RAM keeps those slots
  while ``queued(key)`` says they wait, so these blocks are bounded by RAM's budget, not the queue.
- ``extend(namespace, tokens, prefix)`` at admission, after the memory lookup. When the store
  holds a longer run of this namespace's blocks for ``tokens`` than ``prefix`` covers, the run is
  loaded into one sealed segment (each block verified; a bad one ends the run, is deleted and
  counted in ``corrupt``) and the bank gets ``prefix`` cut to a block boundary plus that segment.
  The run's keys are pinned from the lookup to the end of the load, so the writer's eviction
  (``--disk-bytes``) never takes a block a restore has found; a block deleted under the restore
  all the same (its file removed by hand, another reader found it bad) ends the run as a miss,
  counted in ``vanished``, not ``corrupt``.

Block keys (``disk_blocks``) chain the model fingerprint, the KV dtype and geometry, the
namespace and every token id before a block's end, so a block is found only by a request of the
same model, dtype and namespace whose tokens agree with it up to the block's last row.

Failures never reach a request: an unusable directory disables the tier at start (logged), a
write error is counted in ``write_failures`` and logged once, a bad block is a miss. A store call
that raises at run time (a damaged ``index.sqlite``, an I/O error) is a miss too: the lookup
finds nothing (the prompt is recomputed) and a write behind is dropped; each is counted in
``faults``, ``/health.disk.degraded`` gives the reason until a lookup goes through the store again,
and one warning is logged when the tier becomes degraded.

Under tensor parallelism every rank has a tier of its own (its KV heads' shard of the same
blocks, in a directory of its own) and every rank's bank must decide alike, so ``agree`` (the
minimum over ranks) is set: a restore takes the run of blocks that every rank holds and read
intact, and a queued write starts copying its rows to host memory at once (on CUDA on a stream
of its own: ``_copy_now``) instead of holding the snapshot until the writer gets to it (what a
queued write holds would otherwise depend on when each rank's writer finishes, and the bank
counts it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from turnkv.bank.disk_blocks import (
    BLOCK_TOKENS,
    ROOT_KEY,
    Block,
    BlockError,
    block_context,
    block_keys,
    host_copy,
)
from turnkv.bank.disk_log import EveryMinute
from turnkv.bank.disk_store import BlockGone, BlockStore, LocalDirStore
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef

log = logging.getLogger(__name__)

QUEUE_BLOCKS = 256  # blocks waiting for the writer at most (each keeps its segments alive)
# the writer: blocks made durable together (one round of fsyncs and one index commit per batch,
# up to BATCH_BYTES of files) by WRITERS threads (one encodes and hashes while another waits for
# its fsyncs); docs/DISK.md, "The writer", and bench/disk_write.py measure the choice
BATCH_BYTES = 128 << 20
WRITERS = max(1, min(4, (os.cpu_count() or 2) // 4))  # 1 on 2 cores: there hashing is the limit
# readers verifying blocks in parallel (hashing and numpy copies run without the GIL); SHA-256 of
# one block is one core's work, so a restore scales with the cores up to here
LOAD_THREADS = max(2, min(16, os.cpu_count() or 2))
DISK_KEYS = (
    "blocks",
    "bytes",
    "budget_bytes",
    "queued",
    "writes",
    "write_failures",
    "dropped_writes",
    "hits",
    "misses",
    "hit_tokens",
    "corrupt",
    "vanished",
    "evictions",
    "dedupe_hits",
    "faults",
)


def default_disk_dir() -> Path:
    """``$XDG_CACHE_HOME/turnkv/kv``, else ``~/.cache/turnkv/kv``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "turnkv" / "kv"


def disk_dir(directory: str | os.PathLike | None) -> Path:
    """The directory ``--disk-dir`` names (``~`` expanded), or ``default_disk_dir()``."""
    return Path(directory).expanduser() if directory else default_disk_dir()


def disabled_health() -> dict:
    """``/health.disk`` without a tier: ``enabled: false``, nothing degraded and zeros."""
    return {"enabled": False, "degraded": None, "restore_gbps": 0.0, **dict.fromkeys(DISK_KEYS, 0)}


@dataclass
class DiskStats:
    writes: int = 0  # blocks written
    write_failures: int = 0  # blocks whose write failed (disk full, I/O error)
    dropped_writes: int = 0  # blocks not queued because the queue was full
    hits: int = 0  # admissions the tier extended
    misses: int = 0  # admissions with whole blocks beyond memory that the tier could not extend
    hit_tokens: int = 0  # rows loaded from disk into admitted turns
    corrupt: int = 0  # blocks whose bytes failed verification (checksum, truncated, foreign), removed
    vanished: int = 0  # blocks looked up and gone by their read (file or row deleted): a clean miss
    evictions: int = 0  # blocks removed for the byte budget
    dedupe_hits: int = 0  # blocks not written because the store already held them
    faults: int = 0  # store calls that raised at run time: each lookup a miss, each write dropped
    restore_bytes: int = 0  # bytes of the restores that loaded rows ...
    restore_s: float = 0.0  # ... and their time (lookup, reads, checks, the copies' launch)


@dataclass(eq=False)  # identity: a job is one queued turn
class _Job:
    snapshot: SegmentedSnapshot | None
    tokens: tuple[int, ...]  # the snapshot's token ids (kept when ``host`` replaces the snapshot)
    blocks: list[tuple[int, str, str]]  # (depth, key, parent key)
    at: float  # when the turn finished: the blocks' last access
    ready: object | None = None  # a CUDA event recorded after the rows were made
    host: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # depth -> rows copied at queue time
    copied: object | None = None  # a CUDA event recorded after those copies (on the queue stream)
    device: list | None = None  # the device rows being copied, kept alive until ``copied``
    taken: int = 0  # blocks handed to writers
    left: int = 0  # blocks not yet written (or failed, or dropped)


@dataclass
class DiskTier:
    """Write-behind and restore of 256-token blocks in a :class:`BlockStore`; thread-safe."""

    store: BlockStore
    fingerprint: str
    shape: KVShape
    budget_bytes: int
    queue_blocks: int = QUEUE_BLOCKS
    load_threads: int = LOAD_THREADS
    writers: int = WRITERS
    batch_blocks: int | None = None  # blocks per batch (None: BATCH_BYTES' worth; 1: one per fsync)
    stats: DiskStats = field(default_factory=DiskStats)
    name = "disk"
    # tensor parallelism: the minimum of a count over every rank (a collective that every rank's
    # bank reaches at the same admission); see the module docstring
    agree: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        self.context = block_context(self.fingerprint, self.shape)
        self._cv = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._running: list[_Job] = []  # jobs whose blocks writers have taken, not all written
        self._queued = 0  # blocks queued or being written
        self._pending: set[str] = set()  # their keys
        self._closing = False
        self._abandon = False  # close() timed out: drop what is still queued
        self._warned: set[str] = set()
        self._every = EveryMinute(log)  # warnings that could repeat per block
        self.degraded: str | None = None  # why the last store call raised (None: the store answers)
        self._pool: ThreadPoolExecutor | None = None
        self._stream = None  # the queue-time copies' CUDA stream (tensor parallelism)
        block = BLOCK_TOKENS * self.shape.bytes_per_row
        self._batch = self.batch_blocks or max(1, BATCH_BYTES // block)
        self._writers = [
            threading.Thread(target=self._write_loop, name=f"turnkv-disk-writer-{i}", daemon=True)
            for i in range(max(1, self.writers))
        ]
        for t in self._writers:
            t.start()

    @classmethod
    def open(
        cls, where: str | os.PathLike | BlockStore, fingerprint: str, shape: KVShape, budget_bytes: int, **kw
    ):
        """A tier over ``where`` (a ``BlockStore``, or a directory: ``LocalDirStore``), reconciled
        and fitted to ``budget_bytes``. Raises ``StoreBusy`` or ``OSError``/``sqlite3.Error`` for a
        directory it cannot use. A store that fails its first eviction (a Redis that does not
        answer) still opens, degraded: its calls are faults until it answers."""
        store = where if hasattr(where, "get") else LocalDirStore(where)
        fixed = store.reconcile()
        tier = cls(store, fingerprint, shape, budget_bytes, **kw)
        tier.stats.corrupt += fixed["bad_size"]
        tier.stats.vanished += fixed["missing_files"]
        try:
            tier.stats.evictions += store.evict(budget_bytes)
        except Exception as exc:
            tier._fault("the store at start", exc)
        if any(fixed.values()):
            log.warning("KV disk cache %s reconciled at start: %s", where, fixed)
        return tier

    # -- restore ----------------------------------------------------------------------------------
    def extend(
        self, namespace: str, tokens: Sequence[int], prefix: SegmentedSnapshot | None
    ) -> SegmentedSnapshot | None:
        """``prefix`` (cut to a block boundary) plus the longest run of stored blocks of ``tokens``
        after it, when that covers more rows than ``prefix``; otherwise None.

        ``tokens`` are the rows that may be restored (the bank passes the prompt without its last
        token); ``prefix`` holds the first rows of ``tokens`` (from memory) or is None.
        """
        have = prefix.num_tokens if prefix is not None else 0
        whole = len(tokens) // BLOCK_TOKENS
        if whole * BLOCK_TOKENS <= have:
            return None  # memory already holds every whole block
        first = have // BLOCK_TOKENS
        keys = block_keys(self.context, namespace, tokens, whole)
        faults = self.stats.faults
        t0 = time.perf_counter()
        with self.store.pinned(keys[first:]):  # eviction keeps off what the lookup finds
            seg = self._restore(keys, first, have, tokens)
        took = time.perf_counter() - t0
        if self.stats.faults == faults:
            self._answers()
        with self._cv:  # restores may run on several threads
            if seg is None or first * BLOCK_TOKENS + seg.num_rows <= have:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.hit_tokens += seg.num_rows
            self.stats.restore_bytes += seg.nbytes
            self.stats.restore_s += took
        base = prefix.prefix(first * BLOCK_TOKENS).refs if prefix is not None else ()
        return SegmentedSnapshot((*base, SegmentRef(seg, seg.num_rows)))

    def _restore(self, keys: list[str], first: int, have: int, tokens: Sequence[int]) -> Segment | None:
        """The run of stored blocks ``keys[first:]`` that every rank holds, loaded; None if none."""
        run = 0
        try:
            while first + run < len(keys) and self.store.has(keys[first + run]):
                run += 1
        except Exception as exc:  # a damaged index: a miss (the ranks still agree below)
            self._fault("an index lookup", exc)
            run = 0
        run = run if self.agree is None else self.agree(run)
        if (first + run) * BLOCK_TOKENS <= have:
            return None
        seg = None
        parent = keys[first - 1] if first else ROOT_KEY
        try:
            seg = self.load(keys[first : first + run], parent, tokens, first)
        except Exception as exc:  # out of memory for the rows, a broken index: recompute
            self._fault("a restore", exc)
        if self.agree is not None:
            seg = _cut(seg, self.agree(seg.num_rows // BLOCK_TOKENS if seg is not None else 0))
        return seg

    def load(self, keys: Sequence[str], parent: str, tokens: Sequence[int], first: int) -> Segment | None:
        """Blocks ``keys`` (depths ``first``, ``first + 1``, ...) as one segment on the KV device,
        each verified against its file's checksum and against ``tokens``; stops before the first
        bad block (deleted, counted) or gone one (counted). None when not even the first is good."""
        s = self.shape
        n = len(keys)
        if n == 0:
            return None
        rows = n * BLOCK_TOKENS
        k = torch.empty((s.num_layers, s.num_kv_heads, rows, s.head_dim), dtype=s.dtype, device=s.device)
        v = torch.empty_like(k)  # [L, Hkv, rows, D]
        cuda = torch.device(s.device).type == "cuda"
        pool = self._readers()
        window = max(2, 2 * self.load_threads)  # blocks read ahead of the copy (bounded memory)
        futures: dict[int, Future] = {}
        good = 0

        def rows(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            lo = i * BLOCK_TOKENS
            return k[:, :, lo : lo + BLOCK_TOKENS], v[:, :, lo : lo + BLOCK_TOKENS]  # [L, Hkv, 256, D]

        try:
            for i in range(n):
                for j in range(i, min(n, i + window)):
                    if j not in futures:  # on a CPU device straight into the segment, else pinned memory
                        futures[j] = pool.submit(self.store.get, keys[j], cuda, None if cuda else rows(j))
                try:
                    block = futures.pop(i).result()
                    self._check(block, keys[i], keys[i - 1] if i else parent, first + i, tokens)
                except BlockGone:  # deleted since the lookup: a miss from here on
                    self._vanished(keys[i])
                    break
                except BlockError as exc:
                    self._corrupt(keys[i], exc)
                    break
                except Exception as exc:  # the store itself failed (index, I/O): the run ends here
                    self._fault("a block read", exc)
                    break
                if cuda:
                    dst_k, dst_v = rows(i)
                    dst_k.copy_(block.k, non_blocking=True)  # pinned host -> device
                    dst_v.copy_(block.v, non_blocking=True)
                good += 1
        finally:
            for fut in futures.values():  # reads still running write rows past the good ones: let them end
                if not fut.cancel():
                    fut.exception()
        if good == 0:
            return None
        self.store.touch(keys[:good])
        if good < n:  # keep only the good rows' memory
            k = k[:, :, : good * BLOCK_TOKENS].clone()
            v = v[:, :, : good * BLOCK_TOKENS].clone()
        lo = first * BLOCK_TOKENS
        return Segment(k, v, tuple(tokens[lo : lo + good * BLOCK_TOKENS]))

    def _check(self, block: Block, key: str, parent: str, depth: int, tokens: Sequence[int]) -> None:
        """What the file's own checksum cannot vouch for: that it is this request's block."""
        s = self.shape
        lo = depth * BLOCK_TOKENS
        want_shape = (s.num_layers, s.num_kv_heads, BLOCK_TOKENS, s.head_dim)
        if block.context != self.context or block.parent != parent or block.depth != depth:
            raise BlockError(f"block {key[:12]} belongs to another chain or model")
        if block.k.dtype != s.dtype or tuple(block.k.shape) != want_shape:
            raise BlockError(f"block {key[:12]} holds {block.k.dtype} {list(block.k.shape)}")
        if list(block.tokens) != list(tokens[lo : lo + BLOCK_TOKENS]):
            raise BlockError(f"block {key[:12]} holds other token ids")

    def _corrupt(self, key: str, exc: BlockError) -> None:
        with self._cv:
            self.stats.corrupt += 1
        log.warning("KV disk cache: dropped a bad block (%s); recomputing its rows", exc)
        self._drop(key, "deleting a bad block")

    def _vanished(self, key: str) -> None:
        with self._cv:
            self.stats.vanished += 1
        self._every.note(
            "vanished",
            "KV disk cache: %d block(s) deleted between a restore's lookup and its read (removed "
            "from the directory meanwhile); their rows were recomputed (disk.vanished; at most one "
            "line a minute)",
        )
        self._drop(key, "dropping a vanished block's row")  # its row may outlive a removed file

    def _drop(self, key: str, what: str) -> None:
        try:
            self.store.delete(key)
        except Exception as err:  # the index itself failing: the block stays a miss
            self._fault(what, err)

    def _readers(self) -> ThreadPoolExecutor:
        with self._cv:  # restores may run on several threads: one pool
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.load_threads, thread_name_prefix="turnkv-disk-read")
            return self._pool

    # -- write-behind -----------------------------------------------------------------------------
    def write_behind(self, namespace: str, snapshot: SegmentedSnapshot) -> None:
        """Queue the whole blocks of ``snapshot`` that the store lacks; never waits for the disk.
        The writer copies their rows from the device (without a RAM tier to feed it)."""
        whole = snapshot.num_tokens // BLOCK_TOKENS
        if whole == 0 or self._closing:
            return
        keys = block_keys(self.context, namespace, snapshot.tokens, whole)
        now = time.time()
        with self._cv:
            todo, present = self._lacking(keys)
            if todo is None:
                return
            room = max(self.queue_blocks - self._queued, 0)
            if len(todo) > room:  # keep the chain's head: later blocks need it
                self.stats.dropped_writes += len(todo) - room
                self._every.note(
                    "queue",
                    f"KV disk cache: write queue full ({self.queue_blocks} blocks): %d block write(s) "
                    f"dropped (disk.dropped_writes; at most one line a minute)",
                    len(todo) - room,
                )
                todo = todo[:room]
            if todo:
                job = _Job(snapshot, tuple(snapshot.tokens), todo, now, self._cuda_event())
                if self.agree is not None:  # rows to host memory now (see the module docstring)
                    self._copy_now(job, [d for d, _, _ in todo])
                self._enqueue(job)
        self._touch_present(present, now)

    def write_host(
        self,
        namespace: str,
        tokens: tuple[int, ...],
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]],
        copied: object | None = None,
    ) -> None:
        """Queue blocks whose rows are already in host memory (the RAM tier's slots): ``rows`` maps
        depth -> ``(k, v)`` ``[L, Hkv, 256, D]`` for the leading blocks of ``tokens``; ``copied``:
        a CUDA event after which they hold the rows (None: they do now). No copy from the device
        and no queue bound: the RAM tier keeps those slots until ``queued`` says they are written,
        so what waits is bounded by RAM's budget."""
        if not rows or self._closing:
            return
        keys = block_keys(self.context, namespace, tokens, len(rows))
        now = time.time()
        with self._cv:
            todo, present = self._lacking(keys)
            if todo:
                host = {d: rows[d] for d, _, _ in todo}
                self._enqueue(_Job(None, tokens, todo, now, host=host, copied=copied))
        self._touch_present(present or [], now)

    def queued(self, key: str) -> bool:
        """Whether block ``key`` is queued or being written (its host rows must stay put)."""
        with self._cv:
            return key in self._pending

    def _lacking(self, keys: list[str]) -> tuple[list[tuple[int, str, str]] | None, list[str]]:
        """(blocks of ``keys`` neither queued nor stored as (depth, key, parent), keys present);
        todo is None when the index failed (the write is dropped, counted in ``faults``)."""
        todo: list[tuple[int, str, str]] = []
        present = []
        try:
            for depth, key in enumerate(keys):
                if key in self._pending or self.store.has(key):
                    present.append(key)
                else:
                    todo.append((depth, key, keys[depth - 1] if depth else ROOT_KEY))
        except Exception as exc:  # a damaged index: this write is dropped, the turn unharmed
            self._fault("an index lookup before a write", exc)
            return None, []
        self.stats.dedupe_hits += len(present)
        return todo, present

    def _enqueue(self, job: _Job) -> None:
        job.left = len(job.blocks)
        self._jobs.append(job)
        self._queued += len(job.blocks)
        self._pending.update(key for _, key, _ in job.blocks)
        self._cv.notify_all()

    def _touch_present(self, present: list[str], now: float) -> None:
        if present:
            try:
                self.store.touch(present, now)
            except Exception as exc:
                self._fault("marking blocks used", exc)

    def held(self) -> list[SegmentedSnapshot]:
        """Snapshots that queued writes keep alive (the bank counts their memory)."""
        with self._cv:
            jobs = [*self._jobs, *self._running]
            return [j.snapshot for j in jobs if j.snapshot is not None]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or failed); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._queued == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (up to ``timeout`` seconds), stop the threads, close the store."""
        done = self.flush(timeout)
        with self._cv:
            self._closing = True
            self._abandon = not done
            self._cv.notify_all()
        for t in self._writers:
            t.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.store.close()

    def _copy_now(self, job: _Job, depths: list[int]) -> None:
        """Start copying blocks ``depths`` of ``job``'s snapshot to host memory and drop the
        snapshot from the job (tensor parallelism: the bank then counts nothing for it).

        On CUDA the copies run on a stream of their own, ordered after the kernels that made the
        rows; the engine thread only launches them and the writer waits for ``copied`` (made on
        the engine thread's stream and waited for, they stalled every running turn at each
        turn's end: docs/PARALLEL.md). The device rows stay referenced until the copies are done,
        so their memory is not reused under them (for the copy's duration, no bank counts it)."""
        snapshot = job.snapshot
        assert snapshot is not None
        job.snapshot = None
        rows = {d: snapshot.read_rows(d * BLOCK_TOKENS, (d + 1) * BLOCK_TOKENS) for d in depths}
        if job.ready is None:  # rows on a CPU: copies of their own, now
            job.host = {d: (k.clone(), v.clone()) for d, (k, v) in rows.items()}
            return
        made = torch.cuda.Event()
        made.record()  # after read_rows' own gathers, on the caller's stream
        if self._stream is None:
            self._stream = torch.cuda.Stream(torch.device(self.shape.device))
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(made)
            job.host = {d: (_pinned(k), _pinned(v)) for d, (k, v) in rows.items()}
            job.copied = torch.cuda.Event()
            job.copied.record(self._stream)
        job.device = list(rows.values())

    def _cuda_event(self):
        if torch.device(self.shape.device).type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()  # after the kernels that made these rows, on the caller's stream
        return ev

    def _write_loop(self) -> None:
        stream = None
        device = torch.device(self.shape.device)
        if device.type == "cuda":
            try:
                if device.index is not None:
                    torch.cuda.set_device(device)
                stream = torch.cuda.Stream()  # device -> host copies beside, not behind, decode
            except Exception as exc:  # every write will then fail and be counted; none hangs
                self._warn_once("stream", f"KV disk cache: no CUDA stream for writes: {exc}")
        while (batch := self._take()) is not None:
            self._write_batch(batch, stream)

    def _take(self) -> list[tuple[_Job, int, str, str]] | None:
        """Up to a batch of queued blocks, in queue order across jobs; None once closing and empty."""
        with self._cv:
            self._cv.wait_for(lambda: self._jobs or self._closing)
            batch: list[tuple[_Job, int, str, str]] = []
            while self._jobs and len(batch) < self._batch:
                job = self._jobs[0]
                n = min(len(job.blocks) - job.taken, self._batch - len(batch))
                batch += [(job, *b) for b in job.blocks[job.taken : job.taken + n]]
                if job.taken == 0:
                    self._running.append(job)
                job.taken += n
                if job.taken == len(job.blocks):
                    self._jobs.popleft()
            return batch or None

    def _write_batch(self, batch: list[tuple[_Job, int, str, str]], stream) -> None:
        """Write ``batch`` as one durable batch (``LocalDirStore.put_many``), then evict once."""
        outcome: dict[str, str] = {}  # key -> the stats counter it ends in
        blocks: list[tuple[Block, float]] = []
        try:
            for job in dict.fromkeys(job for job, _, _, _ in batch):
                if job.copied is not None:  # the queue-time copies (``_copy_now``) are done
                    job.copied.synchronize()
                    job.device = None
            for job, depth, key, parent in batch:
                if self._abandon:
                    outcome[key] = "dropped_writes"
                elif key in outcome or self.store.has(key):  # an earlier job wrote it meanwhile
                    outcome.setdefault(key, "dedupe_hits")
                else:
                    k, v = (
                        job.host.pop(depth) if job.host is not None else self._host_rows(job, depth, stream)
                    )
                    lo = depth * BLOCK_TOKENS
                    blocks.append(
                        (
                            Block(key, parent, self.context, depth, job.tokens[lo : lo + BLOCK_TOKENS], k, v),
                            job.at,
                        )
                    )
                    outcome[key] = "writes"
            if blocks:
                self.store.put_many([b for b, _ in blocks], [at for _, at in blocks])
                evicted = self.store.evict(self.budget_bytes)
                with self._cv:
                    self.stats.evictions += evicted
        except Exception as exc:  # disk full, I/O error, a closed store: serving goes on
            for b, _ in blocks:
                outcome[b.key] = "write_failures"
            for _, _, key, _ in batch:
                outcome.setdefault(key, "write_failures")
            self._warn_once(
                "write",
                f"KV disk cache: a block write failed ({type(exc).__name__}: {exc}); turns are "
                f"still served, later failures are only counted (disk.write_failures)",
            )
        finally:
            blocks.clear()
            with self._cv:
                for job, _, key, _ in batch:
                    name = outcome.get(key, "write_failures")
                    setattr(self.stats, name, getattr(self.stats, name) + 1)
                    self._queued -= 1
                    self._pending.discard(key)
                    job.left -= 1
                    if job.left == 0:  # release the rows before anyone sees an empty queue
                        job.snapshot = job.host = None
                        self._running.remove(job)
                self._cv.notify_all()

    def _host_rows(self, job: _Job, depth: int, stream) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of block ``depth`` as contiguous CPU tensors ``[L, Hkv, 256, D]``."""
        assert job.snapshot is not None
        lo = depth * BLOCK_TOKENS
        if stream is None:
            k, v = job.snapshot.read_rows(lo, lo + BLOCK_TOKENS)
            hk, hv = torch.empty(k.shape, dtype=k.dtype), torch.empty(v.shape, dtype=v.dtype)
            host_copy(hk, k)  # not torch's copy: its thread pool would compete with decode
            host_copy(hv, v)
            return hk, hv
        with torch.cuda.stream(stream):
            stream.wait_event(job.ready)
            k, v = job.snapshot.read_rows(lo, lo + BLOCK_TOKENS)
            hk, hv = _pinned(k), _pinned(v)
            stream.synchronize()
        return hk, hv

    # -- reporting --------------------------------------------------------------------------------
    def health(self) -> dict:
        """``/health.disk``: ``enabled`` and the counters of ``DISK_KEYS``."""
        with self._cv:
            facts = asdict(self.stats) | {"queued": self._queued}
        facts |= {"blocks": self.store.count, "bytes": self.store.nbytes, "budget_bytes": self.budget_bytes}
        rate = facts["restore_bytes"] / facts["restore_s"] / 1e9 if facts["restore_s"] > 0 else 0.0
        return {"enabled": True, "degraded": self.degraded, "restore_gbps": round(rate, 3)} | {
            k: int(facts[k]) for k in DISK_KEYS
        }

    def _fault(self, what: str, exc: BaseException) -> None:
        """A store call raised: its caller takes it as a miss (or drops the write). Counted, the
        reason on ``/health.disk.degraded``, one warning when the tier becomes degraded."""
        reason = f"{what} failed: {type(exc).__name__}: {exc}"
        with self._cv:
            self.stats.faults += 1
            first, self.degraded = self.degraded is None, reason
        if first:
            log.warning(
                "KV disk cache degraded: %s; lookups are misses (prompts are recomputed) and writes "
                "are dropped while the store fails (disk.degraded, disk.faults)",
                reason,
            )
        else:
            log.debug("KV disk cache: %s", reason)

    def _answers(self) -> None:
        """A lookup went through the store without a fault: it is no longer degraded."""
        if self.degraded is not None:
            with self._cv:
                self.degraded = None
            log.warning("KV disk cache: the store answers again; no longer degraded")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind in self._warned:
            log.debug(message)
            return
        self._warned.add(kind)
        log.warning(message)


def open_tier(
    directory: str | os.PathLike | None,
    fingerprint: str,
    shape: KVShape,
    budget_bytes: int,
    store: str = "",
    suffix: str = "",
    **kw,
) -> DiskTier | None:
    """``DiskTier.open`` for the server over ``--disk-store`` (``shared_stores.open_store``; ``""``:
    this process's ``--disk-dir``): a store it cannot use disables the tier (one warning)."""
    try:
        if store:
            from turnkv.bank.shared_stores import open_store

            where = open_store(store, suffix)
        else:
            where = disk_dir(directory)
        return DiskTier.open(where, fingerprint, shape, budget_bytes, **kw)
    except Exception as exc:  # busy, unwritable, not a directory, a broken index
        log.warning("KV disk cache disabled: %s (%s)", exc, type(exc).__name__)
        return None


def rank_dir(directory: str | os.PathLike | None, size: int, rank: int | str) -> Path:
    """The disk tier of rank ``rank`` of a tensor-parallel group of ``size`` under ``--disk-dir``
    (each rank holds its KV heads' shard of every block; ``rank`` "*" names them all)."""
    return disk_dir(directory) / f"tp{size}-rank{rank}"


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A copy of device rows ``t`` into pinned host memory, started on the current stream (torch
    caches pinned blocks; a pageable copy is far slower: docs/PARALLEL.md)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _cut(seg: Segment | None, blocks: int) -> Segment | None:
    """``seg``'s first ``blocks`` blocks (a copy, so the rest's memory goes), None for none."""
    if seg is None or blocks == 0:
        return None
    rows = blocks * BLOCK_TOKENS
    if rows == seg.num_rows:
        return seg
    return Segment(seg.k[:, :, :rows].clone(), seg.v[:, :, :rows].clone(), seg.tokens[:rows])

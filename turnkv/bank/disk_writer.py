"""The disk tier's write-behind: a bounded queue of finished turns' blocks and the writer threads
(``DiskWriter``, a part of ``bank.disk.DiskTier``; the tier's state lives there).

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

Both are called on the engine thread, which must never wait for the disk: there the store is
only asked ``has`` (``LocalDirStore`` answers from memory), and the blocks found already stored
are marked used by the writer threads (``touch``: an index write that could wait behind a
writer's transaction or a WAL checkpoint, and stalled every running turn while it waited:
docs/BENCHMARKS.md, "A step timeline under load").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from turnkv.bank.disk_blocks import BLOCK_TOKENS, ROOT_KEY, Block, block_keys, host_copy
from turnkv.kv.segments import SegmentedSnapshot

log = logging.getLogger("turnkv.bank.disk")

QUEUE_BLOCKS = 256  # blocks waiting for the writer at most (each keeps its segments alive)
# the writer: blocks made durable together (one round of fsyncs and one index commit per batch,
# up to BATCH_BYTES of files) by WRITERS threads (one encodes and hashes while another waits for
# its fsyncs); docs/DISK.md, "The writer", and bench/disk_write.py measure the choice
BATCH_BYTES = 128 << 20
WRITERS = max(1, min(4, (os.cpu_count() or 2) // 4))  # 1 on 2 cores: there hashing is the limit


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


class DiskWriter:
    """Write-behind for ``DiskTier`` (which holds ``store``, ``stats``, ``_cv`` and the rest)."""

    def _start_writers(self) -> None:
        """The write queue's state and its ``writers`` threads (``DiskTier.__post_init__``)."""
        self._jobs: deque[_Job] = deque()
        self._running: list[_Job] = []  # jobs whose blocks writers have taken, not all written
        self._queued = 0  # blocks queued or being written
        self._pending: set[str] = set()  # their keys
        self._closing = False
        self._abandon = False  # close() timed out: drop what is still queued
        self._stream = None  # the queue-time copies' CUDA stream (tensor parallelism)
        self._touches: list[tuple[list[str], float]] = []  # stored blocks found used, for the writers
        self._applying = 0  # writers applying touches (``flush`` waits for them too)
        block = BLOCK_TOKENS * self.shape.bytes_per_row
        self._batch = self.batch_blocks or max(1, BATCH_BYTES // block)
        self._writers = [
            threading.Thread(target=self._write_loop, name=f"turnkv-disk-writer-{i}", daemon=True)
            for i in range(max(1, self.writers))
        ]
        for t in self._writers:
            t.start()

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
        """Mark ``present`` used at ``now``: on a writer thread (the module docstring)."""
        if present:
            with self._cv:
                self._touches.append((present, now))
                self._cv.notify()

    def _apply_touches(self, touches: list[tuple[list[str], float]]) -> None:
        for keys, at in touches:
            try:
                self.store.touch(keys, at)
            except Exception as exc:
                self._fault("marking blocks used", exc)
        if touches:
            with self._cv:
                self._applying -= 1
                self._cv.notify_all()

    def held(self) -> list[SegmentedSnapshot]:
        """Snapshots that queued writes keep alive (the bank counts their memory)."""
        with self._cv:
            jobs = [*self._jobs, *self._running]
            return [j.snapshot for j in jobs if j.snapshot is not None]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or failed); False on timeout."""
        with self._cv:
            return self._cv.wait_for(
                lambda: self._queued == 0 and not self._touches and not self._applying, timeout
            )

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
        while (taken := self._take()) is not None:
            batch, touches = taken
            self._apply_touches(touches)
            if batch:
                self._write_batch(batch, stream)

    def _take(self) -> tuple[list[tuple[_Job, int, str, str]], list] | None:
        """Up to a batch of queued blocks, in queue order across jobs, and the touches to apply;
        None once closing and nothing is left."""
        with self._cv:
            self._cv.wait_for(lambda: self._jobs or self._touches or self._closing)
            touches, self._touches = self._touches, []
            self._applying += bool(touches)
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
            return (batch, touches) if batch or touches else None

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


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A copy of device rows ``t`` into pinned host memory, started on the current stream (torch
    caches pinned blocks; a pageable copy is far slower: docs/PARALLEL.md)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host

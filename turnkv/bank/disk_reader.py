"""The disk tier's restores: a run of stored blocks loaded, verified and copied into one segment
(``DiskReader``, a part of ``bank.disk.DiskTier``; the tier's state lives there).

- ``extend(namespace, tokens, prefix)`` at admission, after the memory lookup. When the store
  holds a longer run of this namespace's blocks for ``tokens`` than ``prefix`` covers, the run is
  loaded into one sealed segment (each block verified; a bad one ends the run, is deleted and
  counted in ``corrupt``) and the bank gets ``prefix`` cut to a block boundary plus that segment.
  The run's keys are pinned from the lookup to the end of the load, so the writer's eviction
  (``--disk-bytes``) never takes a block a restore has found; a block deleted under the restore
  all the same (its file removed by hand, another reader found it bad) ends the run as a miss,
  counted in ``vanished``, not ``corrupt``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from turnkv.bank.disk_blocks import BLOCK_TOKENS, ROOT_KEY, Block, BlockError, block_keys
from turnkv.bank.disk_store import BlockGone
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef
from turnkv.threads import available_cores

log = logging.getLogger("turnkv.bank.disk")

# readers verifying blocks in parallel (hashing and numpy copies run without the GIL); a block's
# read and checksum are one core's work, so a restore scales with the cores this process may use
# (its affinity and CPU quota, not the host's count: more readers than cores only contend) up to here
LOAD_THREADS = max(2, min(16, available_cores()))


class DiskReader:
    """Restores for ``DiskTier`` (which holds ``store``, ``stats``, ``_cv`` and the rest)."""

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
            seg, read = self._restore(keys, first, have, tokens)
        took = time.perf_counter() - t0
        # a miss answered from the store's keys in memory proves nothing about a store that failed:
        # only a lookup through it, or a read, clears ``degraded``
        if self.stats.faults == faults and (read or not self.store.memory_index):
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

    def _restore(
        self, keys: list[str], first: int, have: int, tokens: Sequence[int]
    ) -> tuple[Segment | None, bool]:
        """The run of stored blocks ``keys[first:]`` that every rank holds, loaded (None if none),
        and whether blocks were read."""
        try:
            run = self.store.run_length(keys[first:])
        except Exception as exc:  # a damaged index: a miss (the ranks still agree below)
            self._fault("an index lookup", exc)
            run = 0
        run = run if self.agree is None else self.agree(run)
        if (first + run) * BLOCK_TOKENS <= have:
            return None, False
        seg = None
        parent = keys[first - 1] if first else ROOT_KEY
        try:
            seg = self.load(keys[first : first + run], parent, tokens, first)
        except Exception as exc:  # out of memory for the rows, a broken index: recompute
            self._fault("a restore", exc)
        if self.agree is not None:
            seg = _cut(seg, self.agree(seg.num_rows // BLOCK_TOKENS if seg is not None else 0))
        return seg, True

    def load(self, keys: Sequence[str], parent: str, tokens: Sequence[int], first: int) -> Segment | None:
        """Blocks ``keys`` (depths ``first``, ``first + 1``, ...) as one segment on the KV device,
        each verified against its file's checksum and against ``tokens``; stops before the first
        bad block (deleted, counted) or gone one (counted). None when not even the first is good.

        Readers run ahead of the block being checked by up to ``window`` blocks. On a CPU device
        each reads straight into its rows of the segment; on CUDA into a slot of the tier's
        pinned ring (``disk_staging``), from which the checked block is copied asynchronously."""
        s = self.shape
        n = len(keys)
        if n == 0:
            return None
        rows = n * BLOCK_TOKENS
        k = torch.empty((s.num_layers, s.num_kv_heads, rows, s.head_dim), dtype=s.dtype, device=s.device)
        v = torch.empty_like(k)  # [L, Hkv, rows, D]
        staging = self._staging
        window = staging.slots if staging is not None else max(2, 2 * self.load_threads)

        def rows_of(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            lo = i * BLOCK_TOKENS
            return k[:, :, lo : lo + BLOCK_TOKENS], v[:, :, lo : lo + BLOCK_TOKENS]  # [L, Hkv, 256, D]

        def read(i: int) -> Block:
            return self.store.get(keys[i], staging.slot(i) if staging is not None else rows_of(i))

        pool = self._readers()
        futures: dict[int, Future] = {}
        good = 0
        with staging.lock if staging is not None else contextlib.nullcontext():
            try:
                for i in range(n):
                    for j in range(i, min(n, i + window)):
                        if j not in futures:
                            futures[j] = pool.submit(read, j)
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
                    if staging is not None:
                        staging.copy_out(
                            i, (block.k, block.v), rows_of(i)
                        )  # pinned host -> device, asynchronous
                    good += 1
            finally:
                for fut in futures.values():  # reads still running write past the good rows: let them end
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


def _cut(seg: Segment | None, blocks: int) -> Segment | None:
    """``seg``'s first ``blocks`` blocks (a copy, so the rest's memory goes), None for none."""
    if seg is None or blocks == 0:
        return None
    rows = blocks * BLOCK_TOKENS
    if rows == seg.num_rows:
        return seg
    return Segment(seg.k[:, :, :rows].clone(), seg.v[:, :, :rows].clone(), seg.tokens[:rows])

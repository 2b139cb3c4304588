"""Pinned host slots that a CUDA restore reads blocks into before their host->device copies.

A restore on CUDA reads each block (``disk_blocks.decode_block``) into a slot of this ring,
verifies it there and copies it to the device segment from there (pinned: an asynchronous DMA at
~50 GB/s on the H200). The ring is allocated once, when the tier opens: page-locking is slow (the
RAM tier's pool pinned at 5.6 GB/s on the H200, far slower beside a busy engine), and the reader
before allocated two pinned tensors per block, which a process's first restores paid in full
(most likely the 0.35 s that an 8K restore lost on the H200: docs/BENCHMARKS.md, "Restore
stages"). Block ``i``
of a restore uses slot ``i % slots``; its reader waits for the copy out of that slot of block
``i - slots`` (a CUDA event) before it reads, so the reads run ahead of the copies by up to
``slots`` blocks and the copies overlap them. One restore holds the ring at a time (``lock``).

Each of a block's ``k`` and ``v`` goes into its rows of the segment as one 2-D copy
(``h2d.copy_block``, as the RAM tier's restores): ``Tensor.copy_`` into those strided rows went
through a device temporary and a copy kernel for each, on the thread that checks the blocks in
turn (the restore's serial part).
"""

from __future__ import annotations

import threading

import torch

from turnkv.bank.disk_blocks import BLOCK_TOKENS
from turnkv.bank.h2d import copy_block
from turnkv.bank.host_memory import host_empty
from turnkv.kv.cache import KVShape

# pinned bytes of the ring at most: 2 slots a reader (32 of an 8B model's 32 MiB blocks), so that
# readers that finish before the block being checked read on; what the old reader's read-ahead
# window of 2 blocks a reader held pinned too (and torch's host allocator kept)
STAGING_BYTES = 1 << 30


class Staging:
    """``slots`` pinned ``(k, v)`` pairs ``[L, Hkv, 256, D]`` and the copies out of each."""

    def __init__(self, shape: KVShape, threads: int, budget: int = STAGING_BYTES) -> None:
        block = shape.bytes_per_row * BLOCK_TOKENS
        self.slots = max(2, min(2 * threads, budget // block))
        dims = (self.slots, shape.num_layers, shape.num_kv_heads, BLOCK_TOKENS, shape.head_dim)
        # pages faulted, then registered (``host_memory``: the driver's lock held for the
        # registration only); a slot's copy lies inside one registration
        self.k = host_empty(dims, shape.dtype, pinned=True)
        self.v = host_empty(dims, shape.dtype, pinned=True)
        self._copied: list[torch.cuda.Event | None] = [None] * self.slots
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def slot(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``i``'s slot, once the copy out of it of the block before (``i - slots``) ended."""
        done = self._copied[i % self.slots]
        if done is not None:
            done.synchronize()  # releases the GIL while it waits
        return self.k[i % self.slots], self.v[i % self.slots]

    def copy_out(
        self, i: int, block: tuple[torch.Tensor, torch.Tensor], rows: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Copy block ``i``'s ``(k, v)`` (read into its slot) into ``rows`` (device views) on the
        current stream; the slot is read into again once these copies have ended."""
        stream = torch.cuda.current_stream()
        for src, dst in zip(block, rows, strict=True):
            copy_block(dst, src, stream)
        done = torch.cuda.Event()
        done.record(stream)
        self._copied[i % self.slots] = done

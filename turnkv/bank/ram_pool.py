"""The RAM tier's memory: one pool of ``capacity`` slots of one block of 256 tokens each (``k``,
``v`` ``[L, Hkv, 256, D]``), allocated in chunks of ``CHUNK_BYTES`` (``k``, ``v`` ``[n, L, Hkv, 256,
D]`` per chunk) and never freed.

A server's pool is pinned on threads of their own from before the model loads
(``host_memory.HostReserve``, started by ``runtime.build``: beside the load and the self-check a
stall of the driver's lock costs nothing), and the pool carves its chunks out of the reserve's.
It takes ``START_CHUNKS`` at once (a failure of the first turns the tier off) and the rest before
the budget probe and the warm-up (``Runtime.pin_ram`` waits for ``grow_behind``'s thread), or,
when no warm-up runs, once the server serves; a failure stops the growth, with the reason on
``/health.ram``. On CUDA a chunk's pages are faulted first and then registered: the driver's
lock is held for the registration only, where ``cudaHostAlloc`` held it for the faulting too.
Pinning beside a loaded server still stalled its steps, so a served pool is whole before ready
and no step ever pins. Plain CPU tensors on a CPU device (the tier's logic tested in CI).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import torch

from turnkv.bank.disk_blocks import BLOCK_TOKENS
from turnkv.bank.host_memory import HostReserve, host_empty
from turnkv.kv.cache import KVShape

log = logging.getLogger("turnkv.bank.ram")

CHUNK_BYTES = 1 << 28  # the pool is registered by this much at a time (the longest lock hold)
START_CHUNKS = 4  # taken at start; the rest before the warm-up (``Runtime.pin_ram``)


class PoolClosed(Exception):
    """``RamPool.close`` ended the growth while a chunk was awaited."""


class RamPool:
    """Slots ``0 .. capacity - 1``; ``on_slots(range)`` hands each chunk's new slots to the tier
    (under its lock) once their memory is in place. ``pinned``: page-locked (CUDA)."""

    def __init__(
        self,
        shape: KVShape,
        capacity: int,
        pinned: bool,
        reserve: HostReserve | None,
        on_slots: Callable[[range], None],
    ) -> None:
        self.shape, self.capacity, self.pinned, self.reserve = shape, capacity, pinned, reserve
        self.block_bytes = BLOCK_TOKENS * shape.bytes_per_row  # k and v of one block
        self.per_chunk = max(1, min(capacity, CHUNK_BYTES // self.block_bytes))
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []  # [n, L, Hkv, 256, D] each
        self.bases: list[torch.Tensor] = []  # the reserve's chunks under them (their registrations)
        self.grow_failed: str | None = None  # why the pool stopped growing below its budget
        # the pinning began with its reserve (beside the model's load) or here
        self._started = reserve.started if reserve is not None else time.perf_counter()
        self.pin_seconds: float | None = None  # from that start until the pool was whole
        self._on_slots = on_slots
        self._grower: threading.Thread | None = None
        self._closing = False  # close(): the grower stops at its next chunk
        self.grow()  # the first chunk now: a failure raises, and the caller serves without RAM
        for _ in range(START_CHUNKS - 1):
            if not self.whole:
                self.grow()

    def grow(self) -> None:
        """One more chunk of slots (raises RuntimeError/MemoryError when the memory is not had).
        Runs outside the tier's lock: faulting and registering a chunk take tens of ms."""
        s, have = self.shape, len(self.chunks) * self.per_chunk
        n = min(self.per_chunk, self.capacity - have)
        dims = (n, s.num_layers, s.num_kv_heads, BLOCK_TOKENS, s.head_dim)
        self.chunks.append(self._carve(dims))  # in place before any of its slots is handed out
        self._on_slots(range(have, have + n))

    def _carve(self, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` of ``dims``: halves of the reserve's next chunk when it has one that big,
        else allocated here (pinned on CUDA: async copies at the bus's speed)."""
        dtype = self.shape.dtype
        half = math.prod(dims) * dtype.itemsize
        base = self.reserve.take() if self.reserve is not None else None
        if base is None and self.reserve is not None:
            if self._closing:  # close() ended the reserve under a waiting take: no chunk of its own
                raise PoolClosed
            if self.reserve.failed is not None:  # the driver's reason; allocating here would meet it again
                raise RuntimeError(f"the reserve stopped: {self.reserve.failed}")
        if base is not None and base.numel() >= 2 * half:
            self.bases.append(base)  # its registration lives as long as this tensor does
            return base[:half].view(dtype).view(dims), base[half : 2 * half].view(dtype).view(dims)
        return host_empty(dims, dtype, self.pinned), host_empty(dims, dtype, self.pinned)

    @property
    def whole(self) -> bool:
        """The pool holds its whole budget (or stopped growing: ``grow_failed`` says why)."""
        return len(self.chunks) * self.per_chunk >= self.capacity or self.grow_failed is not None

    @property
    def pool_bytes(self) -> int:
        """What the pool holds now (the tier's ``budget_bytes`` once whole)."""
        return len(self.chunks) * self.per_chunk * self.block_bytes

    def rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``i``'s ``k``, ``v`` ``[L, Hkv, 256, D]`` (contiguous host views)."""
        c, j = divmod(i, self.per_chunk)
        k, v = self.chunks[c]
        return k[j], v[j]

    def grow_behind(self) -> None:
        """Take the rest of the pool on a thread of its own, a chunk at a time. Each chunk's slots
        are free as it lands; until then the pool holds what it has (a full pool evicts or drops,
        it never allocates in a step). A server waits for it before its warm-up
        (``Runtime.pin_ram``): beside loaded steps it stalls them."""
        if self._grower is None and not self.whole:
            self._grower = threading.Thread(target=self._grow_all, name="turnkv-ram-grow", daemon=True)
            self._grower.start()

    def _grow_all(self) -> None:
        while not self.whole and not self._closing:
            try:
                self.grow()
            except PoolClosed:
                break
            except (RuntimeError, MemoryError) as exc:  # keep serving with the slots it has
                self.grow_failed = (
                    f"pinned memory stopped at {self.pool_bytes / 2**30:.1f} GiB: {str(exc).splitlines()[0]}"
                )
                log.warning("KV RAM tier: %s; it holds what it has", self.grow_failed)
        self.pin_seconds = time.perf_counter() - self._started
        if self.reserve is not None:
            self.reserve.close()  # lets go of a chunk the pool had no use for

    def wait_whole(self, timeout: float | None = None) -> bool:
        """Wait for ``grow_behind``'s thread (tests, benches); whether the pool is whole."""
        if self._grower is not None:
            self._grower.join(timeout)
        return self.whole

    def close(self) -> None:
        """Stop growing (the reserve's threads too) and wait for the grower."""
        self._closing = True
        if self.reserve is not None:
            self.reserve.close()
        if self._grower is not None:
            self._grower.join()

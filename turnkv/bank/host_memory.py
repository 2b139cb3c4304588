"""Pinned host memory (the RAM tier's pool, the disk tier's staging ring): on CUDA, pages faulted
first and then registered.

``torch.empty(pin_memory=True)`` (``cudaHostAlloc``) faults, zeroes and maps a chunk's pages
while it holds the CUDA driver's lock, so every other CUDA call of the process (a step's
launches and copies) waits for the whole chunk. Here ``torch.zeros`` faults the pages first (no
driver lock; torch releases the GIL), then ``cudaHostRegister`` maps the range, holding the lock
only for that (bench/pin_rate.py measured both on the H200's host: docs/BENCHMARKS.md). A copy
must lie inside one registration (one spanning two is ``cudaErrorInvalidValue``), so each tensor
is registered whole: a block of the pool never spans two tensors.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque

import torch


def host_empty(dims: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A host tensor of ``dims``; ``pinned``: page-locked for the GPU's DMA (raises RuntimeError
    with the driver's reason when the pages cannot be registered, MemoryError when not had)."""
    if not pinned:
        return torch.empty(dims, dtype=dtype)
    return _register(torch.zeros(dims, dtype=dtype))  # faults every page, outside the driver's lock


def _register(t: torch.Tensor) -> torch.Tensor:
    """``t`` page-locked by ``cudaHostRegister`` (RuntimeError with the driver's reason)."""
    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes / 2**20:.0f} MiB failed: {cudart.cudaGetErrorString(err)}"
        )
    # unregistered when the tensor goes (the pool keeps its chunks for the tier's life; its close
    # waits for the copies first)
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


class HostReserve:
    """Pinned host memory taken before the model loads, ``chunk`` bytes at a time (the RAM tier's
    pool draws its chunks from it: ``RamTier.reserve``).

    Pinning tens of GiB takes seconds, and the driver's lock it holds stalls any CUDA work beside
    it, so it must end before the first timed or captured step (the budget probe, the warm-up).
    Started with the process's set-up (``runtime.build``), it runs beside the model's load and
    the self-check, where a stall costs nothing. Two threads: one faults a chunk's pages (no
    driver lock), the other registers the chunk before it, so the two stages overlap.
    ``take`` hands the chunks out in order, waiting for the next one; each is registered whole
    (a copy must lie inside one registration)."""

    def __init__(self, total: int, chunk: int, pinned: bool = True) -> None:
        self.total, self.chunk, self.pinned = total, chunk, pinned
        self.count = -(-total // chunk) if total > 0 else 0
        self.failed: str | None = None  # why it stopped short of ``count`` chunks
        self.seconds: float | None = None  # from start to the last chunk pinned
        self.made = 0  # chunks pinned so far
        self._ready: deque[torch.Tensor] = deque()
        self._faulted: queue.Queue[torch.Tensor | None] = queue.Queue(maxsize=2)
        self._cv = threading.Condition()
        self._done = self.count == 0
        self._closing = False
        self.started = time.perf_counter()
        self._threads = [
            threading.Thread(target=self._fault, name="turnkv-pin-fault", daemon=True),
            threading.Thread(target=self._register, name="turnkv-pin-register", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _fault(self) -> None:
        try:
            for i in range(self.count):
                if self._closing or self.failed is not None:
                    break
                n = min(self.chunk, self.total - i * self.chunk)
                self._faulted.put(torch.zeros(n, dtype=torch.uint8))  # faults every page
        except (RuntimeError, MemoryError) as exc:  # torch's allocator raises RuntimeError
            self.failed = f"faulting host memory failed: {str(exc).splitlines()[0]}"
        finally:
            self._faulted.put(None)  # the registering thread ends, and ``take`` answers

    def _register(self) -> None:
        while (t := self._faulted.get()) is not None:
            if not self._closing and self.failed is None:
                try:
                    t = _register(t) if self.pinned else t
                except RuntimeError as exc:
                    self.failed = str(exc).splitlines()[0]
                    continue
                with self._cv:
                    self._ready.append(t)
                    self.made += 1
                    self._cv.notify_all()
        with self._cv:
            self._done = True
            self.seconds = time.perf_counter() - self.started
            self._cv.notify_all()

    def take(self) -> torch.Tensor | None:
        """The next chunk (uint8, ``chunk`` bytes; the last may be shorter), waiting for it; None
        once every chunk is taken or the pinning failed (``failed`` says why)."""
        with self._cv:
            self._cv.wait_for(lambda: self._ready or self._done)
            return self._ready.popleft() if self._ready else None

    def wait(self) -> float | None:
        """Until the pinning ends; its seconds."""
        for t in self._threads:
            t.join()
        return self.seconds

    def close(self) -> None:
        """Stop pinning and let go of the chunks not taken (unregistered with them)."""
        self._closing = True  # the faulting thread stops at its next chunk, the other drops what comes
        self.wait()
        with self._cv:
            self._ready.clear()

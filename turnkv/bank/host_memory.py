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

import weakref

import torch


def host_empty(dims: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A host tensor of ``dims``; ``pinned``: page-locked for the GPU's DMA (raises RuntimeError
    with the driver's reason when the pages cannot be registered, MemoryError when not had)."""
    if not pinned:
        return torch.empty(dims, dtype=dtype)
    t = torch.zeros(dims, dtype=dtype)  # faults every page, outside the driver's lock
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

"""One pinned host block into its rows of a device segment in one copy.

A block's rows in a segment ``[L, Hkv, T, D]`` are ``L * Hkv`` runs of ``256 * D`` contiguous
elements, one every ``T * D``: a 2-D copy (``cudaMemcpy2DAsync``), where ``Tensor.copy_`` into
that strided view goes through a contiguous device temporary and a copy kernel, two allocations
and three launches a block on the host. The runtime is the one torch loaded (found in the
process's mappings); where it or the layout does not fit, ``copy_`` does the copy.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_H2D = 1  # cudaMemcpyHostToDevice


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch uses (None when it cannot be found)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]  # fmt: skip
        return lib
    return None


def pitched(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``(dpitch, spitch, width, height)`` in bytes and rows when ``dst`` ``[L, Hkv, n, D]`` (a
    view of whole rows of a contiguous segment) takes ``src`` (contiguous, same shape) as one 2-D
    copy; None otherwise."""
    if dst.dim() != 4 or dst.shape != src.shape or dst.dtype != src.dtype or not src.is_contiguous():
        return None
    L, H, n, D = dst.shape
    s0, s1, s2, s3 = dst.stride()
    if s3 != 1 or s2 != D or s0 != H * s1 or s1 < n * D:
        return None
    e = dst.element_size()
    return s1 * e, n * D * e, n * D * e, L * H


def copy_block(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """``dst.copy_(src, non_blocking=True)`` on ``stream`` (current), from pinned ``src``."""
    shape = pitched(dst, src) if dst.is_cuda and src.is_pinned() else None
    lib = _cudart() if shape is not None else None
    if lib is None:
        dst.copy_(src, non_blocking=True)
        return
    dpitch, spitch, width, height = shape
    err = lib.cudaMemcpy2DAsync(
        dst.data_ptr(), dpitch, src.data_ptr(), spitch, width, height, _H2D, stream.cuda_stream
    )
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")

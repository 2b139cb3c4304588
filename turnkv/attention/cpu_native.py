"""The CPU attention in C (``cpu_attention.c``): built at first use, called through ctypes.

Every CPU window of a step (decode, verify and prefill alike) goes through one C call per layer,
its slices on torch's OpenMP threads, instead of ~25 torch ops per window and layer plus an fp32
copy of every bf16 view (``lse.concat_segments``, the path where no compiler is found). The C reads
each view as stored and keeps every sum in fp32; a row's bits depend only on its own query and the
keys it sees (the exactness argument is in the C file's header), so a turn whose prefix came from
the bank or the disk computes what it would have computed in one window. A window's rows are cut
into blocks of ``ROW_BLOCK`` (each block's scores stop at the keys its last row sees), and the
step's (window, KV head, block) items are cut over the threads at equal shares of the work.

Built at first use by ``turnkv.cbuild`` (``-O3 -march=native -fopenmp``, cached per source and
CPU). ``TURNKV_CPU_KERNEL=off`` keeps the torch path (the tests use it to run both); a failed
build keeps it too, and ``status()`` says why.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from turnkv import cbuild

SOURCE = Path(__file__).with_name("cpu_attention.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
SPLIT_MIN_KEYS = 256  # keys x rows x KV heads of a step from which its items go to several threads
ROW_BLOCK = 32  # rows of a window per work item (a decode or verify window is one block)
# The C's arithmetic, named: part of the KV cache fingerprint (``load.cache_fingerprint``), so the
# disk tier never hands a turn rows that another attention computed. Change it whenever the C's
# sums change.
ARITHMETIC = "c-attention-all-windows"
_VIEW_FIELDS = 9  # k_ptr, v_ptr, k strides (layer, head, row), v strides (layer, head, row), rows


def _setup(lib: ctypes.CDLL) -> None:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.turnkv_attend.argtypes = [
        i64,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        i64,
        i64,
        f32,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        i64,
        ptr,
        i64,
    ]
    lib.turnkv_attend.restype = ctypes.c_int
    lib.turnkv_store.argtypes = [i64, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64]
    lib.turnkv_store.restype = ctypes.c_int
    lib.turnkv_attend_slice.restype = ctypes.c_int  # (called from C: cpu_decoder.c)


KERNEL = cbuild.Kernel(SOURCE, _setup, "torch ops")
library = KERNEL.library  # the loaded kernel or None
set_enabled = KERNEL.set_enabled  # steps planned from now on use C (True) or torch ops
status = KERNEL.status  # "ok" when CPU decode windows run in C, else why they run as torch ops


def supports(k: torch.Tensor) -> bool:
    """Whether views like ``k`` (``[L, Hkv, T, D]``) can go to the C kernel."""
    d = k.shape[-1]
    return k.device.type == "cpu" and k.dtype in DTYPES and k.stride(-1) == 1 and d % 16 == 0 and d <= 256


class NativeStep:
    """One step's C attention for the windows it was planned for: the tables are built once per
    step (every layer's views are the same tensors at another layer offset), then ``attend`` is
    one call per layer.

    ``windows``: ``(q_row0, views, window_start, rows)`` with ``views`` the window's ``(k, v)``
    pairs, each ``[L, Hkv, T_i, D]``, all of one dtype that ``supports`` accepts; ``threads``: the
    OpenMP threads its items may be cut over (torch's count)."""

    def __init__(
        self,
        windows: Sequence[tuple[int, Sequence[tuple[torch.Tensor, torch.Tensor]], int, int]],
        threads: int = 1,
    ):
        lib = library()
        assert lib is not None, "NativeStep needs the built kernel (check cpu_native.library())"
        self._fn, self._store = lib.turnkv_attend, lib.turnkv_store
        k0 = windows[0][1][0][0]
        self.hkv, self.d = k0.shape[1], k0.shape[3]
        self.dtype = DTYPES[k0.dtype]
        wins, views = [], []
        for row0, vs, ws, m in windows:
            wins.append((row0, m, ws, len(views), len(vs)))
            for k, v in vs:
                if k.dtype is not k0.dtype or v.dtype is not k0.dtype:
                    raise ValueError(f"one step's views are {k0.dtype}; got {k.dtype}/{v.dtype}")
                ks, vs_ = k.stride(), v.stride()
                views.append(
                    (k.data_ptr(), v.data_ptr(), ks[0], ks[1], ks[2], vs_[0], vs_[1], vs_[2], k.shape[2])
                )
        self.wins = np.asarray(wins, dtype=np.int64).reshape(-1, 5)
        self.views = np.asarray(views, dtype=np.int64).reshape(-1, _VIEW_FIELDS)
        items, work = [], []
        for w, (_, _, ws, m) in enumerate(windows):
            for r0 in range(0, m, ROW_BLOCK):
                r1 = min(r0 + ROW_BLOCK, m)
                items += [(w, h, r0, r1) for h in range(self.hkv)]
                work += [(r1 - r0) * (ws + r1)] * self.hkv  # scores read: rows x keys
        self.items = np.asarray(items, dtype=np.int64).reshape(-1, 4)
        self._keys = max(ws + m for _, _, ws, m in windows)
        self._rows = min(ROW_BLOCK, max(m for _, _, _, m in windows))
        # item slices for ``threads`` OpenMP threads, cut at equal shares of the keys read; one
        # slice below SPLIT_MIN_KEYS, where splitting gains nothing (docs/BENCHMARKS.md)
        total = sum(work)
        parts = min(threads, len(items)) if total >= SPLIT_MIN_KEYS else 1
        cuts = [0, len(items)]
        if parts > 1:  # (numpy's calls cost more than a short decode step's table: only when cut)
            ends = (
                np.searchsorted(np.cumsum(work), [total * i / parts for i in range(1, parts)], side="left")
                + 1
            )
            cuts = sorted({*cuts, *(int(e) for e in ends)})
        self.cuts = np.asarray(cuts, dtype=np.int64)
        self.parts = len(self.cuts) - 1
        self._scratch: torch.Tensor | None = None
        # the tables' addresses, read once: each ``.ctypes`` is a new object, twice a layer
        self._ptrs = tuple(a.ctypes.data for a in (self.wins, self.views, self.items, self.cuts))

    def _scratch_for(self, hq: int) -> int:
        """Each slice's fp32 work space (see the C file), made once for the step; its stride."""
        stride = self._rows * (hq // self.hkv) * (self._keys + 2 * self.d) + 16
        if self._scratch is None:
            self._scratch = torch.empty(self.parts * stride)
        return stride

    def tables(self, hq: int) -> tuple[int, ...]:
        """What ``turnkv_attend_slice`` takes for ``hq`` query heads (``cpu_decoder``): the tables'
        addresses (wins, views, items, cuts), the window count, the slices, the dtype code, the
        scratch's address and stride."""
        stride = self._scratch_for(hq)
        scratch = self._scratch.data_ptr()
        return (*self._ptrs, len(self.wins), self.parts, self.dtype, scratch, stride)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """Every item (window x KV head x row block) of ``layer``: q fp32 ``[N, Hq, D]`` (last dim
        contiguous) -> the windows' rows of ``out`` fp32 ``[N, Hq, D]`` (contiguous)."""
        hq = q.shape[1]
        stride = self._scratch_for(hq)
        self._fn(
            layer,
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            out.data_ptr(),
            hq,
            self.hkv,
            self.d,
            scale,
            self._ptrs[0],
            self._ptrs[1],
            self._ptrs[2],
            self.dtype,
            self._ptrs[3],
            self.parts,
            self._scratch.data_ptr(),
            stride,
        )

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """The windows' new rows of ``layer`` from k, v ``[N, Hkv, D]`` into their last views, in
        one call (fp32 copied, bf16 rounded to nearest even as torch rounds); False (nothing
        written) where k or v is not fp32 with a contiguous last dim."""
        if k.dtype != torch.float32 or v.dtype != torch.float32 or k.stride(-1) != 1 or v.stride(-1) != 1:
            return False
        ks, vs = k.stride(), v.stride()
        self._store(layer, k.data_ptr(), ks[0], ks[1], v.data_ptr(), vs[0], vs[1], self.hkv, self.d,
                    self._ptrs[0], len(self.wins), self._ptrs[1], self.dtype)  # fmt: skip
        return True

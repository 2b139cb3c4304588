"""A row-invariant tensor-core GEMM: ``residual + x @ W.T + bias`` whose row ``r`` is the same
bits whatever the other rows of the launch (how many, which), the matmul of ``--deterministic``
on CUDA (``turnkv.models.matmul``).

The row tile is FIXED at ``BLOCK_M = 16`` (for ``M = 1`` too): every tile is one ``tl.dot`` chain on
``[16, BLOCK_K] x [BLOCK_K, BLOCK_N]`` (or, ``swap``, ``[BLOCK_N, BLOCK_K] x [BLOCK_K, 16]``)
accumulated in fp32 over the same K order, rows past ``M`` masked, bias and residual added in fp32,
rounded once. Tile, warps, stages and a split-K factor come from ``(N, K)`` only (``pick``), never
from ``M``. The one thing ``M`` picks is how many row tiles a program carries (``tiles_m``: 1, 2
or 4): they share each W tile the program loads, so ``M = 32`` streams W once rather than once per
row tile, but each keeps its own accumulator and runs the same ``tl.dot`` chain (same shapes, K
order and split) that a program of one tile runs, and its rows are summed, biased and rounded by
the same code; so the count changes which program computes a row, never how. With ``SPLIT > 1`` each program writes its fp32 partial to ``[SPLIT, M, N]`` and the
partials are summed in fixed order ``s = 0, 1, ...``: by a second kernel, or (``fused``) by the
last program of a column tile to arrive (an atomic counter that it resets) -- both give the same
bits. Capturable in a CUDA graph (the counters are allocated on the first eager call).
The H200 timing of the configs is bench/rowinv_gemm.py's (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from turnkv.kernels.triton_common import INTERPRET, downcast

BLOCK_M = 16  # the row tile, for every M: what makes a row's bits independent of M
TILES_M = (1, 2, 4)  # row tiles a program may carry (one W tile load serves them all)
SMS = 132  # H200 multiprocessors: the split-K rule aims at a few programs per SM (a constant,
# so the config stays a function of (N, K) alone)
SUM_BLOCK = 1024  # columns per program of the partial-sum kernel


@triton.jit
def _epilogue(
    acc, B, R, offs, cols, cmask, omask, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr
):  # fmt: skip
    """acc (+ bias over the columns) (+ residual at offs), in fp32."""
    if HAS_BIAS:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        if SWAP:
            acc += b[:, None]
        else:
            acc += b[None, :]
    if HAS_RES:
        acc += tl.load(R + offs, mask=omask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _places(rows, cols, M, N, SWAP: tl.constexpr):
    """Element offsets into a [M, N] output of one tile, and which are inside it."""
    if SWAP:
        offs = rows[None, :] * N + cols[:, None]
        omask = (cols < N)[:, None] & (rows < M)[None, :]
    else:
        offs = rows[:, None] * N + cols[None, :]
        omask = (rows < M)[:, None] & (cols < N)[None, :]
    return offs, omask


@triton.jit
def _tile_dot(
    acc, X, w, rows, kk, kmask, M, sxm, SWAP: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr
):  # fmt: skip
    """acc += one row tile's x [BLOCK_M, BLOCK_K] against the loaded W tile (one ``tl.dot``)."""
    xp = X + rows[:, None].to(tl.int64) * sxm + kk[None, :]  # [BM, BK]
    rmask = rows < M
    if EVEN_K:
        x = tl.load(xp, mask=rmask[:, None], other=0.0)
    else:
        x = tl.load(xp, mask=rmask[:, None] & kmask[None, :], other=0.0)
    if INTERP:  # the CPU interpreter multiplies bf16 bit patterns as integers; upcast there
        x = x.to(tl.float32)
    # one return: Triton's code generator also visits a statement after a constexpr-if's return
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc)  # [BN, BM]
    else:
        acc = tl.dot(x, tl.trans(w), acc)  # [BM, BN]
    return acc


@triton.jit
def _finish(
    acc, B, R, Y, WS, pid_s, rows, cols, M, N, SWAP: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """One row tile's result: rounded into Y (no split), or its fp32 partial into WS."""
    offs, omask = _places(rows, cols, M, N, SWAP)
    if SPLIT == 1:
        acc = _epilogue(acc, B, R, offs, cols, cols < N, omask, SWAP, HAS_BIAS, HAS_RES)
        tl.store(Y + offs, downcast(acc, Y.dtype.element_ty, INTERP), mask=omask)
    else:
        tl.store(WS + pid_s * M * N + offs, acc, mask=omask)


@triton.jit
def _sum_tile(
    like, B, R, Y, WS, rows, cols, M, N, SWAP: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """One row tile's partials summed in order s = 0, 1, ..., then bias and residual, rounded once."""
    offs, omask = _places(rows, cols, M, N, SWAP)
    tot = tl.zeros_like(like)
    for s in tl.static_range(SPLIT):
        tot += tl.load(WS + s * M * N + offs, mask=omask, other=0.0, cache_modifier=".cg")
    tot = _epilogue(tot, B, R, offs, cols, cols < N, omask, SWAP, HAS_BIAS, HAS_RES)
    tl.store(Y + offs, downcast(tot, Y.dtype.element_ty, INTERP), mask=omask)


@triton.jit(do_not_specialize=["M"])
def _rowinv_kernel(
    X, W, B, R, Y, WS, CNT, M, N, K, sxm, swn, chunk,
    BLOCK_M: tl.constexpr, TILES_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SWAP: tl.constexpr, FUSED: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """TILES_M (1, 2 or 4) row tiles of BLOCK_M rows against one BLOCK_N column tile over the K
    slice [pid_s * chunk, +chunk): each loaded W tile serves every row tile, and each row tile keeps
    its own accumulator and ``tl.dot`` chain (the one a program of one row tile runs).

    M is not specialised (no M == 1 / divisibility variants): one binary per TILES_M."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows0 = pid_m * (TILES_M * BLOCK_M) + tl.arange(0, BLOCK_M)
    rows1 = rows0 + BLOCK_M
    rows2 = rows0 + 2 * BLOCK_M
    rows3 = rows0 + 3 * BLOCK_M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_s * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    wp = W + cols[:, None].to(tl.int64) * swn + (k_lo + offs_k)[None, :]  # [BN, BK]
    if SWAP:
        acc0 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros_like(acc0)  # unused (and dropped by the compiler) below TILES_M 2
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < k_hi
        if EVEN_K:
            if EVEN_N:
                w = tl.load(wp)
            else:
                w = tl.load(wp, mask=cmask[:, None], other=0.0)
        else:
            w = tl.load(wp, mask=cmask[:, None] & kmask[None, :], other=0.0)
        if INTERP:
            w = w.to(tl.float32)
        acc0 = _tile_dot(acc0, X, w, rows0, kk, kmask, M, sxm, SWAP, EVEN_K, INTERP)
        if TILES_M > 1:
            acc1 = _tile_dot(acc1, X, w, rows1, kk, kmask, M, sxm, SWAP, EVEN_K, INTERP)
        if TILES_M > 2:
            acc2 = _tile_dot(acc2, X, w, rows2, kk, kmask, M, sxm, SWAP, EVEN_K, INTERP)
            acc3 = _tile_dot(acc3, X, w, rows3, kk, kmask, M, sxm, SWAP, EVEN_K, INTERP)
        wp += BLOCK_K
    _finish(acc0, B, R, Y, WS, pid_s, rows0, cols, M, N, SWAP, SPLIT, HAS_BIAS, HAS_RES, INTERP)
    if TILES_M > 1:
        _finish(acc1, B, R, Y, WS, pid_s, rows1, cols, M, N, SWAP, SPLIT, HAS_BIAS, HAS_RES, INTERP)
    if TILES_M > 2:
        _finish(acc2, B, R, Y, WS, pid_s, rows2, cols, M, N, SWAP, SPLIT, HAS_BIAS, HAS_RES, INTERP)
        _finish(acc3, B, R, Y, WS, pid_s, rows3, cols, M, N, SWAP, SPLIT, HAS_BIAS, HAS_RES, INTERP)
    if SPLIT > 1 and FUSED:
        # the last of the SPLIT programs of these tiles sums the partials in order s = 0, 1, ...
        tl.debug_barrier()  # every thread's partials stored before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        seen = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        if seen == SPLIT - 1:
            _sum_tile(acc0, B, R, Y, WS, rows0, cols, M, N, SWAP, SPLIT, HAS_BIAS, HAS_RES, INTERP)
            if TILES_M > 1:
                _sum_tile(acc1, B, R, Y, WS, rows1, cols, M, N, SWAP, SPLIT, HAS_BIAS, HAS_RES, INTERP)
            if TILES_M > 2:
                _sum_tile(acc2, B, R, Y, WS, rows2, cols, M, N, SWAP, SPLIT, HAS_BIAS, HAS_RES, INTERP)
                _sum_tile(acc3, B, R, Y, WS, rows3, cols, M, N, SWAP, SPLIT, HAS_BIAS, HAS_RES, INTERP)
            tl.atomic_xchg(CNT + tile, 0)  # ready for the next call


@triton.jit(do_not_specialize=["M"])
def _sum_kernel(
    WS, B, R, Y, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Y[m, cols] = bf16(sum over s = 0, 1, ... of WS[s, m, cols]), in that order."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = tl.program_id(1)
    cmask = cols < N
    tot = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        tot += tl.load(WS + (s * M + m) * N + cols, mask=cmask, other=0.0)
    if HAS_BIAS:
        tot += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_RES:
        tot += tl.load(R + m * N + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(Y + m * N + cols, downcast(tot, Y.dtype.element_ty, INTERP), mask=cmask)


class Cfg(NamedTuple):
    bn: int  # BLOCK_N
    bk: int  # BLOCK_K
    split: int  # split-K factor
    warps: int = 4
    stages: int = 4
    swap: bool = False  # dot(W tile, x tile^T): the weight is the MMA's M side
    fused: bool = False  # split partials summed in the main kernel (atomic counter), not a second

    def label(self) -> str:
        s = f"{self.bn}x{self.bk}/s{self.split}/w{self.warps}/st{self.stages}"
        return s + ("/swap" if self.swap else "") + ("/fused" if self.fused and self.split > 1 else "")


# (N, K) -> config, filled from an H200 sweep (``--sweep``); shapes not here take ``rule``.
TABLE: dict[tuple[int, int], Cfg] = {
    # H200 sweep at M = 1 (triton 3.6, torch 2.11; the second --sweep of the probe, whose winners
    # the reported bench ran with): llama3-8b qkv, o, gate|up, down, LM head
    (6144, 4096): Cfg(32, 128, 2, 4, 4, False, True),
    (4096, 4096): Cfg(64, 128, 4, 4, 4, True, True),
    (28672, 4096): Cfg(64, 128, 1, 4, 4, True, False),
    (4096, 14336): Cfg(64, 128, 4, 4, 3, True, True),
    (128256, 4096): Cfg(64, 128, 1, 4, 4, False, False),
    # smollm2-135m qkv, o, gate|up, down, LM head
    (960, 576): Cfg(16, 128, 1, 4, 5, False, False),
    (576, 576): Cfg(16, 128, 1, 4, 5, False, False),
    (3072, 576): Cfg(64, 128, 1, 4, 4, True, False),
    (576, 1536): Cfg(32, 128, 8, 4, 5, False, True),
    (49152, 576): Cfg(64, 64, 1, 4, 3, False, False),
}


def _largest_pow2_dividing(k: int, cap: int) -> int:
    b = cap
    while b > 16 and k % b:
        b //= 2
    return b


def rule(n: int, k: int) -> Cfg:
    """A config from the shape alone, for shapes the table lacks: 64 columns a program where the
    output is wide, 32 where narrow; split K until there are >= 2 programs per SM while each split
    keeps >= 4 K slices."""
    bk = _largest_pow2_dividing(k, 128)
    bn = 64 if n >= 16384 else 32
    tiles = triton.cdiv(n, bn)
    split = 1
    while tiles * split < 2 * SMS and k // (2 * split) >= 4 * bk:
        split *= 2
    return Cfg(bn, bk, split, 4, 4, False, split > 1)


def pick(n: int, k: int) -> Cfg:
    return TABLE.get((n, k)) or rule(n, k)


def tiles_m(m: int) -> int:
    """Row tiles per program for ``m`` rows: every tile of the launch in one program up to 4
    (``M <= 64`` streams W once), then 4 (register room: 4 fp32 [16, BLOCK_N] accumulators at
    BLOCK_N 64 are 32 registers a thread at 4 warps)."""
    need = triton.cdiv(m, BLOCK_M)
    return next(t for t in TILES_M if t >= need) if need <= TILES_M[-1] else TILES_M[-1]


def _chunk(k: int, bk: int, split: int) -> tuple[int, bool]:
    """K per split and whether every slice is whole (no K mask)."""
    if k % (split * bk) == 0:
        return k // split, True
    return triton.cdiv(triton.cdiv(k, split), bk) * bk, False


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, need: int) -> torch.Tensor:
    """Zeroed int32 arrival counters (each reset by the program that consumed it). Allocated on a
    first eager call, never during a graph capture."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < need:
        c = _COUNTERS[device] = torch.zeros(max(need, 1 << 16), dtype=torch.int32, device=device)
    return c


def rowinv_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    cfg: Cfg | None = None,
) -> torch.Tensor:
    """``residual + x @ w.T + bias`` for x ``[M, K]`` (rows contiguous), w ``[N, K]`` -> ``[M, N]``
    in x's dtype (bias ``[N]``, residual ``[M, N]`` optional: fp32 adds before the one rounding);
    row ``r`` of the result does not depend on M or on the other rows."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1 and x.dtype == w.dtype
    cfg = cfg or pick(n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    b = bias if bias is not None else y
    r = residual.contiguous() if residual is not None else y
    chunk, even_k = _chunk(k, cfg.bk, cfg.split)
    tm = tiles_m(m)
    grid = (triton.cdiv(n, cfg.bn), cfg.split, triton.cdiv(m, tm * BLOCK_M))
    ws = torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device) if cfg.split > 1 else y
    fused = cfg.fused and cfg.split > 1
    cnt = _counters(x.device, grid[0] * grid[2]) if fused else y
    _rowinv_kernel[grid](
        x, w, b, r, y, ws, cnt, m, n, k, x.stride(0), w.stride(0), chunk,
        BLOCK_M=BLOCK_M, TILES_M=tm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, SPLIT=cfg.split, SWAP=cfg.swap, FUSED=fused,
        EVEN_N=n % cfg.bn == 0, EVEN_K=even_k, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, INTERP=INTERPRET,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    if cfg.split > 1 and not fused:
        _sum_kernel[(triton.cdiv(n, SUM_BLOCK), m)](
            ws, b, r, y, m, n, SPLIT=cfg.split, BLOCK=SUM_BLOCK, HAS_BIAS=bias is not None,
            HAS_RES=residual is not None, INTERP=INTERPRET, num_warps=4,
        )  # fmt: skip
    return y

"""A Triton GEMV for decode-sized matmuls: ``x @ W.T (+ bias) (+ residual)`` for a few rows.

At batch 1 every linear layer of a decode step is a matrix-vector product that reads its weight
once; what matters is how close the read gets to the copy rate. cuBLAS picks tiles for these
shapes that leave bandwidth on the table where the output is narrow: qkv and o on one GPU and,
cut over two, o, qkv and down, the last with split-K reduce passes (the H200 profiles in
docs/BENCHMARKS.md, issues 8 and 15).

Here each program owns ``BLOCK_N`` output columns (weight rows) for every row of ``x`` and
walks the whole ``K`` in ``BLOCK_K`` slices: weight tiles are read once, coalesced along K, the
products summed in fp32 in registers, the bias and the residual added in fp32 and the result
rounded once -- what ``torch.addmm`` computes, in one launch and without a split-K pass (a row's
sum always runs in the same order: the step is deterministic, so a CUDA graph replay equals an
eager step bit for bit). ``pick`` chooses the tile from the shape (``bench/gemv.py`` sweeps it).

Several rows (up to ``MAX_ROWS``) are one program per row and column tile, each the one-row
program: a row's bits never depend on how many rows the call has. That is what a verify window of
context-copy drafts needs on CUDA (its rows must round as the same rows decoded one by one do;
cuBLAS picks its kernel by the row count). The programs of one column tile run side by side (the
row varies fastest), so the weight tile comes from memory once and from L2 for the other rows; a
row still costs every weight tile's read, and a program taking all rows of its tile one after
the other was slower still (docs/BENCHMARKS.md, 'Context-copy speculation (issue 12)'). Batched
rows of several conversations stay cuBLAS's GEMMs (``matmul._gemv_for``).

Imported lazily, on CUDA only (``matmul.linear``); tested on the CPU through the interpreter.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from turnkv.kernels.triton_common import INTERPRET, downcast
from turnkv.limits import MAX_WINDOW_ROWS

MAX_ROWS = MAX_WINDOW_ROWS  # rows of x this kernel takes: a verify window
WIDE_N = 12288  # outputs at least this wide take the wide tile (``pick``)


@triton.jit
def _gemv_kernel(
    X, W, B, R, Y, M, N, K, swn, sxm, srm, sym,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    # one row of x per program, rows fastest: a column tile's programs run side by side (L2)
    pid = tl.program_id(0)
    m = (pid % M).to(tl.int64)
    X += m * sxm
    R += m * srm
    Y += m * sym
    cols = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = weight rows
    cmask = cols < N
    wrow = W + cols[:, None].to(tl.int64) * swn
    # products summed elementwise over the K slices and reduced across lanes once at the end:
    # the loop is loads and FMAs only
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        w = tl.load(wrow + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)  # [BN, BK]
        x = tl.load(X + ks, mask=kmask, other=0.0)  # [BK]
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)  # [BN]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(R + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(Y + cols, downcast(y, Y.dtype.element_ty, INTERP), mask=cmask)


@functools.lru_cache(maxsize=256)
def pick(n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, warps, stages)`` for ``[1, k] @ [n, k].T``.

    From the sweep of ``bench/gemv.py`` on the H200 (8B shapes on one GPU and cut over two;
    docs/BENCHMARKS.md): a narrow output (o, qkv, down: N <= 6144) wants few columns and long
    K slices per program (4 x 2048), a wide one (gate|up, the LM head) many short programs
    (16 x 256). Each rule is near the best tile of every shape it covers (the sweep's table)."""
    if n >= WIDE_N:
        return 16, min(256, triton.next_power_of_2(k)), 4, 2
    return 4, min(2048, triton.next_power_of_2(k)), 4, 2


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv`` serves ``x @ w.T``: at most ``MAX_ROWS`` contiguous rows, a weight of
    their dtype with unit stride along K."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype == w.dtype
        and w.dim() == 2
        and w.stride(1) == 1
        and x.is_contiguous()
    )


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``residual + x @ w.T + bias`` for x ``[M, K]``, w ``[N, K]`` -> ``[M, N]`` in x's dtype;
    each row as alone (the tile is ``pick``'s, from ``(N, K)`` only).

    ``bias`` ``[N]`` and ``residual`` ``[M, N]`` are optional (fp32 adds, one rounding)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or pick(n, k)
    res = residual.contiguous() if residual is not None else y
    _gemv_kernel[(m * triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else y, res, y, m, n, k, w.stride(0),
        x.stride(0), res.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, INTERP=INTERPRET, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y

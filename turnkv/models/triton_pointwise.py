"""Triton kernels behind ``pointwise.rms_norm`` and ``pointwise.silu_mul`` (imported lazily, on CUDA
only; tested on the CPU through the interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnkv.kernels.triton_common import INTERPRET, downcast


@triton.jit
def _silu_mul_kernel(X, Out, n_cols, sxm, som, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * sxm + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * sxm + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    elt = Out.dtype.element_ty
    silu = downcast(gate / (1.0 + tl.exp(-gate)), elt, INTERP).to(tl.float32)  # rounded as torch rounds
    tl.store(Out + row * som + cols, downcast(silu * up, elt, INTERP), mask=mask)


@triton.jit
def _rms_norm_kernel(X, W, Out, n_cols, sxm, som, eps, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * sxm + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    tl.store(Out + row * som + cols, downcast(x * inv * w, Out.dtype.element_ty, INTERP), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` ``[N, H]`` times ``weight`` ``[H]``: fp32 inside, one rounding
    (as ``F.rms_norm`` with a weight). One program per row that loads the row once: torch's
    kernel is latency-bound at batch 1."""
    n, h = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    if n:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(n,)](x, weight, out, h, x.stride(0), out.stride(0), eps, BLOCK=block,
                               INTERP=INTERPRET, num_warps=4 if block <= 4096 else 8)  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[N, 2I]`` -> ``[N, I]``, rounded where torch rounds."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty(n, inter, device=gate_up.device, dtype=gate_up.dtype)
    if n == 0:
        return out
    block = 1024
    grid = (n, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, INTERP=INTERPRET
    )
    return out

"""The model's pointwise ops: RMSNorm and SiLU-gated products, one kernel each.

``rms_norm`` (statistics and the weight's product in fp32, one rounding) is torch's ``F.rms_norm``
with the weight, or on CUDA a Triton kernel of one program per row (torch's kernel is
latency-bound at batch 1, and a step calls it twice a layer). ``silu_mul`` takes the gate|up
matmul's output ``[N, 2I]`` and returns ``silu(gate) * up`` ``[N, I]``: on CUDA one Triton kernel
(rounded where torch rounds) instead of torch's two kernels and their intermediate; elsewhere the
torch expression. Timings: docs/BENCHMARKS.md (issue 8).

On a CPU, fp32 rows take ``_cpu_rms_norm``: torch's ``F.rms_norm`` there is a composite of ~10
ops (pow, mean, add, rsqrt, two muls, and a 0-dim copy for each Python scalar), each a dispatch
that costs more than the arithmetic on a ``[1, 576]`` row. ``out_dtype`` lets the packed weights'
bf16 activations come out of the norm (the matmul would convert them anyway).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def _kernels():
    try:
        from turnkv.models import triton_pointwise
    except ImportError:
        return None
    return triton_pointwise


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim, times ``weight``; in x's dtype, or ``out_dtype`` (rounded once)."""
    kernels = _kernels() if x.is_cuda and x.dim() == 2 else None
    if kernels is not None:
        y = kernels.rms_norm(x, weight, eps)
    elif x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32:
        y = _cpu_rms_norm(x, weight, eps)
    else:
        y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return y if out_dtype is None else cast(y, out_dtype)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` through the short methods (``.float()``, ``.bfloat16()``), which skip the
    general method's argument parsing; same copy, same bits. No dispatch when already so."""
    if t.dtype == dtype:
        return t
    if dtype == torch.float32:
        return t.float()
    return t.bfloat16() if dtype == torch.bfloat16 else t.to(dtype)


@functools.lru_cache(maxsize=8)
def _eps_tensor(eps: float) -> torch.Tensor:
    return torch.tensor(eps, dtype=torch.float32)


def _cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` in fp32 as five ops without Python-scalar operands
    (fewer dispatches than ``F.rms_norm``).

    Each row's bits are its own (``vector_norm`` reduces within the row; checked alone against
    inside 2-1024 rows, on 1 and 2 threads), as speculation's exactness needs of every row-wise op."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # [..., 1]: sqrt(sum x^2)
    r = torch.addcmul(_eps_tensor(eps), n, n, value=1.0 / x.shape[-1]).rsqrt_()
    return torch.mul(x, r).mul_(weight)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[N, 2I]`` (gate | up) -> ``[N, I]``."""
    kernels = _kernels() if gate_up.is_cuda else None
    if kernels is not None:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.tensor_split(2, dim=-1)  # cheaper than chunk on a CPU row
    return F.silu(gate) * up

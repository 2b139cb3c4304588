"""What the model calls for every matmul, and the step's plan of the path its rows take.

``linear``, ``residual_linear`` and ``embedding`` take a plain tensor or a ``quant.QuantWeight``.
Which path a row takes is decided once per step (``plan_matmul``, called by ``step.plan_step``)
into a ``MatmulPlan`` that the model hands every call unchanged:

- ``wide``: the row ranges of windows of ``quant.WIDE_ROWS`` rows or more (prefill chunks), which a
  packed weight under torch's int4 kernel dequantizes for oneDNN's bf16 GEMM (``QuantWeight.mm``);
  chosen per window, so a row's bits depend on its own window only;
- ``solo``: the rows are one conversation's verify window run as one-row windows, each to round
  as it would alone: on CUDA every such row takes the Triton GEMV (``triton_gemv``) rather than
  cuBLAS's GEMM, whose kernel depends on the row count;
- ``rowinv`` (``--deterministic on``): every row of a plain CUDA weight, decode and prompt rows
  alike, takes the row-invariant GEMM (``triton_rowinv``), whose row bits depend on neither the
  row count nor the other rows (nor so on the prefill chunk a row falls in).

Else one row on CUDA takes the GEMV whatever the plan (batch-1 decode, the LM head's row).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from turnkv.models.pointwise import cast
from turnkv.models.quant import WIDE_ROWS, QuantWeight


@dataclass(frozen=True)
class MatmulPlan:
    """The matmul path of a step's rows (see the module docstring)."""

    wide: tuple[tuple[int, int], ...] = ()  # [start, end) row ranges of packed weights' wide path
    solo: bool = False  # one conversation's rows, each to round as alone
    rowinv: bool = False  # every CUDA row through the row-invariant GEMM (--deterministic on)

    def head(self) -> MatmulPlan:
        """The LM head's plan: its rows are the logit rows, which no ``wide`` range indexes."""
        return MatmulPlan((), self.solo, self.rowinv)


PLAIN = MatmulPlan()  # no wide rows, not solo


def plan_matmul(sizes: Sequence[int], solo: bool = False, rowinv: bool = False) -> MatmulPlan:
    """The plan of a step whose windows have ``sizes`` rows, back to back: windows of
    ``WIDE_ROWS`` rows or more take the wide path (adjacent ones merged into one range)."""
    out: list[tuple[int, int]] = []
    at = 0
    for n in sizes:
        if n >= WIDE_ROWS:
            if out and out[-1][1] == at:
                out[-1] = (out[-1][0], at + n)
            else:
                out.append((at, at + n))
        at += n
    return MatmulPlan(tuple(out), solo, rowinv)


@functools.lru_cache(maxsize=1)
def _triton_gemv():
    try:
        from turnkv.models import triton_gemv
    except ImportError:  # no Triton: cuBLAS everywhere
        return None
    return triton_gemv


@functools.lru_cache(maxsize=1)
def _triton_rowinv():
    from turnkv.models import triton_rowinv  # Triton is there: the engine checked (rowinv_route)

    return triton_rowinv


def rowinv_route(device: torch.device, deterministic: str) -> tuple[bool, str]:
    """Whether ``--deterministic`` ``on`` routes a plan's rows through the row-invariant GEMM on
    ``device``, and why (for /health): CUDA with Triton only; the CPU path's row bits do not depend
    on the other rows already (README, 'Determinism')."""
    if deterministic != "on":
        return False, "off"
    if device.type != "cuda":
        return False, f"on: {device.type} matmuls are row-invariant already"
    try:
        _triton_rowinv()
    except ImportError as exc:
        raise RuntimeError(f"--deterministic on needs Triton on CUDA: {exc}") from exc
    return True, "on: every matmul row through triton_rowinv"


def _rowinv_for(x: torch.Tensor, w: torch.Tensor, plan: MatmulPlan):
    """``triton_rowinv`` where ``plan.rowinv`` routes ``x @ w.T`` to it: a plain CUDA weight in
    x's dtype with unit inner strides; else None."""
    if not plan.rowinv or not w.is_cuda or w.dtype != x.dtype or w.stride(1) != 1 or x.stride(1) != 1:
        return None
    return _triton_rowinv()


def _gemv_for(x: torch.Tensor, w: torch.Tensor, solo: bool = False):
    """``triton_gemv`` where it serves ``x @ w.T`` on CUDA (what ``triton_gemv.takes``): one row
    (batch-1 decode), or with ``solo`` the rows of one conversation's verify window, which must
    round as each row alone does; else None. Rows of several conversations stay cuBLAS's GEMMs:
    the GEMV reads every weight tile once per row (from L2 after the first)."""
    if not w.is_cuda or (x.shape[0] != 1 and not solo):
        return None
    mod = _triton_gemv()
    return mod if mod is not None and mod.takes(x, w) else None


def input_dtype(w) -> torch.dtype | None:
    """The activation dtype ``linear`` hands ``w``'s kernel: bf16 for a ``QuantWeight`` (the
    int4 kernel's input; a norm before it can round to it at once), None for a plain tensor."""
    return torch.bfloat16 if isinstance(w, QuantWeight) else None


def linear(
    x: torch.Tensor,
    w,
    bias: torch.Tensor | None = None,
    plan: MatmulPlan = PLAIN,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in ``dtype`` (default x's), for a plain tensor or a ``QuantWeight``
    (the rows of ``plan.wide`` take its wide path). One row on CUDA takes the Triton GEMV, and so
    do ``plan.solo`` rows (``_gemv_for``)."""
    if isinstance(w, torch.Tensor):
        rowinv = _rowinv_for(x, w, plan)
        gemv = _gemv_for(x, w, plan.solo) if rowinv is None else None
        if rowinv is not None:
            y = rowinv.rowinv_linear(x, w, bias)
        else:
            y = gemv.gemv(x, w, bias) if gemv is not None else F.linear(x, w, bias)
    else:
        y = w.mm(x, plan.wide)
        y = torch.add(bias, y) if bias is not None else y  # add promotes to bias's dtype
        dtype = dtype or (x.dtype if bias is None else None)
    return y if dtype is None else cast(y, dtype)


def residual_linear(
    x: torch.Tensor, h: torch.Tensor, w, bias: torch.Tensor | None, plan: MatmulPlan = PLAIN
) -> torch.Tensor:
    """``x + h @ w.T (+ b)``; the add rides in the matmul (plain; one row or ``plan.solo`` rows on
    CUDA: the Triton GEMV) or in the cast back (packed)."""
    if isinstance(w, torch.Tensor):
        rowinv = _rowinv_for(h, w, plan) if x.dtype == h.dtype else None
        if rowinv is not None:
            return rowinv.rowinv_linear(h, w, bias, residual=x)
        gemv = _gemv_for(h, w, plan.solo) if x.dtype == h.dtype else None
        if gemv is not None:
            return gemv.gemv(h, w, bias, residual=x)
        if bias is None:
            return torch.addmm(x, h, w.t())
        return x + F.linear(h, w, bias)
    y = w.mm(h, plan.wide, residual=x)  # the C kernel adds it to its sums (one op fewer a call)
    return y if bias is None else y.add_(bias)


def embedding(ids: torch.Tensor, w, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows ``ids`` of an embedding matrix (plain or quantized) in ``dtype`` (default: w's)."""
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w)
    return w.lookup(ids).to(dtype or torch.float32)

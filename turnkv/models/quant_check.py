"""The packed matmuls' stated error and the load-time check (``turnkv.models.quant``'s module doc
gives the terms): ``error_bound`` per output against the GGUF's own dequantized values, for the
C kernel and for torch's int4 kernel (narrow and wide windows), and ``self_check``, which runs a
``QuantWeight`` on random rows and holds it to that bound."""

from __future__ import annotations

import torch

from turnkv.models.cpu_int4 import QMAX
from turnkv.models.quant import BF16_U, FP32_U, GROUP, Plane, QuantWeight, native_scales


def plane_values(p: Plane, native: bool = False) -> torch.Tensor:
    """fp64 ``[R, K]``: the values a kernel computes from this plane: the C kernel's fp16 scales
    and zeros (``native``), or torch's bf16 ones."""
    if native:
        s, z = (t.double().repeat_interleave(GROUP, dim=1) for t in native_scales(p))
        return p.u.double() * s + z
    s = p.scale.to(torch.bfloat16).double().repeat_interleave(GROUP, dim=1)
    z = p.zero.to(torch.bfloat16).double().repeat_interleave(GROUP, dim=1)
    return (p.u.double() - 8) * s + z


def error_bound(
    x: torch.Tensor, planes: list[Plane], ref: torch.Tensor, wide: bool = False, native: bool = False
) -> torch.Tensor:
    """Upper bound ``[M, R]`` of ``|mm(x) - x @ ref.T|`` for fp32 x ``[M, K]`` and the GGUF's fp32
    dequantized rows ``ref`` ``[R, K]`` whose planes are ``planes`` (see the module doc for the
    terms). ``wide``: torch's bf16 GEMM path, which also rounds each weight to bf16; ``native``:
    the C kernel (its stored scales, its int8 activations and its sums; it has no wide path)."""
    xa = x.double().abs()  # [M, K]
    vals = [plane_values(p, native) for p in planes]  # each [R, K]
    w = sum(vals)
    k = x.shape[-1]
    rep = xa @ (w - ref.double()).abs().T  # weights' stored scales and zeros
    if native and not wide:
        g = k // GROUP
        xb = x.to(torch.bfloat16).double().abs().view(-1, g, GROUP)  # [M, G, 32]
        step = xb.amax(-1) / QMAX * (1 + 4 * FP32_U)  # [M, G]: the C's activation step d
        wg = w.abs().view(w.shape[0], g, GROUP).sum(-1)  # [R, G]
        quant = (step / 2) @ wg.T  # each activation off its q d by at most d / 2
        xq = xb.sum(-1) + GROUP / 2 * step  # [M, G]: >= sum |q d| per group
        mag = sum(15 * s.double().abs() + z.double().abs() for s, z in map(native_scales, planes))
        sums = (4 + 2 * g * len(planes)) * FP32_U * (xq @ mag.T)  # the fp32 scaling and sums
        return 1.01 * (rep + BF16_U * (xa @ w.abs().T) + quant + sums) + 1e-30
    act = (2 if wide else 1) * BF16_U * (xa @ w.abs().T)  # activations (and weights) rounded to bf16
    out = sum((BF16_U + k * FP32_U) * (xa @ v.abs().T) for v in vals)  # per-plane rounding
    return 1.01 * (rep + act + out) + 1e-30


def self_check(
    qw: QuantWeight,
    planes: list[Plane],
    ref: torch.Tensor,
    rows: torch.Tensor,
    wide: bool = False,
    seed: int = 0,
):
    """Run ``qw`` on two random activation rows through the int4 kernel (and, with ``wide``, the
    wide path) and compare the sampled ``rows`` with the GGUF's dequantized values ``ref``
    (``[len(rows), K]``) against ``error_bound``. Returns ``(ok, worst ratio of error to bound)``.

    The load skips ``wide``: ``check_layout`` already proved that path's weights are the kernel's,
    rounded to bf16 once, which is what the bound's ``wide`` term allows for."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, qw.shape[1], generator=gen)  # [2, K]
    want = x.double() @ ref.double().T
    outs = {False: qw.mm(x)}  # 2 rows: the C or int4 kernel
    if wide and qw.wide_ok:
        outs[True] = torch.mm(x.to(torch.bfloat16), qw.dequant_t())
    ok, worst = True, 0.0
    for wide, y in outs.items():
        got = y.double()[:, rows]  # [2, R]
        ratio = ((got - want).abs() / error_bound(x, planes, ref, wide, qw.native)).max().item()
        ok = ok and bool(torch.isfinite(got).all()) and ratio <= 1.0
        worst = max(worst, ratio)
    return ok, worst

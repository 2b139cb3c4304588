"""Packed quantized weights for CPU: GGUF Q4_0, Q4_1 and Q8_0 kept at 4 bits a value.

The model's matmuls go through ``matmul.linear``, ``matmul.residual_linear`` and
``matmul.embedding``, which take either a plain tensor (today's dequantized path, and every HF
folder and GPU load) or a ``QuantWeight``. A ``QuantWeight`` holds one or two *planes*: values ``u`` in 0..15 and, per row
and group of 32 columns, a scale ``s`` and zero ``z``, read as ``(u - 8) * s + z``. The GGUF
blocks map onto that form without re-quantizing:

- Q4_0 ``(q - 8) * d``: one plane, ``u = q, s = d, z = 0``.
- Q4_1 ``q * d + m``: one plane, ``u = q, s = d, z = m + 8d``.
- Q8_0 ``q * d`` (q an int8): two planes, ``q = 16 h + l`` with ``h = q >> 4`` in -8..7 and
  ``l = q & 15``: ``u = h + 8, s = 16d, z = 0`` plus ``u = l, s = d, z = 8d``.

Two kernels multiply them, chosen at load:

- **C** (``cpu_int4``, wherever a C compiler builds it): the planes are stored with fp16 scales
  and zeros ``u * s + (z - 8s)``, the GGUF's own numbers, so the weights are exact; activations
  are quantized to int8 per row and group of 32 (llama.cpp's arithmetic for these formats: its
  Q8_0 activations), integer sums exact, scaling and the output fp32. See ``cpu_int4`` for speed.
- **torch's int4 kernel** (``_weight_int4pack_mm_for_cpu``; ``TURNKV_CPU_KERNEL=off`` or no
  compiler): it reads scales and zeros as bf16, takes bf16 activations and writes bf16.

Neither is bit-exact against the GGUF's fp32 dequantized values. ``error_bound`` states the
difference per output and ``self_check`` verifies it at load (both in ``quant_check``); the terms (``u = 2^-9``, bf16's
unit roundoff; ``e = 2^-24``, fp32's):

- weights: ``|W' - W|`` per value, computed exactly (zero for the C kernel's fp16 scales);
- activations: ``|x - bf16(x)| <= u |x|``;
- torch: each plane's output rounded to bf16 ``<= u |y_p|``, fp32 accumulation ``<= K e sum|x||W'|``;
- C: each activation is ``q d`` within ``d / 2`` (``d = max_g |x| / 127``, per group ``g``):
  ``<= sum_g d_g / 2 sum_{k in g} |W_k|``; the integer sums are exact, then per group a product
  and two FMAs into the row's sum: ``<= (4 + 2 G P) e sum_g (15 |s| + |z - 8s|) sum_{k in g} |q_k d_g|``.

Only the embedding *lookup* is exact: it dequantizes the gathered rows from the GGUF blocks.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

import torch
from torch import nn

from turnkv.config import Weights
from turnkv.models import cpu_int4
from turnkv.models.pointwise import cast

log = logging.getLogger(__name__)

GROUP = 32  # values per GGUF block = the kernel's group size
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
WEIGHT_MODES = get_args(Weights)  # config.py owns the values
BF16_U = 2.0**-9  # unit roundoff of bfloat16 (8 significant bits)
FP32_U = 2.0**-24
_ROW_ALIGN = 16  # the packer wants a multiple of 16 rows; pad with zero rows
# Rows from which a window dequantizes to bf16 + oneDNN GEMM (QuantWeight.mm), under torch's int4
# kernel only: from here that beats torch's int4 kernel (docs/BENCHMARKS.md, 'Figures moved out
# of code comments'). The C kernel has no wide path: with int8 activations it beats dequantize
# (in C) + GEMM at every window size measured ('CPU matmuls with int8 activations' there), so a
# prompt's rows round as its decode rows do.
WIDE_ROWS = 256


def kernel_missing() -> str | None:
    """Why the packed path cannot run here (no C kernel and no int4 op in torch), or None."""
    if cpu_int4.library() is not None:
        return None
    ops = torch.ops.aten
    for name in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"):
        if not hasattr(ops, name):
            return f"torch {torch.__version__} has no aten.{name} (needs torch>=2.6)"
    return None


def packed_kernel() -> str:
    """The kernel weights packed now multiply through: ``c`` (``cpu_int4``) where it loads, else
    ``torch-int4`` (``/health.weights.matmul``, the KV cache fingerprint)."""
    return "c" if cpu_int4.library() is not None else "torch-int4"


@functools.cache
def int4_layout() -> tuple[int, bool] | None:
    """How torch's CPU int4 packer lays out rows for the capability it runs (``ATEN_CPU_CAPABILITY``
    picks it): ``(rows per block, paired)``; each block is ``[K, rows / 2]`` bytes whose byte ``j``
    holds rows ``j`` and ``j + rows / 2`` (low, high nibble), or rows ``2j`` and ``2j + 1`` where
    ``paired``. Read off torch 2.5-2.13's packer; ``QuantWeight.check_layout`` verifies it on every
    load, so a torch that packs otherwise only loses the wide path. None: a layout not known."""
    return {"AVX512": (64, False), "AVX2": (32, False), "DEFAULT": (32, True)}.get(
        torch.backends.cpu.get_cpu_capability()
    )


def _int4_mm():
    """torch's int4 matmul op, looked up once (``torch.ops.aten.<name>`` is two lookups a call)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu


# ---- GGUF blocks -> planes --------------------------------------------------------------------
@dataclass
class Plane:
    """One int4 plane of ``rows`` rows: values ``u`` ``[R, K]`` in 0..15, fp32 ``scale``/``zero`` ``[R, K/32]``
    (before rounding to bf16): the plane's weight is ``(u - 8) * scale + zero`` per group."""

    u: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @staticmethod
    def zeros(rows: int, cols: int) -> Plane:
        g = cols // GROUP
        return Plane(
            torch.full((rows, cols), 8, dtype=torch.uint8), torch.zeros(rows, g), torch.zeros(rows, g)
        )


_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def planes_from_blocks(raw: torch.Tensor, type_name: str) -> list[Plane]:
    """GGUF blocks ``[R, row_bytes]`` (uint8) of a Q4_0/Q4_1/Q8_0 matrix -> its planes (see the module doc)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, _BLOCK_BYTES[type_name])  # [R, G, bytes]
    d = b[..., :2].contiguous().view(torch.float16)[..., 0].float()  # [R, G] scale
    if type_name == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).to(torch.int16)  # [R, G, 32]
        hi = ((q >> 4) + 8).to(torch.uint8).reshape(rows, -1)
        lo = (q & 15).to(torch.uint8).reshape(rows, -1)
        return [Plane(hi, 16 * d, torch.zeros_like(d)), Plane(lo, d, 8 * d)]
    qs = b[..., 4:] if type_name == "Q4_1" else b[..., 2:]  # [R, G, 16]
    # Byte j holds value j in its low nibble and value j+16 in its high nibble.
    u = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, -1)  # [R, K]
    if type_name == "Q4_0":
        return [Plane(u, d, torch.zeros_like(d))]
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0].float()  # [R, G] minimum
    return [Plane(u, d, m + 8 * d)]


def int8_form(planes: list[Plane]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q, d)``: int8 values ``[N, K]`` and fp16-exact scales ``[N, K/32]`` when ``planes`` are one
    int8 value times a scale (Q8_0's two planes, ``planes_from_blocks``), else None. The C kernel
    multiplies that form in one pass instead of two (the default model's tied LM head)."""
    if len(planes) != 2:
        return None
    hi, lo = planes
    d = lo.scale
    if not (torch.equal(hi.scale, 16 * d) and not hi.zero.any() and torch.equal(lo.zero, 8 * d)):
        return None
    if not torch.equal(d.to(torch.float16).float(), d):
        return None
    return (16 * (hi.u.to(torch.int16) - 8) + lo.u.to(torch.int16)).to(torch.int8), d


def native_scales(p: Plane) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernel's stored scale and zero of a plane (``u * s + z``), fp16 values as fp32."""
    zero = (p.zero.double() - 8 * p.scale.double()).to(torch.float16).float()
    return p.scale.to(torch.float16).float(), zero


# ---- the weight object ------------------------------------------------------------------------
class QuantWeight(nn.Module):
    """A ``[N, K]`` weight kept quantized. ``mm(x)`` is ``x @ W.T`` through the C kernel
    (``native``) or torch's int4 kernel; ``lookup(ids)`` gathers dequantized rows from the GGUF
    blocks (embeddings). Either part may be absent: an untied embedding needs no planes, an LM
    head needs no blocks.

    Invariants: ``native``: ``packed`` is the C layout ``[N/16 rounded up, K/32, P, 320]`` uint8
    (``cpu_int4.pack``), or ``[.., 1, 576]`` for the int8 form (``int8_form``, ``cpu_int4.pack_q8``),
    and ``scale_zeros`` None. Else planes hold ``rows_padded`` rows (a
    multiple of 16), the first ``shape[0]`` real; ``packed`` is ``[P, rows_padded, K/2]`` uint8,
    ``scale_zeros`` ``[P, K/32, rows_padded, 2]`` bf16.
    """

    def __init__(self, shape: tuple[int, int], planes: list[Plane] | None, blocks=None, block_type=""):
        super().__init__()
        self.shape = (int(shape[0]), int(shape[1]))
        self.block_type = block_type
        # [N, row_bytes] uint8 GGUF blocks or None; the loader passes a memory map of their own,
        # so only the pages of rows looked up become resident, file-backed (as in llama.cpp).
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("scale_zeros", None, persistent=False)
        self.wide_ok = False  # the wide-window path is enabled by check_layout
        self._views: tuple = (None, [])  # (packed, [(plane, scale_zeros)]) see _planes
        self._matrix: cpu_int4.Matrix | None = None  # the C call's bound matrix, see _int4
        self.native = bool(planes) and packed_kernel() == "c"
        if self.native:
            n, k = self.shape
            q8 = int8_form(planes)
            if q8 is not None:
                self.packed = cpu_int4.pack_q8(*q8, n, k)
            else:
                self.packed = cpu_int4.pack([(p.u, *native_scales(p)) for p in planes], n, k)
        elif planes:
            n, k = self.shape
            pad = -n % _ROW_ALIGN
            packs, szs = [], []
            for p in planes:
                u, s, z = p.u, p.scale, p.zero
                if pad:
                    filler = Plane.zeros(pad, k)
                    u, s, z = (
                        torch.cat([u, filler.u]),
                        torch.cat([s, filler.scale]),
                        torch.cat([z, filler.zero]),
                    )
                packs.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 2))
                szs.append(torch.stack([s, z], dim=-1).transpose(0, 1).to(torch.bfloat16))  # [G, Np, 2]
            self.packed = torch.stack(packs)  # [P, Np, K/2]
            self.scale_zeros = torch.stack(szs).contiguous()  # [P, G, Np, 2]

    @property
    def planes(self) -> int:
        """Passes of the kernel: 1 for the C kernel's int8 form, else the planes."""
        return 0 if self.packed is None else self.packed.shape[2 if self.native else 0]

    def nbytes(self) -> int:
        parts = (self.blocks, self.packed, self.scale_zeros)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def mm(
        self, x: torch.Tensor, wide: Sequence[tuple[int, int]] = (), residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T (+ residual)`` for x ``[..., K]`` (any float dtype) -> ``[..., N]``: fp32 from
        the C kernel, else bf16 (fp32 when two planes); ``residual`` ``[..., N]`` is added as
        ``torch.add(residual, y)`` adds (its dtype promotion included), in the C kernel's call
        where it runs (fp32: a bf16 residual widened exactly; one op fewer a call).

        The C kernel takes every row (one unpack per block of up to 10 rows), fp32 rows as they
        are (it rounds them to bf16 as the cast would). Under torch's int4
        kernel (one unpack per 4 rows), rows in the ``wide`` ranges ``[start, end)`` (the step's
        windows of ``WIDE_ROWS`` rows or more: prefill chunks; ``matmul.plan_matmul``) dequantize the
        planes to bf16 once and take oneDNN's bf16 GEMM instead (``wide_ok``, see ``WIDE_ROWS``).
        Chosen per window, not per call: a row's bits then depend on its own window only (the
        kernels are row-independent), never on what else shares the step."""
        # Only the calls that do something: a decode step makes ~120 of these (no-op .to/
        # .reshape/.contiguous calls each cost a dispatch; counted by the profiler, not timed).
        a = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, K]
        if not (self.native and a.dtype == torch.float32):
            a = cast(a, torch.bfloat16)
        a = a if a.is_contiguous() else a.contiguous()
        wide = wide if self.wide_ok else ()
        res = None if residual is None else residual.reshape(a.shape[0], self.shape[0])
        if self.native and not wide:
            y = self._c_matrix().mm(a, None if res is None else cast(res, torch.float32).contiguous())
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.shape[0])
        if not wide:
            y = self._int4(a)
        elif len(wide) == 1 and wide[0] == (0, a.shape[0]):
            y = torch.mm(a, self.dequant_t())  # [M, N]: one prefill chunk alone
        else:
            w_t, pieces, at = self.dequant_t(), [], 0
            for start, end in (*wide, (a.shape[0], a.shape[0])):
                if start > at:
                    pieces.append(self._int4(a[at:start]))
                if end > start:
                    pieces.append(torch.mm(a[start:end], w_t))
                at = end
            dtype = pieces[0].dtype if len({t.dtype for t in pieces}) == 1 else torch.float32
            y = torch.cat([t.to(dtype) for t in pieces])
        if res is not None:  # fp32 + bf16: the product cast first, then added in place, cheaper
            # than torch.add's promotion, which makes the same copy inside (docs/BENCHMARKS.md,
            # 'Per-token overhead cut', issue 11)
            y = y.float().add_(res) if res.dtype == torch.float32 else torch.add(res, y)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.shape[0])

    def _c_matrix(self) -> cpu_int4.Matrix:
        """The packed buffer bound for the C call, made again only when the buffer was replaced."""
        packed = self._buffers["packed"]
        if self._matrix is None or self._matrix.packed is not packed:
            self._matrix = cpu_int4.Matrix(packed, self.shape[0])
        return self._matrix

    def _planes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each plane's packed values and scales/zeros, indexed once: a decode step makes ~120
        int4 calls, and indexing ``packed[i]`` every time is two more ops per call. (The buffer
        is read from ``_buffers``: ``self.packed`` goes through ``nn.Module.__getattr__``.)"""
        packed = self._buffers["packed"]
        if self._views[0] is not packed:
            if packed is None:
                raise RuntimeError("this quantized weight keeps no packed planes (an untied embedding)")
            self._views = (packed, [(p, sz) for p, sz in zip(packed, self.scale_zeros, strict=True)])
        return self._views[1]

    def _int4(self, a: torch.Tensor) -> torch.Tensor:
        """Torch's int4 kernel (bf16 out; fp32 when two planes) over bf16 rows ``a`` ``[M, K]`` ->
        ``[M, N]`` (native weights never come here: ``mm`` calls the C kernel for them)."""
        mm = _int4_mm()
        (p0, sz0), *more = self._planes()
        y = mm(a, p0, GROUP, sz0)  # [M, Np]
        if more:
            y = y.float()
            for p, sz in more:
                y.add_(mm(a, p, GROUP, sz))
        n = self.shape[0]
        return y if y.shape[-1] == n else y[:, :n]

    def dequant_t(self) -> torch.Tensor:
        """``W.T`` as bf16 ``[K, N]`` from the packed planes (each value rounded to bf16 once).

        Reads torch's int4 layout for the CPU capability torch runs (``int4_layout``): per block of
        ``rows`` rows, ``[K, rows / 2]`` bytes. ``wide_ok`` is set only after ``check_layout`` saw
        this read back every value that was packed. (Torch's layout only: the C kernel has no wide
        path.)"""
        assert not self.native, "the C kernel's weights have no wide path (WIDE_ROWS)"
        layout = int4_layout()
        assert layout is not None, (
            f"torch's int4 layout for {torch.backends.cpu.get_cpu_capability()} is unknown"
        )
        rows, paired = layout
        p, np_, kh = self.packed.shape
        k, g, nb = 2 * kh, 2 * kh // GROUP, np_ // rows
        nib = self.packed.view(p, nb, k, rows // 2)
        lo, hi = nib & 15, nib >> 4
        # paired: byte j holds rows 2j (low) and 2j+1; else rows j (low) and j + rows/2
        u = torch.stack([lo, hi], dim=-1) if paired else torch.stack([lo, hi], dim=-2)
        u = u.reshape(p, nb, g, GROUP, rows)  # [P, NB, G, 32, rows]
        # scales and zeros apart first (1/32 of the values): strided broadcasts are slow kernels
        sc, ze = (
            self.scale_zeros[..., i].contiguous().view(p, g, nb, 1, rows).transpose(1, 2) for i in (0, 1)
        )
        w = _values(u, sc, ze)  # [NB, G, 32, rows]
        wt = w.reshape(nb, k, rows).transpose(0, 1).reshape(k, np_)  # [K, Np]
        return wt[:, : self.shape[0]]

    def check_layout(self, planes: list[Plane]) -> bool:
        """Enable the wide path if ``dequant_t`` reads back exactly the values of ``planes``
        (torch's int4 kernel; the C kernel needs none: ``WIDE_ROWS``)."""
        self.wide_ok = False
        n, k = self.shape
        layout = int4_layout()
        if self.native or self.packed is None or layout is None or n % layout[0]:
            return False
        u = torch.stack([pl.u.view(n, k // GROUP, GROUP) for pl in planes])  # [P, N, G, 32]
        s = torch.stack([pl.scale for pl in planes]).to(torch.bfloat16)[..., None]  # [P, N, G, 1]
        z = torch.stack([pl.zero for pl in planes]).to(torch.bfloat16)[..., None]
        want = _values(u, s, z).view(n, k)
        self.wide_ok = bool(torch.equal(self.dequant_t().T, want))
        return self.wide_ok

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` ``[M]`` -> fp32 ``[M, K]``: the GGUF's own dequantized values, exactly."""
        from turnkv.models.gguf import dequant_rows

        if self.blocks is None:
            raise RuntimeError("this quantized weight keeps no GGUF blocks (an LM head)")
        return dequant_rows(self.blocks[ids], self.block_type)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, planes={self.planes}, blocks={self.block_type or None}"


def _values(u: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sum over planes (dim 0) of ``(u - 8) * s + z`` (bf16 s, z broadcast), rounded to bf16 once."""
    if u.shape[0] == 1:  # (u - 8) * s is exact in fp32, so addcmul rounds once
        return torch.addcmul(z[0], u[0].to(torch.bfloat16) - 8, s[0])
    w = torch.addcmul(z.float(), u.float() - 8, s.float())  # each plane exact in fp32
    return w.sum(0).to(torch.bfloat16)

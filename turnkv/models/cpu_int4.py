"""The CPU matmul over 4-bit weights in C (``cpu_int4.c``): built at first use, called through ctypes.

Packed GGUF weights (``quant.QuantWeight``) run here wherever the C builds: one call per matrix
for all rows of a step (decode, verify and prefill windows alike: it beats dequantizing for
oneDNN's bf16 GEMM at every window size measured, ``quant.WIDE_ROWS``), its columns cut over
torch's OpenMP threads. The C unpacks a 32-value block once for up to 10 rows (torch's kernel
unpacks it again per 4), quantizes each row's activations to int8 per group of 32 (``quantize``:
what llama.cpp does for these formats) and with AVX512-VNNI multiplies four values of 16 columns
per instruction (AVX2: byte pairs, then pairs of pairs), in exact integer sums. Scales and zeros
stay fp16 (the GGUF's own numbers) and the output fp32; the error against the GGUF's values is
the activations' rounding (``quant_check.error_bound`` bounds it), as in llama.cpp. Speed:
``bench/cpu_matmul.py``, ``docs/BENCHMARKS.md``.

A row's bits do not depend on the other rows of the call (see the C file's header), so a
conversation's logits are the same alone and in company.

A weight binds its packed matrix once (``Matrix``) and a call passes only the rows: fp32 rows as
they are (the C rounds them to bf16 as ``.bfloat16()`` does) and, for o and down, the residual,
which the C adds to its sums (a decode step makes ~120 calls; each torch op or ctypes argument
saved is paid ~120 times a token). Each block prefetches the next block's bytes: a step's weights
stream from memory, in T tile streams the hardware prefetcher follows too late.

``TURNKV_CPU_KERNEL=off`` or a failed build (``status()`` says why) keep torch's int4 kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from turnkv import cbuild

SOURCE = Path(__file__).with_name("cpu_int4.c")
TILE = 16  # columns per tile
GROUP = 32
QUADS = GROUP // 4  # the C's unit: 4 inputs x 16 columns, one multiply-add instruction
PLANE_BYTES = 320  # per tile, group and plane: 16 fp16 scales, 16 fp16 zeros, 256 bytes of values
Q8_BYTES = 576  # the int8 form, per tile and group: 16 fp16 scales, 16 int16 column sums, 512 values
QMAX = 127  # activations are quantized to -127..127 per row and group of 32
# The C's rounding, named: part of the KV cache fingerprint (``load.cache_fingerprint``), so the
# disk tier never hands this kernel rows that another matmul's rounding computed. Change it
# whenever the C's arithmetic changes.
ARITHMETIC = "int8-activations"


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C's activation quantization, in torch: bf16 rows ``x`` ``[M, K]`` -> ``(q, d)``, int8
    ``q`` ``[M, K]`` and fp32 steps ``d`` ``[M, K/32]`` with ``x ~ q * d`` (within ``d / 2``), as
    llama.cpp quantizes activations for Q4_0/Q4_1/Q8_0 dot products. The same fp32 operations as
    the C (``127 / max|x|`` once per group, the product rounded to the nearest, ties to even), so
    the same values; tests build their oracles from it."""
    m, k = x.shape
    v = x.to(torch.bfloat16).float().view(m, k // GROUP, GROUP)
    amax = v.abs().amax(-1, keepdim=True)
    # a tensor over a tensor: torch computes ``scalar / tensor`` as a reciprocal times the scalar
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
    q = torch.round(v * inv).clamp(-QMAX, QMAX).to(torch.int8).view(m, k)
    return q, (amax / QMAX).squeeze(-1)


class _MatrixArgs(ctypes.Structure):
    """The C's ``tkv_matrix``: a packed matrix's constants, set once (``Matrix``)."""

    _fields_ = [(name, ctypes.c_int64) for name in ("k", "tiles", "planes", "n")] + [("w", ctypes.c_void_p)]


def _setup(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.turnkv_q4_mm.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, i64]
    lib.turnkv_q4_mm.restype = ctypes.c_int


KERNEL = cbuild.Kernel(SOURCE, _setup, "torch int4")
library = KERNEL.library  # the loaded kernel or None
set_enabled = KERNEL.set_enabled  # weights packed from now on use C (True) or torch's int4 kernel
status = KERNEL.status  # "ok" when packed weights multiply in C, else why torch's int4 kernel does


def pack(planes: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], n: int, k: int) -> torch.Tensor:
    """Planes ``(u [N, K] uint8 in 0..15, scale [N, K/32], zero [N, K/32])``, each meaning
    ``u * scale + zero``, -> the C layout ``[tiles, K/32, P, 320]`` uint8 (module doc of the C file).
    Columns are padded to a whole tile with zeros. Scales and zeros are stored as fp16: callers
    check the values they get back (``values``)."""
    tiles, g = -(-n // TILE), k // GROUP
    pad = tiles * TILE - n
    out = []
    for u, s, z in planes:
        if pad:
            u = torch.cat([u, u.new_zeros(pad, k)])
            s, z = (torch.cat([t, t.new_zeros(pad, g)]) for t in (s, z))
        u4 = u.view(tiles, TILE, g, QUADS, 2, 2)  # [tiles, col, G, quad, h, nibble]
        nib = (u4[..., 0] | (u4[..., 1] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, g, 256)
        sz = [
            t.to(torch.float16).view(tiles, TILE, g).transpose(1, 2).contiguous().view(torch.uint8)
            for t in (s, z)
        ]
        out.append(torch.cat([*sz, nib], dim=-1))  # [tiles, G, 320]
    return torch.stack(out, dim=2).contiguous()


def pack_q8(q: torch.Tensor, d: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 form (Q8_0): values ``q`` ``[N, K]`` int8 times fp16-exact scales ``d``
    ``[N, K/32]`` -> ``[tiles, K/32, 1, 576]`` uint8 (the C file's header)."""
    tiles, g = -(-n // TILE), k // GROUP
    pad = tiles * TILE - n
    if pad:
        q, d = torch.cat([q, q.new_zeros(pad, k)]), torch.cat([d, d.new_zeros(pad, g)])
    q5 = q.view(tiles, TILE, g, QUADS, 4)  # [tiles, col, G, quad, 4]
    vals = q5.permute(0, 2, 3, 1, 4).reshape(tiles, g, 512)
    sc = d.to(torch.float16).view(tiles, TILE, g).transpose(1, 2).contiguous().view(torch.uint8)
    # [tiles, G, 16]: each column's sum of its group's 32 values (the C takes back its 128 offset)
    colsum = q5.sum((-2, -1), dtype=torch.int32).to(torch.int16).transpose(1, 2).contiguous()
    return torch.cat([sc, colsum.view(torch.uint8), vals.view(torch.uint8)], dim=-1)[:, :, None]


def is_q8(packed: torch.Tensor) -> bool:
    return packed.shape[-1] == Q8_BYTES


def scales(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored fp16 scales and zeros as fp32 ``[P, N, K/32]`` each (the int8 form: zeros 0)."""
    tiles, g, p, _ = packed.shape
    sz = packed[..., :64].contiguous().view(torch.float16).float().view(tiles, g, p, 2, TILE)
    s, z = (sz[..., i, :].permute(2, 0, 3, 1).reshape(p, tiles * TILE, g)[:, :n] for i in (0, 1))
    return s, (torch.zeros_like(z) if is_q8(packed) else z)


def values(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The weights the C multiplies by, fp32 ``[N, K]`` (each ``sum_p u s + z``, or ``q s``, exact
    in fp32 for GGUF planes: a 4- or 8-bit value times an fp16 scale plus an fp16 zero)."""
    tiles, g, p, _ = packed.shape
    if is_q8(packed):
        q = packed[..., 64:].contiguous().view(torch.int8).view(tiles, g, QUADS, TILE, 4)
        u = q.permute(0, 3, 1, 2, 4).reshape(1, tiles * TILE, g, GROUP)[:, :n]
    else:
        nib = packed[..., 64:].view(tiles, g, p, QUADS, TILE, 2)
        u = torch.stack([nib & 15, nib >> 4], dim=-1)  # [tiles, G, P, quad, col, h, nibble]
        u = u.permute(2, 0, 4, 1, 3, 5, 6).reshape(p, tiles * TILE, g, GROUP)[:, :n]
    s, z = scales(packed, n)
    w = u.float() * s[..., None] + z[..., None]  # [P, N, G, 32]
    return w.sum(0).reshape(n, g * GROUP)


class Matrix:
    """A packed matrix bound for the C call, made once per weight (``QuantWeight`` keeps one): its
    shape checked and its constants in a C struct, so a call converts only the rows' pointers (a
    decode step makes ~120 calls; each argument ctypes converts costs ~0.1 us).

    Invariant: ``packed`` (kept alive here) is ``[tiles, K/32, P, 320]`` or the int8 form, ``n <=
    tiles * 16``; ``mm`` never reads past it."""

    __slots__ = ("_addr", "_args", "k", "n", "packed")

    def __init__(self, packed: torch.Tensor, n: int):
        tiles, g, p, _ = packed.shape
        if n > tiles * TILE or not packed.is_contiguous() or packed.dtype != torch.uint8:
            raise ValueError(
                f"cpu_int4.Matrix: at most {tiles * TILE} outputs from a contiguous uint8 packing; got "
                f"n={n} from {tuple(packed.shape)} {packed.dtype}"
            )
        self.packed, self.n, self.k = packed, n, g * GROUP
        self._args = _MatrixArgs(self.k, tiles, 0 if is_q8(packed) else p, n, packed.data_ptr())
        self._addr = ctypes.addressof(self._args)

    def mm(self, a: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``a @ W.T (+ residual)`` for rows ``a`` ``[M, K]``, bf16 or fp32 (rounded to bf16 in the C,
        as ``.bfloat16()`` rounds: the same bits as casting first), last dim contiguous -> fp32
        ``[M, n]``; ``residual``: fp32 ``[M, n]`` contiguous, added in the C (``y + residual`` in
        fp32, as torch's add). Weights packed for the C kernel keep using it after
        ``set_enabled(False)`` (which only decides how weights packed later are held)."""
        lib = KERNEL.lib or KERNEL.loaded
        assert lib is not None, "cpu_int4.mm needs the built kernel (check cpu_int4.library())"
        m, k = a.shape
        fp32 = a.dtype == torch.float32
        if k != self.k or not (fp32 or a.dtype == torch.bfloat16) or a.stride(-1) != 1:
            raise ValueError(
                f"cpu_int4.mm takes bf16 or fp32 rows of {self.k} values (last dim contiguous); got "
                f"{a.dtype} [{m}, {k}] stride {a.stride(-1)}"
            )
        out = torch.empty(m, self.n)
        res = 0
        if residual is not None:
            if residual.dtype != torch.float32 or residual.shape != out.shape or not residual.is_contiguous():
                raise ValueError(f"cpu_int4.mm: residual must be fp32 [{m}, {self.n}] contiguous")
            res = residual.data_ptr()
        rc = lib.turnkv_q4_mm(
            self._addr, m, a.data_ptr(), a.stride(0), fp32, out.data_ptr(), res, torch.get_num_threads()
        )
        if rc:
            raise RuntimeError(f"turnkv_q4_mm failed ({rc})")
        return out


def mm(a: torch.Tensor, packed: torch.Tensor, n: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``Matrix(packed, n).mm(a, residual)``: for a matrix multiplied once (tests, benches)."""
    return Matrix(packed, n).mm(a, residual)

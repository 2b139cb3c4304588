"""The CPU matmul over 4-bit weights in C (``cpu_int4.c``): built at first use, called through ctypes.

Packed GGUF weights (``quant.QuantWeight``) run here wherever the C builds: one call per matrix
for the rows of a step's narrow windows (decode, verify, prefill chunks under ``quant.WIDE_ROWS``
rows), its columns cut over torch's OpenMP threads; wide windows take ``dequant_t`` and oneDNN's
bf16 GEMM. Against torch's int4 kernel on the 2-core AVX-512 VM (the default model's shapes, one
process, ``bench/cpu_matmul.py``): 1.2-1.6x at one row and 1.5-2.2x at 8-32 rows, because the C
unpacks a 32-value block once for up to 10 rows (torch's kernel unpacks it again per 4) and with
AVX512-BF16 multiplies two values and 16 columns per instruction. Its error against the GGUF's
own values is ~1000x smaller: scales and zeros stay fp16 (exact) and the output fp32.

A row's bits do not depend on the other rows of the call (see the C file's header), so a
conversation's logits are the same alone and in company.

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
PLANE_BYTES = 320  # per tile, group and plane: 16 fp16 scales, 16 fp16 zeros, 256 bytes of values
Q8_BYTES = 576  # the int8 form, per tile and group: 16 fp16 scales, 32 unused, 512 bytes of values
# The C's unpacked value is 128 + u where the CPU has AVX512-BF16 (else u); its sums' error
# bound (quant_check.error_bound) uses the larger.
VALUE_OFFSET = 128


def _setup(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.turnkv_q4_mm.argtypes = [i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64]
    lib.turnkv_q4_mm.restype = ctypes.c_int
    lib.turnkv_q4_dequant.argtypes = [i64, i64, i64, ptr, ptr, i64, i64]
    lib.turnkv_q4_dequant.restype = ctypes.c_int


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
        u4 = u.view(tiles, TILE, g, GROUP // 2, 2)
        nib = (u4[..., 0] | (u4[..., 1] << 4)).permute(0, 2, 3, 1).reshape(tiles, g, 256)
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
    # [tiles, 16 cols, G, 16 units, 2] -> per unit: columns 0-7 then 8-15, each (2j, 2j + 1)
    vals = q.view(tiles, TILE, g, GROUP // 2, 2).permute(0, 2, 3, 1, 4).reshape(tiles, g, 512)
    sc = d.to(torch.float16).view(tiles, TILE, g).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([sc, sc.new_zeros(tiles, g, 32), vals.view(torch.uint8)], dim=-1)[:, :, None]


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
        q = packed[..., 64:].contiguous().view(torch.int8).view(tiles, g, GROUP // 2, TILE, 2)
        u = q.permute(0, 3, 1, 2, 4).reshape(1, tiles * TILE, g, GROUP)[:, :n]
    else:
        nib = packed[..., 64:].view(tiles, g, p, GROUP // 2, TILE)
        u = torch.stack([nib & 15, nib >> 4], dim=-1)  # [tiles, G, P, 16 units, 16 cols, 2]
        u = u.permute(2, 0, 4, 1, 3, 5).reshape(p, tiles * TILE, g, GROUP)[:, :n]
    s, z = scales(packed, n)
    w = u.float() * s[..., None] + z[..., None]  # [P, N, G, 32]
    return w.sum(0).reshape(n, g * GROUP)


def dequant_t(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``W.T`` as bf16 ``[K, n]``: ``values`` rounded to bf16 once, for the wide windows' GEMM
    (one pass in C, columns over torch's threads: the torch-op unpacking cost 3-6 ms a matrix)."""
    lib = KERNEL.lib or KERNEL.loaded
    assert lib is not None, "cpu_int4.dequant_t needs the built kernel (check cpu_int4.library())"
    tiles, g, p, _ = packed.shape
    out = torch.empty(g * GROUP, n, dtype=torch.bfloat16)
    rc = lib.turnkv_q4_dequant(g * GROUP, tiles, 0 if is_q8(packed) else p, packed.data_ptr(), out.data_ptr(), n,
                               torch.get_num_threads())  # fmt: skip
    if rc:
        raise RuntimeError(f"turnkv_q4_dequant failed ({rc})")
    return out


def mm(a: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``a @ W.T`` for bf16 rows ``a`` ``[M, K]`` (last dim contiguous) -> fp32 ``[M, n]``. Weights
    packed for the C kernel keep using it after ``set_enabled(False)`` (which only decides how
    weights packed later are held)."""
    lib = KERNEL.lib or KERNEL.loaded
    assert lib is not None, "cpu_int4.mm needs the built kernel (check cpu_int4.library())"
    m, k = a.shape
    tiles, g, p, _ = packed.shape
    if k != g * GROUP or a.dtype != torch.bfloat16 or a.stride(-1) != 1 or n > tiles * TILE:
        raise ValueError(
            f"cpu_int4.mm takes bf16 rows of {g * GROUP} values (last dim contiguous) for at most "
            f"{tiles * TILE} outputs; got {a.dtype} [{m}, {k}] stride {a.stride(-1)}, n={n}"
        )
    out = torch.empty(m, n)
    rc = lib.turnkv_q4_mm(m, k, tiles, 0 if is_q8(packed) else p, a.data_ptr(), a.stride(0), packed.data_ptr(), out.data_ptr(),
                          n, n, torch.get_num_threads())  # fmt: skip
    if rc:
        raise RuntimeError(f"turnkv_q4_mm failed ({rc})")
    return out

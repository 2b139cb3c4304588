"""Triton kernels that write a step's new K/V rows into each sequence's window rows (the tail of
its cache), reading where from the step's segment table (``segment_table.py``: its ``dest`` rows).

``rope_store`` also applies RoPE to q and k on the way (rounded as ``rope.apply_rope``) and writes q for
the attention launch: one kernel per layer instead of RoPE's three, a roll's two copies and the
store. ``store_kv`` stores K/V that already are in their final form (tests, the self-check).
Both are graph-safe: everything about the destinations is read from device memory; padding
sequences (``q_len`` 0) write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from turnkv.attention.segment_table import FIELDS, TableMeta
from turnkv.kernels.triton_common import INTERPRET, downcast

_BLOCK_ELEMS = 4096  # elements per RoPE program: rows x heads x head_dim


@triton.jit(do_not_specialize=["LAYER"])
def _rope_store_kernel(
    QK, V, Cos, Sin, Q, Dest, LAYER,
    sqkm, sqkh, svm, svh, scm, ssm, sqm, sqh, HQ, HKV,
    H_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """``BLOCK_R`` window rows x ``H_BLOCK`` heads of sequence ``b``. Heads are numbered q heads,
    then k heads, then v heads: RoPE on q and k; q -> ``Q``; k and v -> the cache rows of
    ``Dest[b]``. Blocks of heads in their own programs keep a one-row step from being one program."""
    b = tl.program_id(0)
    d = Dest + b * 8
    q_start = tl.load(d + 6)
    q_len = tl.load(d + 7)  # 0 for padding sequences
    elt = V.dtype.element_ty
    k_base = tl.load(d).to(tl.pointer_type(elt))
    v_base = tl.load(d + 1).to(tl.pointer_type(elt))
    idx = tl.arange(0, BLOCK_R * H_BLOCK)  # (window row, head) pairs
    i = tl.program_id(1) * BLOCK_R + idx // H_BLOCK
    h = (tl.program_id(2) * H_BLOCK + idx % H_BLOCK)[:, None]
    live = (i < q_len)[:, None]
    roped = live & (h < HQ + HKV)
    r = (q_start + i)[:, None]  # flat rows of the step (int64)
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    rolled = (offs_d + HEAD_DIM // 2) % HEAD_DIM  # roll(x, D/2)[d] == x[(d + D/2) % D]
    src = QK + r * sqkm + h * sqkh
    x = tl.load(src + offs_d, mask=roped, other=0.0).to(tl.float32)
    xr = tl.load(src + rolled, mask=roped, other=0.0).to(tl.float32)
    cos = tl.load(Cos + r * scm + offs_d, mask=roped, other=0.0).to(tl.float32)
    sin = tl.load(Sin + r * ssm + offs_d, mask=roped, other=0.0).to(tl.float32)  # signed: first half negated
    # rounded as torch's addcmul(x * cos, roll(x), sin) rounds, so both backends agree bit for bit
    out = downcast(downcast(x * cos, elt, INTERP).to(tl.float32) + xr * sin, elt, INTERP)
    tl.store(Q + r * sqm + h * sqh + offs_d, out, mask=roped & (h < HQ))
    row = (tl.load(d + 5) + i)[:, None]  # the window's rows in the last view
    layer_off = LAYER * tl.load(d + 2)
    head_stride = tl.load(d + 3)
    row_off = row * tl.load(d + 4)
    tl.store(k_base + layer_off + (h - HQ) * head_stride + row_off + offs_d, out, mask=roped & (h >= HQ))
    hv = h - HQ - HKV
    vmask = live & (hv >= 0) & (hv < HKV)
    vals = tl.load(V + r * svm + hv * svh + offs_d, mask=vmask, other=0.0)
    tl.store(v_base + layer_off + hv * head_stride + row_off + offs_d, vals, mask=vmask)


@triton.jit(do_not_specialize=["LAYER"])
def _store_kv_kernel(
    K, V, Dest, LAYER, skm, skh, svm, svh, HKV,
    HKV_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``BLOCK_R`` rows of sequence ``b``'s new K/V (rows of ``[N, Hkv, D]``) into its window rows."""
    b = tl.program_id(0)
    d = Dest + b * 8
    q_start = tl.load(d + 6)
    q_len = tl.load(d + 7)  # 0 for padding sequences
    elt = K.dtype.element_ty
    k_base = tl.load(d).to(tl.pointer_type(elt))
    v_base = tl.load(d + 1).to(tl.pointer_type(elt))
    idx = tl.arange(0, BLOCK_R * HKV_P2)  # (window row, kv head) pairs
    i = tl.program_id(1) * BLOCK_R + idx // HKV_P2
    h = idx % HKV_P2
    offs_d = tl.arange(0, HEAD_DIM)
    mask = ((i < q_len) & (h < HKV))[:, None] & (offs_d < HEAD_DIM)[None, :]
    r = (q_start + i)[:, None]  # flat rows of the step (int64)
    k = tl.load(K + r * skm + h[:, None] * skh + offs_d[None, :], mask=mask)
    v = tl.load(V + r * svm + h[:, None] * svh + offs_d[None, :], mask=mask)
    row = tl.load(d + 5) + i  # the window's rows in the last view
    dst = (
        LAYER * tl.load(d + 2) + h[:, None] * tl.load(d + 3) + row[:, None] * tl.load(d + 4) + offs_d[None, :]
    )
    tl.store(k_base + dst, k, mask=mask)
    tl.store(v_base + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, packed: torch.Tensor, meta: TableMeta, layer: int) -> None:
    """Write ``k``, ``v`` ``[N, Hkv, D]`` (last dim contiguous) into every sequence's window rows."""
    _, hkv, d = k.shape
    if meta.max_q == 0:
        return
    dest = packed[meta.table_words : meta.table_words + meta.batch * FIELDS]
    hp2 = triton.next_power_of_2(hkv)
    block_r = max(1, min(triton.next_power_of_2(meta.max_q), 4096 // (hp2 * d)))  # <= 4K elements
    grid = (meta.batch, triton.cdiv(meta.max_q, block_r))
    _store_kv_kernel[grid](
        k, v, dest, layer, k.stride(0), k.stride(1), v.stride(0), v.stride(1), hkv,
        HKV_P2=hp2, HEAD_DIM=d, BLOCK_R=block_r, num_warps=4,
    )  # fmt: skip


def rope_store(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    packed: torch.Tensor,
    meta: TableMeta,
    layer: int,
    q_out: torch.Tensor,
) -> torch.Tensor:
    """RoPE on ``qk`` ``[N, Hq + Hkv, D]`` at ``cos``/signed ``sin`` ``[N, D]``; q into ``q_out``
    ``[N, Hq, D]``, k and ``v`` ``[N, Hkv, D]`` into the window rows of ``packed``'s sequences."""
    _, heads, d = qk.shape
    hkv = v.shape[1]
    if meta.max_q == 0:
        return q_out
    dest = packed[meta.table_words : meta.table_words + meta.batch * FIELDS]
    h_block = min(8, triton.next_power_of_2(heads + hkv))
    block_r = max(1, min(triton.next_power_of_2(meta.max_q), _BLOCK_ELEMS // (h_block * d)))
    grid = (meta.batch, triton.cdiv(meta.max_q, block_r), triton.cdiv(heads + hkv, h_block))
    _rope_store_kernel[grid](
        qk, v, cos, sin, q_out, dest, layer,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), heads - hkv, hkv,
        H_BLOCK=h_block, HEAD_DIM=d, BLOCK_R=block_r, INTERP=INTERPRET, num_warps=4,
    )  # fmt: skip
    return q_out

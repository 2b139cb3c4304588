"""Fused attention over a segment table: one Triton launch reads every segment, split over the keys.

A batch of ``B`` sequences, each a window of ``M`` query rows (``q [B, Hq, M, D]``) over its own list
of KV views ``[(k, v)]`` (each ``[Hkv, T_i, D]``, zero-copy strided slices with the last dim
contiguous). The keys of a sequence are the concatenation of its views (``T`` rows); query row ``i``
sees key ``p`` iff ``p <= window_start + i`` (``window_start = T - q_len`` by default), as in
``reference.py``. Rows ``i >= q_len`` (batch padding) and rows that see no key come out as zeros.

How one launch covers it:
- The *segment table* is one packed int64 tensor ``[B, G, 1 + MAX_SEGMENTS, 8]``: per group of up to
  ``MAX_SEGMENTS`` views a header row ``(n_segments, group_start, group_len, window_start, q_len)``
  and one row per view ``(k_ptr, v_ptr, k_head_stride, k_row_stride, v_head_stride, v_row_stride,
  length, start)``; pointers are raw device addresses, so nothing is gathered or concatenated and
  building it costs one small host-to-device copy.
- Grid ``(row_blocks, G * splits, B * Hkv)``. A program owns one KV head, ``BLOCK_M`` rows of the
  ``GQA * M`` query rows of that head's group (so every loaded K/V tile serves all its query heads)
  and one contiguous key range of its group (flash-decoding split). It walks the views that overlap
  its range; tiles never cross a view, and the causal mask is only evaluated on tiles that need it.
- With one program per (row block, head) (``G * splits == 1``) the kernel writes the result
  directly. Otherwise each program writes an fp32 partial and its log2-sum-exp, and a combine pass
  merges all partials of a row (splits and groups alike) and rounds once to the query dtype.

Precision: q·k in the tensor cores with fp32 accumulation; probabilities are rounded to the input
dtype before P·V (as every flash kernel does); partials and the merge are fp32; one final rounding.

CUDA graphs: ``segment_attention`` with a table built beforehand and a fixed ``config`` is
capturable. The table is read from device memory at run time, so a captured decode step can be
replayed after ``SegmentTable.update_`` rewrote pointers and lengths in place (the grid depends on
``splits`` and the row blocks, never on the lengths; pick ``splits`` for the longest context the
graph will see). ``fused_attention`` (the router's callable) builds a table per call and refuses to
run inside a capture (a captured upload would replay stale host memory). Under ``torch.compile`` it
is the opaque custom op ``turnkv::segment_attention``, tagged ``cudagraph_unsafe`` so that
``mode="reduce-overhead"`` leaves it outside its graphs.

Triton is imported at module import; import this module only where triton is known to exist.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from turnkv.attention.lse import lse_attention

log = logging.getLogger(__name__)

MAX_SEGMENTS = 12  # views per group; more form several groups merged by the combine pass
FIELDS = 8  # int64 words per table row
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_GQA = 8
LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as triton itself does

Views = list[tuple[torch.Tensor, torch.Tensor]]


class UnsupportedViews(ValueError):
    """Views the kernel cannot read in place (dtype, device, alignment or a non-contiguous last dim)."""


# ---------------------------------------------------------------------------------------------
# The segment table
# ---------------------------------------------------------------------------------------------


@dataclass
class SegmentTable:
    """The packed per-call description of every sequence's views; lives on the device.

    Invariants: ``packed`` is int64 ``[B, groups, 1 + MAX_SEGMENTS, FIELDS]`` on the views' device;
    ``max_keys`` is the longest sequence's key count (host-side, for choosing the split count);
    ``q_len`` holds each sequence's window rows; every view has ``kv_heads`` heads. The kernel reads
    nothing else about the views.
    """

    packed: torch.Tensor
    groups: int
    max_keys: int
    q_len: tuple[int, ...]
    kv_heads: int

    @property
    def batch(self) -> int:
        return self.packed.shape[0]

    def update_(self, seqs: list[Views], q_lens: list[int] | int, window_starts=None) -> SegmentTable:
        """Rewrites the table in place (same buffer) for new views; for replaying a CUDA graph.

        The new views must need no more groups than the buffer has.
        """
        words, groups, max_keys, q_len, _ = _pack(seqs, q_lens, window_starts, self.groups)
        if groups > self.groups:
            raise ValueError(f"{groups} groups do not fit a table built for {self.groups}")
        self.packed.copy_(_host_words(words, self.packed.device).view_as(self.packed), non_blocking=True)
        self.max_keys, self.q_len = max_keys, q_len
        return self


def _host_words(words: list[int], device: torch.device) -> torch.Tensor:
    # pinned (from torch's caching host allocator, which keeps a block until its copy is done), so
    # the upload is one asynchronous copy that does not wait for the GPU
    return torch.tensor(words, dtype=torch.int64, pin_memory=device.type == "cuda")


def _pack(
    seqs: list[Views], q_lens: list[int] | int, window_starts, min_groups: int = 1
) -> tuple[list[int], int, int, tuple[int, ...], tuple]:
    """The flat int64 words of a table for ``seqs``, its group count, max keys, q lengths and the
    layout every view shares ``(dtype, device index, Hkv, D)``.

    Checks each view in the same pass (this runs once per layer per decode step, so it is kept to
    plain integer tests); raises ``UnsupportedViews`` for a view the kernel cannot read in place.
    """
    b = len(seqs)
    q_len = tuple([q_lens] * b if isinstance(q_lens, int) else q_lens)
    groups = max(min_groups, max(1, *(math.ceil(len(v) / MAX_SEGMENTS) for v in seqs)))
    k0 = seqs[0][0][0]
    dtype, dev, hkv, d = k0.dtype, k0.get_device(), k0.shape[0], k0.shape[-1]
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedViews(f"dtype {dtype} (the kernel takes bf16/fp16)")
    vec = 16 // k0.element_size()  # elements per 16 bytes
    words: list[int] = []
    max_keys = 0
    for s, views in enumerate(seqs):
        rows = []
        start = 0
        for k, v in views:
            if k.dtype != dtype or v.dtype != dtype or k.get_device() != dev or v.get_device() != dev:
                raise UnsupportedViews(
                    f"view {k.dtype}/{v.dtype} on {k.device}, expected {dtype} like the first"
                )
            if k.dim() != 3 or k.shape != v.shape or k.shape[0] != hkv or k.shape[2] != d:
                raise UnsupportedViews(f"views {tuple(k.shape)}/{tuple(v.shape)}, expected [{hkv}, T, {d}]")
            n = k.shape[1]
            ks, vs = k.stride(), v.stride()
            kp, vp = k.data_ptr(), v.data_ptr()
            # 16-byte aligned rows: the kernel promises the compiler so, to get 128-bit loads
            if n and (ks[2] != 1 or vs[2] != 1 or (kp | vp) & 15 or (ks[0] | ks[1] | vs[0] | vs[1]) % vec):
                raise UnsupportedViews(f"view strides {ks}/{vs} or address not 16-byte aligned rows")
            rows.append((kp, vp, ks[0], ks[1], vs[0], vs[1], n, start))
            start += n
        max_keys = max(max_keys, start)
        ws = start - q_len[s] if window_starts is None else window_starts[s]
        for g in range(groups):
            chunk = rows[g * MAX_SEGMENTS : (g + 1) * MAX_SEGMENTS]
            g_start = chunk[0][7] if chunk else start
            words += (len(chunk), g_start, sum(r[6] for r in chunk), ws, q_len[s], 0, 0, 0)
            for r in chunk:
                words += r
            words += [0] * FIELDS * (MAX_SEGMENTS - len(chunk))
    return words, groups, max_keys, q_len, (dtype, dev, hkv, d)


def build_table(
    seqs: list[Views], q_lens: list[int] | int, window_starts: list[int] | None = None
) -> SegmentTable:
    """One packed table for a batch: ``seqs[b]`` is sequence b's views in row order.

    ``q_lens``: window rows per sequence (an int for all); ``window_starts`` defaults to
    ``T_b - q_len_b``. Raises ``UnsupportedViews`` for views the kernel cannot read in place.
    """
    words, groups, max_keys, q_len, (_, _, hkv, _) = _pack(seqs, q_lens, window_starts)
    device = seqs[0][0][0].device
    packed = _host_words(words, device).view(len(seqs), groups, 1 + MAX_SEGMENTS, FIELDS)
    return SegmentTable(packed.to(device, non_blocking=True), groups, max_keys, q_len, hkv)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _downcast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """fp32 -> dtype, rounding to nearest even. The CPU interpreter truncates fp32 -> bf16, so there
    the bits are rounded first (the cast is then exact); compiled code rounds in the cvt itself."""
    if INTERP:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _tiles(
    acc, m_i, l_i, q, k_base, v_base, ksr, vsr, lo, hi, seg_start, ws, row_i, offs_d, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Online softmax over key tiles [lo, hi) of one view (global key positions)."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] global key positions
        loc = (offs_n - seg_start).to(tl.int64)  # row inside the view
        k_ptrs = k_base + loc[None, :] * ksr + offs_d[:, None]  # [D, BN]
        v_ptrs = v_base + loc[:, None] * vsr + offs_d[None, :]  # [BN, D]
        if MASKED:
            inb = offs_n < hi
            k = tl.load(k_ptrs, mask=inb[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if INTERP:  # the CPU interpreter multiplies bf16 bit patterns as integers; upcast there
            s = tl.dot(q.to(tl.float32), k.to(tl.float32)) * qk_scale
        else:
            s = tl.dot(q, k) * qk_scale  # [BM, BN] in log2 units
        if MASKED:
            vis = inb[None, :] & (offs_n[None, :] <= ws + row_i[:, None])
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: keep exp2 finite
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=inb[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        p = _downcast(p, v.dtype, INTERP)  # rounded to the input dtype before P·V, on every path
        if INTERP:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _segment_attn_kernel(
    Q, Out, PartO, PartL, Table,
    sqb, sqh, sqm, sob, soh, som,
    HKV, GQA, M, NSPLIT, NGROUPS, NPART,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SEG: tl.constexpr,
    SEG_P2: tl.constexpr, DIRECT: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    # row blocks vary fastest, so the blocks that share a key range run side by side and all but
    # the first find its K/V tiles in L2
    pid_m = tl.program_id(0)  # row block of the GQA * M rows of this kv head
    pid_p = tl.program_id(1)  # group * NSPLIT + split
    pid_bh = tl.program_id(2)  # b * HKV + kv head
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    grp = pid_p // NSPLIT
    split = pid_p % NSPLIT

    hdr = Table + ((b * NGROUPS + grp) * (MAX_SEG + 1)).to(tl.int64) * 8
    nseg = tl.load(hdr)
    g_start = tl.load(hdr + 1)
    g_len = tl.load(hdr + 2)
    ws = tl.load(hdr + 3)
    q_len = tl.load(hdr + 4)
    # this program's key range (global positions), whole tiles except at the group's end
    chunk = tl.cdiv(tl.cdiv(g_len, NSPLIT), BLOCK_N) * BLOCK_N
    lo = g_start + split * chunk
    hi = tl.minimum(lo + chunk, g_start + g_len)

    # rows r = g * M + i: query head kvh * GQA + g, window row i
    r0 = pid_m * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < GQA * M
    g = rows // M
    row_i = rows % M
    r1 = tl.minimum(r0 + BLOCK_M, GQA * M) - 1
    one_head = (r0 // M) == (r1 // M)
    i_min = tl.where(one_head, r0 % M, 0)
    i_max = tl.minimum(tl.where(one_head, r1 % M, M - 1), q_len - 1)
    see_hi = tl.minimum(hi, ws + i_max + 1)  # no row of the block sees a key at or past this
    full_hi = tl.minimum(see_hi, ws + i_min + 1)  # every row of the block sees keys before this

    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * sqb + (kvh * GQA + g)[:, None] * sqh + row_i[:, None] * sqm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BM, D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    elt = Q.dtype.element_ty
    kvh64 = kvh.to(tl.int64)
    # The views overlapping [lo, see_hi) are a run of consecutive indices. Their bounds come in one
    # vector load (a loop of scalar loads would be a chain of dependent round trips); the vectors
    # die before the tile loop, so they cost no registers there.
    sidx = tl.arange(0, SEG_P2)
    srow = hdr + (sidx + 1).to(tl.int64) * 8
    smask = sidx < nseg
    s_start = tl.load(srow + 7, mask=smask, other=0)
    s_end = s_start + tl.load(srow + 6, mask=smask, other=0)
    live = smask & (tl.maximum(lo, s_start) < tl.minimum(see_hi, s_end))
    first = tl.min(tl.where(live, sidx, SEG_P2), 0)
    last = tl.max(tl.where(live, sidx, -1), 0)
    for s in range(first, last + 1):
        e = hdr + (s + 1) * 8  # this view's row: 8 independent loads, one round trip
        seg_start = tl.load(e + 7)
        a = tl.maximum(lo, seg_start)
        z = tl.minimum(see_hi, seg_start + tl.load(e + 6))
        # element strides are 16-byte multiples and pointers 16-byte aligned (build_table checks),
        # which lets K/V loads go 128-bit; the pointer hint must follow the int-to-pointer cast
        k_base = tl.multiple_of(tl.load(e).to(tl.pointer_type(elt)), 16)
        v_base = tl.multiple_of(tl.load(e + 1).to(tl.pointer_type(elt)), 16)
        k_base += kvh64 * tl.multiple_of(tl.load(e + 2), 8)
        v_base += kvh64 * tl.multiple_of(tl.load(e + 4), 8)
        ksr = tl.multiple_of(tl.load(e + 3), 8)
        vsr = tl.multiple_of(tl.load(e + 5), 8)
        # whole tiles every row sees without a mask, then the rest (view end, causal edge)
        full_end = a + tl.maximum(tl.minimum(z, full_hi) - a, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _tiles(
            acc, m_i, l_i, q, k_base, v_base, ksr, vsr, a, full_end, seg_start, ws, row_i,
            offs_d, qk_scale, BLOCK_N, False, INTERP,
        )  # fmt: skip
        acc, m_i, l_i = _tiles(
            acc, m_i, l_i, q, k_base, v_base, ksr, vsr, full_end, z, seg_start, ws, row_i,
            offs_d, qk_scale, BLOCK_N, True, INTERP,
        )  # fmt: skip

    l_i = tl.where(row_i < q_len, l_i, 0.0)  # batch padding rows: as if they saw nothing
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o = tl.where((l_i > 0)[:, None], o, 0.0)
    head = kvh * GQA + g
    o_rows = Out + b * sob + head * soh + row_i * som  # [BM] row pointers; [BM, D] only at a store
    if DIRECT:
        tl.store(
            o_rows[:, None] + offs_d[None, :],
            _downcast(o, Out.dtype.element_ty, INTERP),
            mask=row_ok[:, None],
        )
    else:
        prow = ((b * (HKV * GQA) + head) * M + row_i).to(tl.int64) * NPART  # [BM] first partial
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(PartL + prow + pid_p, lse, mask=row_ok)
        tl.store(PartO + (prow + pid_p)[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])


@triton.jit
def _combine_kernel(
    PartO, PartL, Out, HQ, M, NPART, sob, soh, som,
    HEAD_DIM: tl.constexpr, NP2: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """One output row: the exact log-sum-exp merge of its partials, rounded once."""
    row = tl.program_id(0)  # (b * HQ + h) * M + i
    b = row // (HQ * M)
    h = (row // M) % HQ
    i = row % M
    offs_p = tl.arange(0, NP2)
    offs_d = tl.arange(0, HEAD_DIM)
    pm = offs_p < NPART
    base = row.to(tl.int64) * NPART
    lse = tl.load(PartL + base + offs_p, mask=pm, other=float("-inf"))  # [NP2]
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.math.exp2(lse - mx)  # 0 for partials that saw nothing
    o = tl.load(PartO + (base + offs_p)[:, None] * HEAD_DIM + offs_d[None, :], mask=pm[:, None], other=0.0)
    num = tl.sum(w[:, None] * o, 0)  # [D]
    den = tl.sum(w, 0)
    res = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(Out + b * sob + h * soh + i * som + offs_d, _downcast(res, Out.dtype.element_ty, INTERP))


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------


class LaunchConfig(NamedTuple):
    """Tile sizes and split count (per group) of one launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    splits: int


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the CPU interpreter: small, so the split path is exercised


# (block_m, head_dim) -> (block_n, num_warps, num_stages, waves of programs). The best variants of
# the H200 sweeps in docs/BENCHMARKS.md (32K keys, 12 views). Row blocks of <= 32 rows are
# bandwidth-bound: 4 warps, 2 stages, ~2 programs per SM; 128-row blocks at d128 do real
# tensor-core work and prefer wide key tiles and fewer partials.
_TUNED = {
    (16, 64): (128, 4, 2, 2), (16, 128): (64, 4, 2, 2), (16, 256): (64, 4, 2, 2),
    (32, 64): (128, 4, 2, 2), (32, 128): (64, 4, 2, 2), (32, 256): (64, 4, 2, 2),
    (64, 64): (128, 4, 3, 1), (64, 128): (64, 4, 3, 2), (64, 256): (32, 8, 3, 1),
    (128, 64): (64, 4, 3, 2), (128, 128): (128, 8, 3, 1),
}  # fmt: skip


def pick_config(
    batch: int, hkv: int, gqa: int, m: int, head_dim: int, max_keys: int, groups: int, device: torch.device
) -> LaunchConfig:
    """Default tiles and splits for a launch: ``_TUNED`` for the tiles, enough programs for the
    tuned number of waves, and at least 4 key tiles per split."""
    rows = gqa * m
    cap = 64 if head_dim > 128 else 128
    block_m = min(cap, max(16, triton.next_power_of_2(rows)))
    block_n, num_warps, num_stages, waves = _TUNED[(block_m, head_dim)]
    base = batch * hkv * triton.cdiv(rows, block_m) * groups
    want = triton.cdiv(waves * _num_sms(device), base)
    by_len = max(1, max_keys // (groups * 4 * block_n))
    return LaunchConfig(block_m, block_n, num_warps, num_stages, max(1, min(want, by_len, 128)))


def segment_attention(
    q: torch.Tensor,
    table: SegmentTable,
    scale: float,
    config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q ``[B, Hq, M, D]`` (last dim contiguous) over ``table`` -> ``[B, Hq, M, D]`` in q's dtype.

    With a fixed ``config`` and a prebuilt table this is CUDA-graph capturable (see module doc).
    """
    bsz, hq, m, d = q.shape
    hkv = table.kv_heads
    gqa = hq // hkv
    if hq % hkv or not 1 <= gqa <= MAX_GQA or d not in SUPPORTED_HEAD_DIMS or bsz != table.batch:
        raise ValueError(f"q {tuple(q.shape)} does not fit a table of {table.batch} x {hkv} kv heads")
    if q.stride(-1) != 1:
        q = q.contiguous()
    cfg = config or pick_config(bsz, hkv, gqa, m, d, table.max_keys, table.groups, q.device)
    if out is None:
        out = torch.empty(bsz, hq, m, d, device=q.device, dtype=q.dtype)
    npart = table.groups * cfg.splits
    direct = npart == 1
    if direct:
        part_o = part_l = out  # unused
    else:
        part_o = torch.empty(bsz * hq * m * npart * d, device=q.device, dtype=torch.float32)
        part_l = torch.empty(bsz * hq * m * npart, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(gqa * m, cfg.block_m), npart, bsz * hkv)
    _segment_attn_kernel[grid](
        q, out, part_o, part_l, table.packed,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        hkv, gqa, m, cfg.splits, table.groups, npart,
        scale * LOG2E,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MAX_SEG=MAX_SEGMENTS,
        SEG_P2=triton.next_power_of_2(MAX_SEGMENTS), DIRECT=direct, INTERP=_INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if not direct:
        _combine_kernel[(bsz * hq * m,)](
            part_o, part_l, out, hq, m, npart, out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=d, NP2=max(2, triton.next_power_of_2(npart)), INTERP=_INTERPRET,
            num_warps=4 if d <= 128 else 8,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# The router's callable (batch 1)
# ---------------------------------------------------------------------------------------------


def _attend_views(q: torch.Tensor, views: Views, scale: float) -> torch.Tensor:
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        # A captured upload would replay from a pinned host block that the allocator hands to the
        # next table once the capture is over: another layer's pointers, silently. Graphs take a
        # SegmentTable built outside the capture and rewritten with update_ before each replay.
        raise RuntimeError(
            "fused_attention builds its segment table on the host and cannot run inside a CUDA graph "
            "capture; capture segment_attention over a SegmentTable (see turnkv.attention.triton_segments)"
        )
    if not views:
        return torch.zeros_like(q)
    try:
        table = build_table([views], q.shape[1])
    except UnsupportedViews as exc:
        _warn_once(str(exc))
        return lse_attention(q, views, scale)
    return segment_attention(q.unsqueeze(0), table, scale)[0]


# cudagraph_unsafe: torch.compile's CUDA graphs (mode="reduce-overhead") leave this op outside
# the graph instead of capturing its host-built table (see _attend_views)
_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("turnkv::segment_attention", mutates_args=(), tags=_UNSAFE)
def _segment_attention_op(
    q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float
) -> torch.Tensor:
    return _attend_views(q, list(zip(ks, vs, strict=True)), scale)


@_segment_attention_op.register_fake
def _segment_attention_fake(q, ks, vs, scale):
    return torch.empty_like(q)


@functools.lru_cache(maxsize=8)
def _warn_once(why: str) -> None:
    # a safety net only: the KV layouts hand out aligned views, so this should never fire
    log.warning("fused attention fell back to the lse route: %s", why)


def fused_attention(q: torch.Tensor, views: Views, scale: float) -> torch.Tensor:
    """The router's ``FusedFn``: q ``[Hq, M, D]`` over one sequence's views -> ``[Hq, M, D]``.

    Window-causal as in ``reference.py``; one table upload, one launch (plus a combine pass for
    large row blocks). Views the kernel cannot read in place go to the lse route (logged once).
    Under ``torch.compile`` it is the opaque custom op ``turnkv::segment_attention``; eagerly it
    skips the op dispatcher (tens of microseconds per call, once per layer per token).
    """
    if torch.compiler.is_compiling():
        return torch.ops.turnkv.segment_attention(q, [k for k, _ in views], [v for _, v in views], scale)
    return _attend_views(q, views, scale)

"""Fused attention over a segment table: one Triton launch per layer reads every sequence's views.

A step of ``B`` sequences, each a window of ``q_len`` query rows over its own list of KV views, is
described by one packed table (``segment_table.py``: built once per step, read by every layer at a
per-view layer stride). The step's query rows are flat, ``q [N, Hq, D]``; sequence ``b`` owns rows
``[q_start, q_start + q_len)``. Its keys are its views concatenated (``T`` rows); query row ``i``
sees key ``p`` iff ``p <= window_start + i`` (``window_start = T - q_len`` by default), as in
``reference.py``. Rows that see no key come out as zeros; padding sequences (``q_len`` 0) are
neither read nor written.

How one launch covers it:
- Grid ``(row_blocks, G * splits, B * Hkv)``. A program owns one KV head of one sequence,
  ``BLOCK_M`` of the ``GQA * M`` query rows of that head's group (``M`` the widest window of the
  launch; so every loaded K/V tile serves all its query heads) and one contiguous key range of its
  group of up to ``MAX_SEGMENTS`` views (a flash-decoding split). It walks the views that overlap
  its range; tiles never cross a view, and the causal mask is only evaluated on tiles that need it.
- With one program per (row block, head) (``G * splits == 1``) the kernel writes the result
  directly. Otherwise each program writes an fp32 partial and its log2-sum-exp, and a combine pass
  merges all partials of a row (splits and groups alike) and rounds once to the query dtype.
- ``triton_store.py`` writes a layer's new K/V rows of every sequence into the window rows of its
  last view (the cache's tail), from the same table's ``dest`` rows: one launch per layer.

``--deterministic on`` (``fixed_config``): 16-row blocks, and a row's keys cut into pieces of
``PIECE_KEYS`` at fixed positions of its own sequence (piece ``s``: keys ``[s * PIECE_KEYS, +PIECE_KEYS)``
across its views, within each group), each one online softmax from a fresh state, merged in order
``s = 0, 1, ...`` by one merge (``_fold``), in the combine kernel (one program a piece; the grid
may hold more pieces than a row has keys: empty ones merge as nothing) or in the attention kernel
(one program walking every piece of its row block). A row's bits then depend on its own views
only: not on its company, its window, the padded batch, the bucket or which of the two ran.

Precision: q·k in the tensor cores with fp32 accumulation; probabilities are rounded to the input
dtype before P·V (as every flash kernel does); partials and the merge are fp32; one final rounding.

CUDA graphs: both kernels read everything about the views from device memory, so a captured step
is replayed after the table buffer was rewritten in place (``segment_table.upload(..., out=)``).
The grid depends on the batch, ``M``, the groups and ``splits``, never on the lengths.

Triton is imported at module import; import this module only where triton is known to exist.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from turnkv.attention.segment_table import TableMeta, key_bucket, pack, padded_batch, upload
from turnkv.kernels.triton_common import INTERPRET, downcast
from turnkv.limits import MAX_GQA, MAX_SEGMENTS, SUPPORTED_HEAD_DIMS

LOG2E = 1.4426950408889634
COMBINE_UNROLL = 16  # partials the combine kernel loads per loop trip (one trip at 4K keys)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


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
        p = downcast(p, v.dtype, INTERP)  # rounded to the input dtype before P·V, on every path
        if INTERP:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _splits(hdr, room):
    """A sequence's split count: header word 6 (written by the plan), capped at the grid's
    ``room``; 0 (a table packed without one) means all of it."""
    n = tl.load(hdr + 6)
    return tl.where(n > 0, tl.minimum(n, room), room)


@triton.jit
def _walk(
    acc, m_i, l_i, q, hdr, lo, see_hi, full_hi, ws, row_i, offs_d, kvh64, LAYER, qk_scale,
    BLOCK_N: tl.constexpr, SEG_P2: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Online softmax of one row block over the keys [lo, see_hi) of the group at ``hdr``: every
    view overlapping the range, each from its own first key in ``BLOCK_N`` tiles. Rows see every
    key before ``full_hi``, none at or past ``see_hi``."""
    nseg = tl.load(hdr)
    elt = q.dtype
    # The views overlapping [lo, see_hi) are a run of consecutive indices. Their bounds come in one
    # vector load (a loop of scalar loads would be a chain of dependent round trips); the vectors
    # die before the tile loop, so they cost no registers there.
    sidx = tl.arange(0, SEG_P2)
    srow = hdr + (sidx + 1).to(tl.int64) * 8
    smask = sidx < nseg
    s_start = tl.load(srow + 6, mask=smask, other=0)
    s_end = s_start + tl.load(srow + 5, mask=smask, other=0)
    live = smask & (tl.maximum(lo, s_start) < tl.minimum(see_hi, s_end))
    first = tl.min(tl.where(live, sidx, SEG_P2), 0)
    last = tl.max(tl.where(live, sidx, -1), 0)
    for s in range(first, last + 1):
        e = hdr + (s + 1) * 8  # this view's row: independent loads, one round trip
        seg_start = tl.load(e + 6)
        a = tl.maximum(lo, seg_start)
        z = tl.minimum(see_hi, seg_start + tl.load(e + 5))
        # element strides are 16-byte multiples and pointers 16-byte aligned (pack checks), which
        # lets K/V loads go 128-bit; the pointer hint must follow the int-to-pointer cast
        k_base = tl.multiple_of(tl.load(e).to(tl.pointer_type(elt)), 16)
        v_base = tl.multiple_of(tl.load(e + 1).to(tl.pointer_type(elt)), 16)
        offset = LAYER * tl.multiple_of(tl.load(e + 2), 8) + kvh64 * tl.multiple_of(tl.load(e + 3), 8)
        k_base += offset
        v_base += offset
        ksr = tl.multiple_of(tl.load(e + 4), 8)
        vsr = ksr
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
    return acc, m_i, l_i


@triton.jit
def _finalize(acc, m_i, l_i):
    """A key range's normalised output [R, D] and its log2-sum-exp [R] (-inf, output 0: no key)."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = tl.where((l_i > 0)[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))
    return o, lse


@triton.jit
def _fold(num, den, mx, o, lse):
    """Merge the next partial (o [R, D], lse [R]) into the running sums num [R, D] and den [R],
    both scaled by 2^-mx. The one merge of a row's partials, in the combine kernel and (a
    deterministic launch of one program per row block) inside the attention kernel: the same ops
    in the same order (fma explicit, so the compiler has no contraction to choose), so the bits do
    not depend on which kernel ran it. A partial that saw no key (lse -inf) leaves all three as
    they were, exactly: a row's result does not change with how many empty partials its launch has.
    """
    m_new = tl.maximum(mx, lse)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.math.exp2(mx - m_use)  # 0 while nothing was merged (mx -inf)
    b = tl.math.exp2(lse - m_use)
    empty = lse == float("-inf")
    num = tl.where(empty[:, None], num, tl.fma(num, a[:, None], b[:, None] * o))
    den = tl.where(empty, den, tl.fma(den, a, b))
    return num, den, m_new


@triton.jit
def _result(num, den):
    """The merged output of ``_fold``'s sums (0 for a row that saw no key)."""
    return tl.where((den > 0)[:, None], num / tl.where(den > 0, den, 1.0)[:, None], 0.0)


# counts that vary per step (the rows M too) are not specialized (== 1, % 16): each value class
# was a variant of its own, and a loaded server met combinations the warm-up had not compiled;
# what is left varies by tiles, PIECE and DIRECT alone (``triton_variants``)
@triton.jit(do_not_specialize=["LAYER", "M", "NSPLIT", "NGROUPS", "NPART"])
def _segment_attn_kernel(
    Q, Out, PartO, PartL, Table, LAYER,
    sqm, sqh, som, soh,
    HKV, GQA, M, NSPLIT, NGROUPS, NPART,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SEG: tl.constexpr,
    SEG_P2: tl.constexpr, PIECE: tl.constexpr, DIRECT: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """``PIECE`` 0: program ``pid_p = group * NSPLIT + split`` takes the split-th of NSPLIT equal
    parts of its group's keys. ``PIECE`` > 0 (``--deterministic on``): the keys are cut at the
    fixed positions 0, PIECE, 2 * PIECE, ... of the sequence, and a partial is one such piece of
    one group; a program takes piece ``split`` of its group, or (``DIRECT``) every piece of every
    group in turn, merging them as the combine kernel would (``_fold``)."""
    # row blocks vary fastest, so the blocks that share a key range run side by side and all but
    # the first find its K/V tiles in L2
    pid_m = tl.program_id(0)  # row block of the GQA * M rows of this kv head
    pid_p = tl.program_id(1)  # group * NSPLIT + split (NSPLIT: the grid's room for splits)
    pid_bh = tl.program_id(2)  # b * HKV + kv head
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    grp = pid_p // NSPLIT
    split = pid_p % NSPLIT
    seq = Table + (b * NGROUPS * (MAX_SEG + 1)).to(tl.int64) * 8  # the sequence's first header
    hdr = seq + grp * ((MAX_SEG + 1) * 8)  # this group's
    ws = tl.load(seq + 3)
    q_len = tl.load(seq + 4)
    q_start = tl.load(seq + 5)

    # rows r = g * q_len + i: query head kvh * GQA + g, window row i. Each sequence packs its own
    # window's rows, so a one-row window's GQA heads share one row block even beside a wide window.
    qd = tl.maximum(q_len, 1)
    r0 = pid_m * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    g = rows // qd
    row_i = rows % qd
    row_ok = rows < GQA * q_len  # false for every row of a padding sequence (q_len 0)
    r1 = tl.minimum(r0 + BLOCK_M, GQA * qd) - 1
    one_head = (r0 // qd) == (r1 // qd)
    i_min = tl.where(one_head, r0 % qd, 0)
    i_max = tl.where(one_head, r1 % qd, qd - 1)
    # no row of the block sees a key at or past vis_hi (a block past this window's rows: none)
    vis_hi = tl.where(r0 < GQA * q_len, ws + i_max + 1, 0)
    vis_lo = ws + i_min + 1  # every row of the block sees the keys before this

    offs_d = tl.arange(0, HEAD_DIM)
    head = kvh * GQA + g
    qrow = q_start + row_i  # [BM] flat rows of the step (int64: the table is int64)
    q_ptrs = Q + qrow[:, None] * sqm + head[:, None] * sqh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BM, D]
    kvh64 = kvh.to(tl.int64)
    o_rows = Out + qrow * som + head * soh  # [BM] row pointers; [BM, D] only at a store

    if PIECE > 0 and DIRECT:  # every piece of every group, merged here in order
        num = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        den = tl.zeros([BLOCK_M], tl.float32)
        mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for gi in range(0, NGROUPS):
            gh = seq + gi * ((MAX_SEG + 1) * 8)
            g_start = tl.load(gh + 1)
            g_end = g_start + tl.load(gh + 2)
            top = tl.minimum(g_end, vis_hi)  # pieces past it are empty for every row here
            for pc in range(g_start // PIECE, tl.cdiv(top, PIECE)):
                lo = tl.maximum(g_start, pc * PIECE)
                see_hi = tl.minimum(top, (pc + 1) * PIECE)
                acc, m_i, l_i = _walk(
                    tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), tl.full([BLOCK_M], float("-inf"), tl.float32),
                    tl.zeros([BLOCK_M], tl.float32), q, gh, lo, see_hi, tl.minimum(see_hi, vis_lo), ws,
                    row_i, offs_d, kvh64, LAYER, qk_scale, BLOCK_N, SEG_P2, INTERP,
                )  # fmt: skip
                o, lse = _finalize(acc, m_i, l_i)
                num, den, mx = _fold(num, den, mx, o, lse)
        res = _result(num, den)
        tl.store(
            o_rows[:, None] + offs_d[None, :],
            downcast(res, Out.dtype.element_ty, INTERP),
            mask=row_ok[:, None],
        )
    else:
        g_start = tl.load(hdr + 1)
        g_len = tl.load(hdr + 2)
        if PIECE > 0:  # piece `split` of the sequence, where it overlaps this group
            lo = tl.maximum(g_start, split * PIECE)
            hi = tl.minimum(g_start + g_len, (split + 1) * PIECE)
        else:  # the split-th part of the group, whole tiles except at the group's end
            # the split count this step uses (the table's, at most the grid's room; 0: all of
            # it), so a CUDA graph's grid serves every split count up to its room: a split past
            # the count reads and writes nothing (its rows as padding's)
            nsplit = _splits(hdr, NSPLIT)
            row_ok = rows < GQA * tl.where(split < nsplit, q_len, 0)
            chunk = tl.cdiv(tl.cdiv(g_len, nsplit), BLOCK_N) * BLOCK_N
            lo = g_start + split * chunk
            hi = tl.minimum(lo + chunk, g_start + g_len)
            hi = tl.where(split < nsplit, hi, lo)
        see_hi = tl.minimum(hi, vis_hi)
        acc, m_i, l_i = _walk(
            tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), tl.full([BLOCK_M], float("-inf"), tl.float32),
            tl.zeros([BLOCK_M], tl.float32), q, hdr, lo, see_hi, tl.minimum(see_hi, vis_lo), ws,
            row_i, offs_d, kvh64, LAYER, qk_scale, BLOCK_N, SEG_P2, INTERP,
        )  # fmt: skip
        o, lse = _finalize(acc, m_i, l_i)
        if DIRECT:
            tl.store(
                o_rows[:, None] + offs_d[None, :],
                downcast(o, Out.dtype.element_ty, INTERP),
                mask=row_ok[:, None],
            )
        else:
            prow = ((b * (HKV * GQA) + head) * M + row_i).to(tl.int64) * NPART  # [BM] first partial
            tl.store(PartL + prow + pid_p, lse, mask=row_ok)
            # a partial that saw no key is not read back (the combine masks it by its lse)
            o_ptrs = PartO + (prow + pid_p)[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(o_ptrs, o, mask=(row_ok & (l_i > 0))[:, None])


@triton.jit(do_not_specialize=["M", "NSPLIT", "NPART", "NGROUPS"])
def _combine_kernel(
    PartO, PartL, Out, Table, HQ, M, NSPLIT, NPART, NGROUPS, som, soh,
    HEAD_DIM: tl.constexpr, UNROLL: tl.constexpr, MAX_SEG: tl.constexpr, PIECE: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """One output row: its partials merged in order p = 0, 1, ... (``_fold``), rounded once.
    ``UNROLL`` partials a loop trip, so their loads are in flight together. Splits (``PIECE``
    0): partial ``grp * NSPLIT + split`` exists for the splits below the sequence's count
    (``_splits``); pieces: every partial exists (an empty piece's lse is -inf)."""
    row = tl.program_id(0)  # (b * HQ + h) * M + i
    b = row // (HQ * M)
    h = (row // M) % HQ
    i = row % M
    hdr = Table + (b * NGROUPS * (MAX_SEG + 1)).to(tl.int64) * 8
    q_len = tl.load(hdr + 4)
    q_start = tl.load(hdr + 5)
    one = tl.arange(0, 1)  # the fold's row axis: this row as a [1, D] block
    offs_d = tl.arange(0, HEAD_DIM)
    base = row.to(tl.int64) * NPART
    num = tl.zeros([1, HEAD_DIM], tl.float32)
    den = tl.zeros([1], tl.float32)
    mx = tl.full([1], float("-inf"), tl.float32)
    held = tl.where(i < q_len, NPART, 0)  # rows past the window hold no partials: none is read
    nsplit = NSPLIT if PIECE > 0 else _splits(hdr, NSPLIT)
    for p0 in range(0, NPART, UNROLL):
        for j in tl.static_range(UNROLL):
            pi = p0 + j + one  # [1]
            p = base + pi
            lse = tl.load(PartL + p, mask=(pi < held) & (pi % NSPLIT < nsplit), other=float("-inf"))
            o = tl.load(
                PartO + p[:, None] * HEAD_DIM + offs_d[None, :],
                mask=(lse > float("-inf"))[:, None],
                other=0.0,
            )
            num, den, mx = _fold(num, den, mx, o, lse)
    res = _result(num, den)
    out = Out + (q_start + i) * som + h * soh + one[:, None] * 0 + offs_d[None, :]
    tl.store(out, downcast(res, Out.dtype.element_ty, INTERP), mask=(offs_d[None, :] * 0 + i) < q_len)


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
    piece: int = 0  # keys a partial covers at fixed positions (--deterministic on), 0: splits


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


def _tuned(rows: int, d: int) -> tuple[int, int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages, waves)`` for ``rows`` query rows per KV head."""
    cap = 64 if d > 128 else 128
    block_m = min(cap, max(16, triton.next_power_of_2(rows)))
    return (block_m, *_TUNED[(block_m, d)])


# --deterministic on: a row's keys are cut into pieces of this many keys at the fixed positions
# 0, PIECE_KEYS, 2 * PIECE_KEYS, ... of its sequence (whatever the batch, the bucket or the launch),
# each piece is one online softmax and the pieces are merged in order. 256 keys: a batch-1 decode
# at 2K keys gets 8 programs per KV head (64 at llama3-8b's 8 heads, the split the non-deterministic
# rule picks there), at 32K 128; a multiple of every BLOCK_N of _TUNED, so tiles stay whole.
PIECE_KEYS = 256
PARTIAL_BYTES = 256 << 20  # the most fp32 partials a deterministic launch writes before it stops
# cutting its programs by piece (one program per row block then walks and merges every piece)


def fixed_config(
    batch: int,
    kv_heads: int,
    gqa: int,
    max_q: int,
    keys: int,
    head_dim: int,
    groups: int,
    device: torch.device,
) -> LaunchConfig:
    """The launch of ``--deterministic on``: 16-row blocks, and every row's keys cut into pieces of
    ``PIECE_KEYS`` at fixed positions of its own sequence (across its views and groups), each
    piece one online softmax from a fresh state, merged in order piece 0, 1, ... (``_fold``). So a
    row's bits depend on its own views alone: not on its company, its window (prefill chunk or
    decode), the padded batch or the key bucket the grid is sized for. Only where the pieces run
    depends on the launch: one program each (``splits`` the pieces of ``keys``, the combine kernel
    merging; empty pieces past a row's keys merge as nothing) while the unsplit programs would not
    fill the device's SMs and the partials stay under ``PARTIAL_BYTES``; else (``splits`` 1) one
    program per row block walks and merges them all, writing the result directly."""
    block_n, num_warps, num_stages, _ = _TUNED[(16, head_dim)]
    pieces = max(1, triton.cdiv(keys, PIECE_KEYS))
    programs = batch * kv_heads * triton.cdiv(gqa * max(max_q, 1), 16)
    partials = batch * kv_heads * gqa * max(max_q, 1) * groups * pieces * (head_dim + 1) * 4
    split = programs < _num_sms(device) and partials <= PARTIAL_BYTES
    return LaunchConfig(16, block_n, num_warps, num_stages, pieces if split else 1, PIECE_KEYS)


def pick_config(
    meta: TableMeta,
    gqa: int,
    device: torch.device,
    max_keys: int | None = None,
    conversations: int = 0,
    fixed: bool = False,
) -> LaunchConfig:
    """Default tiles and splits for a launch: ``_TUNED`` for the tiles, enough programs for the
    tuned number of waves, and at least 4 key tiles per split. Decode launches (one-row windows)
    take ``decode_splits``. ``max_keys`` overrides the table's (a graph passes its bucket).
    ``conversations`` (decode): the split count is sized for that many sequences rather than the
    table's (``fused.conversations``: a verify window's one-row windows split as one).
    ``fixed`` (``--deterministic on``): ``fixed_config`` (for the table's batch and ``max_keys``)."""
    keys = meta.max_keys if max_keys is None else max_keys
    if fixed:
        return fixed_config(
            meta.batch, meta.kv_heads, gqa, meta.max_q, keys, meta.head_dim, meta.groups, device
        )  # fmt: skip
    rows = gqa * max(meta.max_q, 1)
    block_m, block_n, num_warps, num_stages, waves = _tuned(rows, meta.head_dim)
    if meta.max_q == 1:
        convs = conversations or meta.batch
        splits = decode_splits(convs, keys, meta.kv_heads, gqa, meta.head_dim, device, meta.groups)
        return LaunchConfig(block_m, block_n, num_warps, num_stages, splits)
    base = meta.batch * meta.kv_heads * triton.cdiv(rows, block_m) * meta.groups
    by_len = max(1, keys // (meta.groups * 4 * block_n))
    want = triton.cdiv(waves * _num_sms(device), base)
    return LaunchConfig(block_m, block_n, num_warps, num_stages, max(1, min(want, by_len, 128)))


def decode_splits(
    conversations: int,
    keys: int,
    kv_heads: int,
    gqa: int,
    head_dim: int,
    device: torch.device,
    groups: int = 1,
    fixed: bool = False,
) -> int:
    """The split count of a decode launch of ``conversations`` conversations' one-row windows
    over at most ``keys`` keys: the one formula that an eager step, a CUDA graph's key
    (``FusedBackend.decode_launch``) and a verify window's bound (``FusedBackend.verify_rows``)
    rest on.

    Sized for the padded batch and the key bucket a CUDA graph of this step would be captured at
    (``segment_table.padded_batch``/``key_bucket``), so an eager step and a replay split the keys
    alike and agree bit for bit; a power of two, in the tuned number of waves only while the
    unsplit programs fill less than one wave. The H200's decode sweep (bench/attention.py
    decode_sweep, llama3-8b heads, 4 views) found 32/4/1 splits fastest for batch 1/8/32 at 8K
    and 32K keys, which this picks; the waves rule alone picked the slower 33/5/2
    (docs/BENCHMARKS.md, 'The step engine: decode and prefill on the H200 (issue 8)').
    ``fixed`` (``--deterministic on``): ``fixed_config``'s for the padded batch and the bucket
    (the graph's grid; a row's bits do not depend on it)."""
    if fixed:
        batch = padded_batch(conversations)
        return fixed_config(batch, kv_heads, gqa, 1, key_bucket(keys), head_dim, groups, device).splits
    block_m, block_n, _, _, waves = _tuned(gqa, head_dim)
    base = padded_batch(conversations) * kv_heads * triton.cdiv(gqa, block_m) * groups
    sms = _num_sms(device)
    by_len = max(1, key_bucket(keys) // (groups * 4 * block_n))
    want = triton.cdiv((waves if base < sms else 1) * sms, base)
    splits = min(want, by_len, 128)
    return 1 << (max(splits, 1).bit_length() - 1)


def check_shape(hq: int, hkv: int, d: int) -> None:
    gqa = hq // hkv
    if hq % hkv or not 1 <= gqa <= MAX_GQA or d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{hq} query heads over {hkv} kv heads at head_dim {d} do not fit the kernel")


def partials(config: LaunchConfig, groups: int) -> int:
    """Partial results a row of a launch of ``config`` over ``groups`` view groups writes (1: it
    writes its output directly, no combine pass; the kernel's ``DIRECT``). A deterministic launch
    of one program per row block merges its pieces itself (``fixed_config``)."""
    return 1 if config.piece and config.splits == 1 else groups * config.splits


def segment_attention(
    q: torch.Tensor,
    packed: torch.Tensor,
    meta: TableMeta,
    layer: int,
    scale: float,
    config: LaunchConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q ``[N, Hq, D]`` (last dim contiguous) over the views of ``packed`` at ``layer`` ->
    ``[N, Hq, D]`` in q's dtype. Rows of padding sequences are left as they were in ``out``."""
    _, hq, d = q.shape
    hkv = meta.kv_heads
    gqa = hq // hkv
    m = max(meta.max_q, 1)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    npart = partials(config, meta.groups)
    direct = npart == 1
    if direct:
        part_o = part_l = out  # unused
    else:
        part_o = torch.empty(meta.batch * hq * m * npart * d, device=q.device, dtype=torch.float32)
        part_l = torch.empty(meta.batch * hq * m * npart, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(gqa * m, config.block_m), npart, meta.batch * hkv)
    _segment_attn_kernel[grid](
        q, out, part_o, part_l, packed, layer,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        hkv, gqa, m, config.splits, meta.groups, npart,
        scale * LOG2E,
        HEAD_DIM=d, BLOCK_M=config.block_m, BLOCK_N=config.block_n, MAX_SEG=MAX_SEGMENTS,
        SEG_P2=triton.next_power_of_2(MAX_SEGMENTS), PIECE=config.piece, DIRECT=direct, INTERP=INTERPRET,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if not direct:
        _combine_kernel[(meta.batch * hq * m,)](
            part_o, part_l, out, packed, hq, m, config.splits, npart, meta.groups, out.stride(0),
            out.stride(1), HEAD_DIM=d, UNROLL=COMBINE_UNROLL, MAX_SEG=MAX_SEGMENTS, PIECE=config.piece,
            INTERP=INTERPRET, num_warps=4 if d <= 128 else 8,
        )  # fmt: skip
    return out


def fused_attention(
    q: torch.Tensor,
    views: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    window_start: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """One sequence: q ``[Hq, M, D]`` over one layer's views ``[(k, v)]`` each ``[Hkv, T_i, D]`` ->
    ``[Hq, M, D]``. For the load-time self-check and tests; the engine runs ``segment_attention``
    over a step's table. ``splits`` forces the split count (to exercise the combine pass)."""
    hq, m, d = q.shape
    views4 = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in views]  # a one-layer table
    check_shape(hq, views4[0][0].shape[1], d)
    words, meta = pack([views4], [m], None if window_start is None else [window_start])
    packed = upload(words, q.device)
    cfg = pick_config(meta, hq // meta.kv_heads, q.device)
    if splits is not None:
        cfg = cfg._replace(splits=splits)
    flat = q.transpose(0, 1)  # [M, Hq, D], a view
    return segment_attention(flat, packed, meta, 0, scale, cfg).transpose(0, 1)

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


# counts that vary per step are not specialized (== 1, % 16): each value class was a variant of
# its own, and a loaded server met combinations the warm-up had not compiled
@triton.jit(do_not_specialize=["LAYER", "NSPLIT", "NGROUPS", "NPART"])
def _segment_attn_kernel(
    Q, Out, PartO, PartL, Table, LAYER,
    sqm, sqh, som, soh,
    HKV, GQA, M, NSPLIT, NGROUPS, NPART,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SEG: tl.constexpr,
    SEG_P2: tl.constexpr, DIRECT: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    # row blocks vary fastest, so the blocks that share a key range run side by side and all but
    # the first find its K/V tiles in L2
    pid_m = tl.program_id(0)  # row block of the GQA * M rows of this kv head
    pid_p = tl.program_id(1)  # group * NSPLIT + split (NSPLIT: the grid's room for splits)
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
    q_start = tl.load(hdr + 5)
    # the split count this step uses (the table's, at most the grid's room; 0: all of it), so a
    # CUDA graph's grid serves every split count up to its room: the extra programs read nothing
    nsplit = _splits(hdr, NSPLIT)
    q_live = tl.where(split < nsplit, q_len, 0)  # a split past the count: rows as padding's
    # this program's key range (global positions), whole tiles except at the group's end
    chunk = tl.cdiv(tl.cdiv(g_len, nsplit), BLOCK_N) * BLOCK_N
    lo = g_start + split * chunk
    hi = tl.minimum(lo + chunk, g_start + g_len)

    # rows r = g * q_len + i: query head kvh * GQA + g, window row i. Each sequence packs its own
    # window's rows, so a one-row window's GQA heads share one row block even beside a wide window.
    qd = tl.maximum(q_len, 1)
    r0 = pid_m * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    g = rows // qd
    row_i = rows % qd
    row_ok = rows < GQA * q_live  # false for every row of a padding sequence (q_len 0)
    r1 = tl.minimum(r0 + BLOCK_M, GQA * qd) - 1
    one_head = (r0 // qd) == (r1 // qd)
    i_min = tl.where(one_head, r0 % qd, 0)
    i_max = tl.where(one_head, r1 % qd, qd - 1)
    see_hi = tl.minimum(hi, ws + i_max + 1)  # no row of the block sees a key at or past this
    # a block past this window's rows, or a split past the step's count, reads nothing
    see_hi = tl.where(r0 < GQA * q_live, see_hi, lo)
    full_hi = tl.minimum(see_hi, ws + i_min + 1)  # every row of the block sees keys before this

    offs_d = tl.arange(0, HEAD_DIM)
    head = kvh * GQA + g
    qrow = q_start + row_i  # [BM] flat rows of the step (int64: the table is int64)
    q_ptrs = Q + qrow[:, None] * sqm + head[:, None] * sqh + offs_d[None, :]
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

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o = tl.where((l_i > 0)[:, None], o, 0.0)
    o_rows = Out + qrow * som + head * soh  # [BM] row pointers; [BM, D] only at a store
    if DIRECT:
        tl.store(
            o_rows[:, None] + offs_d[None, :],
            downcast(o, Out.dtype.element_ty, INTERP),
            mask=row_ok[:, None],
        )
    else:
        prow = ((b * (HKV * GQA) + head) * M + row_i).to(tl.int64) * NPART  # [BM] first partial
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(PartL + prow + pid_p, lse, mask=row_ok)
        tl.store(PartO + (prow + pid_p)[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["NSPLIT", "NPART", "NGROUPS"])
def _combine_kernel(
    PartO, PartL, Out, Table, HQ, M, NSPLIT, NPART, NGROUPS, som, soh,
    HEAD_DIM: tl.constexpr, NP2: tl.constexpr, MAX_SEG: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """One output row: the exact log-sum-exp merge of its partials, rounded once. Partial
    ``grp * NSPLIT + split`` exists for the splits below the sequence's count (``_splits``)."""
    row = tl.program_id(0)  # (b * HQ + h) * M + i
    b = row // (HQ * M)
    h = (row // M) % HQ
    i = row % M
    hdr = Table + (b * NGROUPS * (MAX_SEG + 1)).to(tl.int64) * 8
    q_len = tl.load(hdr + 4)
    q_start = tl.load(hdr + 5)
    nsplit = _splits(hdr, NSPLIT)
    offs_p = tl.arange(0, NP2)
    offs_d = tl.arange(0, HEAD_DIM)
    pm = (offs_p < NPART) & (offs_p % NSPLIT < nsplit)
    base = row.to(tl.int64) * NPART
    lse = tl.load(PartL + base + offs_p, mask=pm, other=float("-inf"))  # [NP2]
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.math.exp2(lse - mx)  # 0 for partials that saw nothing
    o = tl.load(PartO + (base + offs_p)[:, None] * HEAD_DIM + offs_d[None, :], mask=pm[:, None], other=0.0)
    num = tl.sum(w[:, None] * o, 0)  # [D]
    den = tl.sum(w, 0)
    res = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    out = Out + (q_start + i) * som + h * soh + offs_d
    tl.store(out, downcast(res, Out.dtype.element_ty, INTERP), mask=(offs_d * 0 + i) < q_len)


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


def _tuned(rows: int, d: int) -> tuple[int, int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages, waves)`` for ``rows`` query rows per KV head."""
    cap = 64 if d > 128 else 128
    block_m = min(cap, max(16, triton.next_power_of_2(rows)))
    return (block_m, *_TUNED[(block_m, d)])


def fixed_config(head_dim: int) -> LaunchConfig:
    """The one launch config of ``--deterministic on``: 16-row blocks and one split whatever the
    batch, the window or the key bucket, so each row walks its own keys in the same tiles from its
    groups' starts and its bits depend on neither its company nor the prefill chunk it is in."""
    block_n, num_warps, num_stages, _ = _TUNED[(16, head_dim)]
    return LaunchConfig(16, block_n, num_warps, num_stages, 1)


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
    ``fixed`` (``--deterministic on``): ``fixed_config``."""
    if fixed:
        return fixed_config(meta.head_dim)
    rows = gqa * max(meta.max_q, 1)
    block_m, block_n, num_warps, num_stages, waves = _tuned(rows, meta.head_dim)
    keys = meta.max_keys if max_keys is None else max_keys
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
    ``fixed`` (``--deterministic on``): 1, ``fixed_config``'s."""
    if fixed:
        return fixed_config(head_dim).splits
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
    npart = meta.groups * config.splits
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
        SEG_P2=triton.next_power_of_2(MAX_SEGMENTS), DIRECT=direct, INTERP=INTERPRET,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if not direct:
        _combine_kernel[(meta.batch * hq * m,)](
            part_o, part_l, out, packed, hq, m, config.splits, npart, meta.groups, out.stride(0), out.stride(1),
            HEAD_DIM=d, NP2=max(2, triton.next_power_of_2(npart)), MAX_SEG=MAX_SEGMENTS,
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

"""The portable paths in fp32, rounded once: ``concat`` and ``lse`` (``routes.Path``).

Two exact forms of the same fp32 attention over a window's views; the window's route picks one
(``portable.portable_route``), neither function picks for it:

- **Concatenated scores** (``concat_segments``, path ``concat``; windows whose rows all see key 0):
  each view's scores ``q k_i^T`` side by side, one softmax, the values summed view by view.
  Decode and verify windows take it: it is 2S + 3 ops for S views.
- **Partials merged by log-sum-exp** (``lse_attention``, path ``lse``; a CPU's fp32 prefill
  windows through torch's flash kernel, and windows that start before the first key): for
  segment ``i`` with scores ``s_i`` the partial result is ``o_i = softmax(s_i) @ v_i`` and its
  weight is ``lse_i = logsumexp(s_i)``. With ``L = logsumexp_i(lse_i)`` the exact attention over
  all rows is ``sum_i exp(lse_i - L) * o_i``.

Every intermediate stays fp32 and the result is rounded to the query dtype once, so the route
equals fp32 attention over one buffer rounded once (rounding each segment first puts bf16
elements one ulp off: docs/BENCHMARKS.md, 'Figures moved out of code comments'). A segment whose
rows are all invisible to a query row has ``lse_i = -inf`` and weight 0; a row that sees no key
at all gets zeros, never NaN. Runs on any torch device.
"""

from __future__ import annotations

import functools

import torch

from turnkv.attention.reference import visible_mask

# CPU matmuls of fewer rows take another kernel (MKL, measured with torch 2.13: a [3, 64] x
# [64, 700] product differs in its last bits from the same rows inside a 4-row or larger one,
# while from 4 rows up every row is bit-identical whatever the count and its position). Decode
# windows pad to this many rows so a row's attention is the same bits alone (a decode step) and
# inside a verify window: speculation's greedy text then equals plain decoding on CPU.
MIN_GEMM_ROWS = 4


def flash_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window_start: int, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``segment_partial`` through torch's tiled CPU flash kernel, which returns the log-sum-exp
    too (fp32 q in, fp32 out; a CPU only).

    Faster than the materialised scores (docs/BENCHMARKS.md, 'Server (issue 3)'). The query heads
    of one KV head are stacked as rows so K/V are never repeated; the window-causal mask repeats
    per stacked head.
    """
    hq, m, d = q.shape
    hkv, t, _ = k.shape
    group = hq // hkv
    k, v = k.float(), v.float()  # bf16 rows (a CPU's --kv-dtype auto) read as fp32; else no copy
    mask = None
    if offset + t - 1 > window_start:
        seen = visible_mask(m, t, window_start, q.device, offset)  # [M, T]
        mask = torch.zeros(m, t).masked_fill_(~seen, float("-inf")).repeat(group, 1)[None, None]
    qg = q.reshape(1, hkv, group * m, d)  # [1, Hkv, G*M, D]
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, k[None], v[None], 0.0, False, attn_mask=mask, scale=scale
    )
    o, lse = o[0].reshape(hq, m, -1), lse[0].reshape(hq, m)
    # the kernel reports lse 0 (not -inf) for a row that sees none of this segment's keys
    blind = torch.arange(m, device=q.device) + window_start < offset  # [M]
    if bool(blind.any()):
        lse = lse.masked_fill(blind, float("-inf"))
        o = o.masked_fill(blind[:, None], 0.0)
    return o, lse


def segment_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window_start: int, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment's fp32 partial. q ``[Hq, M, D]``, k/v ``[Hkv, T, D]`` -> (``[Hq, M, D]``, ``[Hq, M]``)."""
    hq, m, d = q.shape
    hkv, t, _ = k.shape
    group = hq // hkv
    qg = q.float().reshape(hkv, group * m, d)  # [Hkv, G*M, D]; row r is window row r % M
    s = torch.matmul(qg, k.float().transpose(1, 2)) * scale  # [Hkv, G*M, T]
    s = s.view(hkv, group, m, t)
    need_mask = offset + t - 1 > window_start  # some key is later than the first window row
    if need_mask:
        s = s.masked_fill(~visible_mask(m, t, window_start, q.device, offset), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, G, M]
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.matmul(p.view(hkv, group * m, t), v.float())  # [Hkv, G*M, Dv]
    return o.view(hq, m, -1), lse.reshape(hq, m)


@functools.lru_cache(maxsize=8)
def _cpu_scalar(value: float) -> torch.Tensor:
    """``value`` as a 0-dim fp32 CPU tensor: a Python float operand costs a CPU op a 0-dim copy
    to the tensor's dtype, most of a small op's time; the product's bits are the same."""
    return torch.tensor(value, dtype=torch.float32)


def _pad_rows(x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """``x`` ``[B, R, C]`` with zero rows appended up to ``rows`` (default: ``MIN_GEMM_ROWS`` on a
    CPU, none elsewhere; see ``MIN_GEMM_ROWS``)."""
    if rows is None:
        rows = MIN_GEMM_ROWS if x.device.type == "cpu" else 0
    pad = rows - x.shape[1]
    return torch.cat([x, x.new_zeros(x.shape[0], pad, x.shape[2])], dim=1) if pad > 0 else x


def concat_segments(
    q: torch.Tensor, views: list[tuple[torch.Tensor, torch.Tensor]], scale: float, window_start: int
) -> torch.Tensor:
    """Every view seen from a window whose rows all see key 0 (``window_start >= 0``): the scores
    of each view (one matmul each) side by side, one softmax over them, and the values summed view
    by view into one fp32 output. q ``[Hq, M, D]`` -> fp32 ``[Hq, M, D]``.

    The same fp32 attention as per-view partials merged by their log-sum-exp, in about 2S + 3
    ops rather than ~12 per view plus the merge: the scores are concatenated (``T`` floats per
    query row), never the keys. Decode's path on a CPU without the C kernel (``cpu_native``),
    where op count is the cost (docs/BENCHMARKS.md, 'The step engine: decode and prefill on the
    H200 (issue 8)', CPU).

    A row's bits do not depend on the window around it (speculation's exactness: a verify
    window's row equals that row decoded alone). Scores and the softmax are per row whatever the
    row count (from ``MIN_GEMM_ROWS`` rows) and however many masked keys follow; the values'
    matmul is not: its sum over keys rounds differently for another key count, even with zero
    weights appended. The earlier views have the same keys for every row, so they take one
    matmul for the window; the last view (the window's own rows) takes one per window row, over
    exactly the keys that row sees, as a one-row decode window does."""
    hq, m, d = q.shape
    hkv = views[0][0].shape[0]
    group = hq // hkv
    if len(views) > 1:
        views = [(k, v) for k, v in views if k.shape[1]]
    t = sum(k.shape[1] for k, _ in views) if len(views) > 1 else views[0][0].shape[1]
    if not t:
        return torch.zeros(hq, m, d, dtype=torch.float32, device=q.device)
    cpu = q.device.type == "cpu"
    pad = MIN_GEMM_ROWS if cpu else 0  # (the checks once, not per op)
    scale_by = _cpu_scalar(scale) if cpu else scale
    rows = group * m
    masked = t - 1 > window_start  # some key is later than the first window row
    # [Hkv, R, D]: R = G*M rows (row r is window row r % M), padded to MIN_GEMM_ROWS on a CPU;
    # a padded (all-zero) query row gets a uniform softmax row that no output row reads
    qg = _pad_rows(q.float().reshape(hkv, rows, d), pad)
    parts = [torch.bmm(qg, k.float().transpose(1, 2)) for k, _ in views]
    s = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [Hkv, R, T]
    if masked:  # window rows only (a padded row has no window position)
        s = s[:, :rows].reshape(hkv, group, m, t).mul_(scale_by)  # (in place: a fresh product)
        s = s.masked_fill(~visible_mask(m, t, window_start, q.device), float("-inf")).view(hkv, rows, t)
    else:
        s = s.mul_(scale_by)
    p = torch.softmax(s, dim=-1)  # [Hkv, R, T] (R = G*M when masked)
    k_last, v_last = views[-1]
    lo = t - k_last.shape[1]  # the last view's first key
    o = None
    if len(views) > 1:  # the earlier views: the same keys for every row, one matmul each
        ph, at = _pad_rows(p, pad), 0
        for _, v in views[:-1]:
            n = v.shape[1]
            pv = ph[:, :, at : at + n]
            o = torch.bmm(pv, v.float()) if o is None else o.baddbmm_(pv, v.float())
            at += n
        o = o[:, :rows]
    if m == 1:  # a decode window: the last view's keys up to its row
        n = min(max(window_start + 1 - lo, 0), k_last.shape[1])
        # (slices skipped where they are the whole tensor: each is a dispatch)
        pt = p if lo == 0 and n == t else _pad_rows(p[:, :, lo : lo + n].contiguous(), pad)
        vt = v_last if n == v_last.shape[1] else v_last[:, :n]
        ot = torch.bmm(pt, vt.float())
        ot = ot if ot.shape[1] == rows else ot[:, :rows]
    else:  # one matmul per window row, over exactly the keys that row sees
        p4 = p[:, :rows].view(hkv, group, m, t)
        tail = []
        for i in range(m):
            n = min(max(window_start + i + 1 - lo, 0), k_last.shape[1])
            pi = _pad_rows(p4[:, :, i, lo : lo + n].contiguous(), pad)  # [Hkv, G (+pad), n]
            tail.append(torch.bmm(pi, v_last[:, :n].float())[:, :group])  # [Hkv, G, Dv]
        ot = torch.stack(tail, dim=2).reshape(hkv, rows, -1)  # rows in (g, i) order, as q's
    o = ot if o is None else o + ot
    return o.reshape(hq, m, -1)  # [Hq, M, Dv]


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact merge of fp32 partials by their log-sum-exp; rows with every lse -inf give zeros."""
    outs = torch.stack([o for o, _ in parts])  # [S, Hq, M, D]
    lses = torch.stack([lse for _, lse in parts])  # [S, Hq, M]
    total = torch.logsumexp(lses, dim=0)  # [Hq, M]; -inf where no segment has a visible key
    w = torch.exp(lses - total.clamp_min(torch.finfo(torch.float32).min))
    w = torch.nan_to_num(w, nan=0.0)
    return (w.unsqueeze(-1) * outs).sum(dim=0)


def lse_attention(
    q: torch.Tensor,
    views: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    window_start: int | None = None,
    flash: bool = False,
) -> torch.Tensor:
    """Per-view fp32 partials merged by their log-sum-exp: q ``[Hq, M, D]``; views ``[(k, v)]``
    each ``[Hkv, T_i, D]`` -> ``[Hq, M, D]`` in q's dtype. ``flash``: each partial through torch's
    CPU flash kernel (``flash_partial``; fp32 q on a CPU), else two matmuls (``segment_partial``)."""
    t = sum(k.shape[1] for k, _ in views)
    ws = t - q.shape[1] if window_start is None else window_start
    partial = flash_partial if flash else segment_partial
    parts = []
    offset = 0
    for k, v in views:
        n = k.shape[1]
        if n and offset <= ws + q.shape[1] - 1:  # skip empty segments and ones no row can see
            parts.append(partial(q, k, v, scale, ws, offset))
        offset += n
    if not parts:
        return torch.zeros_like(q)
    return merge_partials(parts).to(q.dtype)

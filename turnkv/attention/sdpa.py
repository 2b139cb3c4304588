"""The ``single`` path: torch SDPA on one (possibly strided) view, zero-copy.

A window over one view whose route is ``single`` (``portable.portable_route``) attends here; the
route sends a CPU's decode and verify windows past key 0 to ``lse.concat_segments`` instead (CPU
SDPA parallelises tiny problems over OpenMP threads and costs more than the two matmuls).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turnkv.attention.reference import visible_mask


def single_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window_start: int | None = None
) -> torch.Tensor:
    """torch SDPA on one (possibly strided) view with the window-causal mask. ``[Hq, M, D]`` out."""
    hq, m, _ = q.shape
    hkv, t, _ = k.shape
    ws = t - m if window_start is None else window_start
    gqa = hkv != hq
    if k.dtype != q.dtype:  # a CPU's bf16 rows under fp32 compute (kv.cache.kv_dtype)
        k, v = k.to(q.dtype), v.to(q.dtype)
    if ws + m - 1 < 0:
        return torch.zeros_like(q)
    if ws >= t - 1:  # every row sees every key
        return _sdpa(q, k, v, scale=scale, enable_gqa=gqa)
    if ws == 0 and t == m:  # a first chunk: plain causal, which SDPA runs without a mask tensor
        return _sdpa(q, k, v, scale=scale, is_causal=True, enable_gqa=gqa)
    mask = visible_mask(m, t, ws, q.device)
    out = _sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if ws < 0:  # rows before any key: SDPA gives NaN there
        out = torch.nan_to_num(out, nan=0.0)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """SDPA on ``[H, M, D]`` inputs, called with a batch axis: 3-D inputs miss the fused CUDA kernels."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], **kw)[0]

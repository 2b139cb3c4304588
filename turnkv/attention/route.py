"""What the attention backends share: the load-time verdict, route labels, and the one-view path.

Routes (see docs/DESIGN.md), chosen once at load for the whole engine (``selfcheck.make_backend``):
- ``fused``: the Triton kernels over one segment table per step (CUDA, verdict ``ok``), for every
  window, one view or many, so no call pays a per-length plan (cuDNN's SDPA plans per key length).
- ``single`` / ``lse``: the portable backend on any device: a window over one view goes through
  ``single_attention`` (torch SDPA on the zero-copy view, or on a CPU the same fp32 math as lse, so
  one segment is bit-identical to the contiguous layout), over several views through
  ``lse.lse_attention`` (per view in fp32 with its log-sum-exp, one exact merge). On a CPU where
  the C kernel builds, every window attends there instead (``cpu_native``; these labels stay).

Counts are keyed ``<route>_q<rows>`` for windows of 1-32 rows and ``<route>_prefill`` above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from turnkv.attention.lse import lse_attention
from turnkv.attention.reference import visible_mask
from turnkv.limits import MAX_WINDOW_ROWS


@dataclass
class Verdict:
    """The load-time support decision reported on ``/health.attention``.

    ``verdict`` is ``ok`` or a reason code (``no_cuda``, ``triton_missing``,
    ``head_dim_96_unsupported``, ``selfcheck_failed``, ``forced_lse``); ``route`` is the multi-segment
    route that follows from it (``fused`` only when ``verdict == "ok"``).
    """

    route: str = "lse"
    verdict: str = "no_cuda"
    reason: str = "the fused kernel needs a CUDA device"
    selfcheck: dict | None = None


def window_label(route: str, m: int) -> str:
    return f"{route}_q{m}" if m <= MAX_WINDOW_ROWS else f"{route}_prefill"


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
    if (
        q.device.type == "cpu"
        and not (ws == 0 and t == m)
        and (m <= MAX_WINDOW_ROWS or q.dtype == torch.float32)
    ):
        # CPU SDPA parallelises tiny decode problems over OpenMP threads: measured 11.6 ms per call
        # (9/3 heads, 200 keys, 2 threads, the other core busy) against 0.1 ms for the same math as
        # two matmuls; and with an explicit mask a 460-row window over 2.3K keys took 50 ms against
        # 15 ms through the flash kernel that lse.py calls. Both layouts take this same function,
        # so one segment stays bit-identical to the contiguous layout.
        return lse_attention(q, [(k, v)], scale, window_start)
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

"""Chooses the attention route for each call and counts what it chose.

Routes (see docs/DESIGN.md):
- ``fused``: one Triton launch over all segments; only when the load-time verdict is ``ok``
  (``turnkv.attention.selfcheck`` decides it and hands the router a checked kernel callable).
- ``single``: one view; the stock contiguous kernel (torch SDPA) on a zero-copy view, so a
  one-segment cache is bit-identical to the contiguous layout.
- ``lse``: any number of views on any torch device (``turnkv.attention.lse``).
- ``gather``: a counted, logged last resort for views the other routes cannot take (mixed dtypes
  or devices). Tests assert the normal paths never take it.

Counts are keyed ``<route>_q<rows>`` for windows of 1-32 rows and ``<route>_prefill`` above.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from turnkv.attention.lse import lse_attention
from turnkv.attention.reference import visible_mask

log = logging.getLogger(__name__)

MAX_WINDOW_ROWS = 32  # widest decode/verify window; wider windows are prefill chunks

Views = list[tuple[torch.Tensor, torch.Tensor]]
FusedFn = Callable[[torch.Tensor, Views, float], torch.Tensor]


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


@dataclass
class AttentionRouter:
    """Per-engine routing state. ``fused`` is a checked kernel callable or None."""

    verdict: Verdict = field(default_factory=Verdict)
    fused: FusedFn | None = None
    route_counts: Counter = field(default_factory=Counter)

    def attend(self, q: torch.Tensor, views: Views, scale: float) -> torch.Tensor:
        """q ``[Hq, M, D]``; views ``[(k, v)]`` each ``[Hkv, T_i, D]``; window-causal. Returns q's dtype."""
        m = q.shape[1]
        if len(views) == 1:
            route = "single"
            out = single_attention(q, views[0][0], views[0][1], scale)
        elif not _uniform(q, views):
            route = "gather"
            log.warning("attention gathered %d views (mixed dtype or device)", len(views))
            k = torch.cat([kv[0].to(q.device, q.dtype) for kv in views], dim=1)
            v = torch.cat([kv[1].to(q.device, q.dtype) for kv in views], dim=1)
            out = single_attention(q, k, v, scale)
        elif self.fused is not None:
            route = "fused"
            out = self.fused(q, views, scale)
        else:
            route = "lse"
            out = lse_attention(q, views, scale)
        self.route_counts[window_label(route, m)] += 1
        return out


def _uniform(q: torch.Tensor, views: Views) -> bool:
    return all(
        k.dtype == q.dtype and v.dtype == q.dtype and k.device == q.device and v.device == q.device
        for k, v in views
    )

"""Exact fp32 attention over gathered rows: the oracle every route and kernel is tested against.

Window semantics shared by all routes: the query window has ``M`` rows; the keys are the
concatenation of the views (``T`` rows in all). Query row ``i`` sees key position ``p`` iff
``p <= window_start + i``, where ``window_start`` defaults to ``T - M`` (the window's own rows are
the last ``M`` keys, so it sees all history and is causal only inside itself). A row that sees no
key returns zeros.
"""

from __future__ import annotations

import torch


def visible_mask(m: int, t: int, window_start: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """``[M, t]`` bool: row ``i`` sees key ``offset + j`` iff ``offset + j <= window_start + i``."""
    rows = torch.arange(m, device=device)[:, None] + window_start
    cols = torch.arange(t, device=device)[None, :] + offset
    return cols <= rows


def reference_attention(
    q: torch.Tensor,
    views: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    window_start: int | None = None,
) -> torch.Tensor:
    """q ``[Hq, M, D]``; views ``[(k, v)]`` each ``[Hkv, T_i, D]``. Returns fp32 ``[Hq, M, D]``."""
    hq, m, _ = q.shape
    k = torch.cat([kv[0].float() for kv in views], dim=1)  # [Hkv, T, D]
    v = torch.cat([kv[1].float() for kv in views], dim=1)  # [Hkv, T, Dv]
    hkv, t, _ = k.shape
    group = hq // hkv
    ws = t - m if window_start is None else window_start
    k = k.repeat_interleave(group, dim=0)  # [Hq, T, D]
    v = v.repeat_interleave(group, dim=0)
    s = torch.einsum("hmd,htd->hmt", q.float(), k) * scale  # [Hq, M, T]
    mask = visible_mask(m, t, ws, q.device)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # fully masked rows: softmax of all -inf is NaN -> weight 0
    return torch.einsum("hmt,htd->hmd", p, v)

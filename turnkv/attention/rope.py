"""Rotary position embedding applied to a step's rows (rotate-half layout, as Hugging Face stores
the weights), with tables the model builds once (``models.llama.Rope``)."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x ``[N, H, D]``; cos, signed sin ``[N, 1, D]`` (the sin table's first half negated).

    ``rotate_half(x) * sin == roll(x, D/2) * signed_sin``, so this is three kernels.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)

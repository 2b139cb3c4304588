"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

``temperature == 0`` is greedy (argmax; ties go to the lowest id, as ``torch.argmax`` does).
A seeded request draws from its own ``torch.Generator`` so two requests with the same seed and
the same logits draw the same tokens whatever else the server is doing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler and of the stop checks (the answer's length is the turn's
    ``max_tokens``, one fact in one place).

    Invariants (checked by the HTTP schema, asserted here): ``temperature >= 0``,
    ``0 < top_p <= 1``, ``top_k >= 0`` (0 = off).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0 or not (0 < self.top_p <= 1) or self.top_k < 0:
            raise ValueError(f"invalid sampling parameters: {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Draws one token id from a row of logits under one request's parameters."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device="cpu")
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits ``[V]`` (any float dtype) -> token id."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits).item())
        x = logits.float().cpu() / p.temperature  # [V]
        if p.top_k and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = cum - sorted_p >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator).item())

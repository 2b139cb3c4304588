"""Repetition penalties of one turn, applied on the device to each row its sampler draws.

- ``presence_penalty`` / ``frequency_penalty`` (OpenAI, -2..2): ``logit -= presence * [count > 0]
  + frequency * count``, ``count`` the token's occurrences in the answer so far;
- ``repetition_penalty`` (HF / vLLM, > 0, 1 = off): a token of the prompt or of the answer so far
  has its logit divided by it when positive, multiplied by it when not.

The state lives on the device (``counts`` ``[V]``, ``seen`` ``[V]``) and is updated there from
each drawn token (``observe``, in stream order after the draw): the next step's draw may be
launched before the turn has its token on the host (run-ahead), and a verify window's rows, drawn
one by one, see the tokens drawn before them as decode steps would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Penalties:
    """One turn's penalty state (module docstring); made for a ``SamplingParams`` that asks."""

    def __init__(self, presence: float, frequency: float, repetition: float, prompt: Sequence[int]) -> None:
        self.presence = presence
        self.frequency = frequency
        self.repetition = repetition
        self._prompt = list(prompt)  # marked in ``seen`` once the logits' width is known
        self.counts: torch.Tensor | None = None  # [V] fp32: answer occurrences
        self.seen: torch.Tensor | None = None  # [V] bool: in the prompt or the answer

    def ready(self, v: int, dev: torch.device) -> None:
        """Make the state for rows of ``v`` logits on ``dev`` (once; ``apply`` calls it)."""
        if self.counts is not None:
            return
        self.counts = torch.zeros(v, dtype=torch.float32, device=dev)
        self.seen = torch.zeros(v, dtype=torch.bool, device=dev)
        ids = [t for t in self._prompt if 0 <= t < v]
        if ids and self.repetition != 1.0:
            self.seen[torch.tensor(ids, dtype=torch.int64, device=dev)] = True

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """``row`` ``[V]`` fp32 -> the penalized row (a new tensor; -inf stays -inf)."""
        self.ready(row.shape[-1], row.device)
        x = row
        if self.repetition != 1.0:
            x = torch.where(self.seen, torch.where(x > 0, x / self.repetition, x * self.repetition), x)
        if self.frequency:
            x = x - self.counts * self.frequency
        if self.presence:
            x = x - (self.counts > 0).float() * self.presence
        return x

    def observe(self, token: torch.Tensor) -> None:
        """The drawn ``token`` (0-dim int64, on the device) joins the answer."""
        t = token.reshape(1)
        self.counts.index_add_(0, t, torch.ones(1, dtype=torch.float32, device=t.device))
        self.seen.index_fill_(0, t, True)

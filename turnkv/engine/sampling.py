"""Token sampling: logit bias, greedy, temperature, top-k, top-p, with a per-request seed.

``temperature == 0`` is greedy (argmax; ties go to the lowest id, as ``torch.argmax`` does).
A seeded request draws from its own ``torch.Generator`` so two requests with the same seed and
the same logits draw the same tokens whatever else the server is doing.

Exact at the limits, for any parameters the invariants allow: a temperature that rounds to 0 in
fp32 (below ~1.4e-45) is greedy; logits are shifted by their maximum before the division, so a
tiny temperature sends every other logit to ``-inf`` rather than the maximum to ``inf`` (which made
``softmax`` NaN); top-p always keeps the most likely token, however small ``top_p`` is.

``apply_logit_bias`` is a separate step on a logits row (OpenAI's ``logit_bias``), so a batched
sampler can apply it per row before its own sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SEED_MIN = -(1 << 63)  # the range torch.Generator.manual_seed takes
SEED_MAX = (1 << 64) - 1
LOGIT_BIAS_MAX = 100.0  # |bias| allowed, as the OpenAI API


class SamplingError(ValueError):
    """A sampling parameter out of range; ``field`` names it (the CLI maps it to its flag)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler and of the stop checks (the answer's length is the turn's
    ``max_tokens``, one fact in one place).

    Invariants (checked by the HTTP schema, enforced here with :class:`SamplingError`):
    ``0 <= temperature < inf``, ``0 < top_p <= 1``, ``top_k >= 0`` (0 = off), ``seed`` in
    ``[-2**63, 2**64)``, ``logit_bias`` pairs ``(token id >= 0, |bias| <= 100)``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise SamplingError("temperature", f"must be a finite number >= 0 (got {self.temperature})")
        if not (0 < self.top_p <= 1):
            raise SamplingError("top_p", f"must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0, 0 meaning off (got {self.top_k})")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise SamplingError("seed", f"must be in [-2**63, 2**64) (got {self.seed})")
        for tid, bias in self.logit_bias:
            if tid < 0 or not abs(bias) <= LOGIT_BIAS_MAX:
                raise SamplingError(
                    "logit_bias", f"needs token ids >= 0 and biases in [-100, 100] ({tid}: {bias})"
                )

    @property
    def greedy(self) -> bool:
        # a temperature that is 0 once rounded to fp32 (the logits' dtype) divides by zero: greedy
        return torch.tensor(self.temperature, dtype=torch.float32).item() == 0 or self.top_k == 1


def logit_bias_tensors(bias: tuple[tuple[int, float], ...], device: torch.device | str = "cpu"):
    """``(ids [B] long, values [B] fp32)`` of ``bias`` for :func:`apply_logit_bias`; None if empty."""
    if not bias:
        return None
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)  # [B]
    values = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)  # [B]
    return ids, values


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """OpenAI's ``logit_bias`` on one row: ``logits`` ``[V]`` -> fp32 ``[V]`` with ``values`` added at
    ``ids`` (a new tensor; a repeated id adds each of its values). Ids must be ``< V``."""
    out = logits.float().clone()  # [V]
    out.index_add_(0, ids.to(out.device), values.to(out.device))
    return out


class Sampler:
    """Draws one token id from a row of logits under one request's parameters, on the logits'
    device: a sampled request draws from its own ``torch.Generator`` on that device.

    ``draw`` keeps the token on the device, so the scheduler can draw a step's one-row windows
    there before anything reaches the host (and launch the next step from them: run-ahead). A
    sample is the exponential race: ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` is distributed as
    ``p``, one draw of ``V`` exponentials per token -- the same draws whichever path asks, so a
    seed gives the same tokens with or without run-ahead and speculation."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.bias = logit_bias_tensors(params.logit_bias, device)
        self.greedy = params.greedy
        self.generator: torch.Generator | None = None
        if not self.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits ``[V]`` (any float dtype) -> token id."""
        return int(self.draw(logits).item())

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """logits ``[V]`` -> the token id as a 0-dim int64 tensor on the logits' device."""
        p = self.params
        if self.bias is not None:
            logits = apply_logit_bias(logits, *self.bias)  # [V] fp32
        if self.greedy:
            return torch.argmax(logits)
        x = logits.float()  # [V]
        if x.device != self.generator.device:  # e.g. rows copied to the host by a caller
            x = x.to(self.generator.device)
        # shift first: the maximum becomes 0 and stays finite however small the temperature is
        x = (x - x.max()) / p.temperature  # [V], <= 0
        if p.top_k and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)  # [V]; the maximum contributes exp(0) = 1, so no NaN
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            # keep the smallest prefix whose mass reaches top_p; the most likely token always
            # stays (its mass before it is exactly 0 < top_p). No element is written from the
            # host: on CUDA that is a copy from pageable memory, which waits for the forward
            # (a top_p below fp32's smallest normal would round to 0 and drop that token too)
            drop = cum - sorted_p >= max(p.top_p, torch.finfo(torch.float32).tiny)
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        race = torch.empty_like(probs).exponential_(generator=self.generator)  # [V] ~ Exp(1)
        # (a draw of exactly 0 would make a masked token's 0/0 a NaN, which argmax would pick)
        return torch.argmax(probs / race.clamp_min_(torch.finfo(torch.float32).tiny))

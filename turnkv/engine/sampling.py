"""Token sampling: logit bias, penalties, greedy, temperature, min-p, top-k, top-p, with a
per-request seed.

``temperature == 0`` is greedy (argmax; ties go to the lowest id, as ``torch.argmax`` does).
A seeded request draws from its own ``torch.Generator`` so two requests with the same seed and
the same logits draw the same tokens whatever else the server is doing.

Exact at the limits, for any parameters the invariants allow: a temperature that rounds to 0 in
fp32 (below ~1.4e-45) is greedy; logits are shifted by their maximum before the division, so a
tiny temperature sends every other logit to ``-inf`` rather than the maximum to ``inf`` (which
would make ``softmax`` NaN); top-p always keeps the most likely token, however small ``top_p`` is.

OpenAI's ``logit_bias`` is a separate step over a step's rows (``processed_rows``: each row's
bias added in one launch for all of them) before the sampling. The order, per row: the grammar's mask (in
the logits already), the bias, the penalties (``engine.penalties``), then greedy's argmax or the
draw's temperature, ``min_p`` (keep tokens at least ``min_p`` times as likely as the most likely,
after temperature, as vLLM), top-k and top-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turnkv.engine.penalties import Penalties

SEED_MIN = -(1 << 63)  # the range torch.Generator.manual_seed takes
SEED_MAX = (1 << 64) - 1
LOGIT_BIAS_MAX = 100.0  # |bias| allowed, as the OpenAI API
PENALTY_MAX = 2.0  # |presence_penalty|, |frequency_penalty| allowed, as the OpenAI API


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
    ``[-2**63, 2**64)``, ``logit_bias`` pairs ``(token id >= 0, |bias| <= 100)``,
    ``-2 <= presence_penalty, frequency_penalty <= 2``, ``0 < repetition_penalty < inf``
    (1 = off), ``0 <= min_p <= 1``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_MAX <= getattr(self, name) <= PENALTY_MAX:
                raise SamplingError(name, f"must be in [-2, 2] (got {getattr(self, name)})")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise SamplingError(
                "repetition_penalty", f"must be a finite number > 0 (got {self.repetition_penalty})"
            )
        if not 0 <= self.min_p <= 1:
            raise SamplingError("min_p", f"must be in [0, 1] (got {self.min_p})")

    @property
    def penalized(self) -> bool:
        """Whether a row's logits depend on the answer so far (a greedy turn then draws)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        # a temperature that is 0 once rounded to fp32 (the logits' dtype) divides by zero: greedy
        return torch.tensor(self.temperature, dtype=torch.float32).item() == 0 or self.top_k == 1


def logit_bias_tensors(bias: tuple[tuple[int, float], ...], device: torch.device | str = "cpu"):
    """``(ids [B] long, values [B] fp32)`` of ``bias`` for :func:`processed_rows`; None if empty."""
    if not bias:
        return None
    device = torch.device(device)
    ids = on_device([t for t, _ in bias], torch.long, device)  # [B]; no wait for the device's queue
    values = on_device([b for _, b in bias], torch.float32, device)  # [B]
    return ids, values


class Sampler:
    """Draws one token id from a row of logits under one request's parameters, on the logits'
    device: a sampled request draws from its own ``torch.Generator`` on that device.

    ``draw_rows`` keeps the tokens on the device, so the step's chooser draws its sampled one-row
    windows there before anything reaches the host (the next step is launched from them:
    run-ahead, docs/SCHEDULER.md); ``draw`` is one row of it. A sample is the exponential race:
    ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` is distributed as ``p``, one draw of ``V``
    exponentials per token -- the same draws whichever path asks, so a seed gives the same tokens
    with or without run-ahead and speculation."""

    def __init__(
        self, params: SamplingParams, device: torch.device | str = "cpu", prompt: Sequence[int] = ()
    ) -> None:
        """``prompt``: the turn's prompt ids (what ``repetition_penalty`` counts besides the answer)."""
        self.params = params
        self.bias = logit_bias_tensors(params.logit_bias, device)
        self.greedy = params.greedy
        self.penalties: Penalties | None = None
        if params.penalized:
            p = params
            self.penalties = Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty, prompt)
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
        """logits ``[V]`` -> the token id as a 0-dim int64 tensor on the logits' device (the same
        bits as this row drawn among others by ``draw_rows``)."""
        return draw_rows([self], logits[None])[0]


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the device (pinned, async)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def processed_rows(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """The rows a draw and a logprob read: ``logits`` ``[S, V]`` (masked) -> fp32 ``[S, V]`` with
    each row's ``logit_bias`` added (before the penalties, temperature, min-p, top-k and top-p,
    which only a draw applies)."""
    biased = [(i, sp.bias) for i, sp in enumerate(samplers) if sp.bias is not None]
    if not biased:
        return logits.float()  # [S, V]
    # every row's bias in one add over the flattened rows (a row at a time was 2 launches a row)
    x = logits.to(torch.float32, copy=True)  # [S, V]
    v = x.shape[1]
    ids = torch.cat([b[0] for _, b in biased])  # [N]
    values = torch.cat([b[1] for _, b in biased])  # [N]
    base = on_device([i * v for i, b in biased for _ in range(b[0].numel())], torch.long, x.device)  # [N]
    x.view(-1).index_add_(0, ids.to(x.device) + base, values.to(x.device))
    return x


def draw_rows(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """One token per row: ``logits`` ``[S, V]`` (row ``i`` under ``samplers[i]``) -> int64 ``[S]``
    on the logits' device, in a few launches for all rows (a step's sampled turns together).

    A row's token does not depend on the other rows: every op is per row (the max, the softmax,
    the sort and its running sum, the argmax over a row's own values; each row's exponentials
    come from its own generator), and a row asking for no top-k or top-p cut goes through the
    same ops as one that does, cutting nothing. So a seed gives the same tokens whatever else is
    sampled in the step, and a verify window's rows, drawn one by one, draw as decode steps do."""
    x = processed_rows(samplers, logits)  # [S, V]
    if any(sp.penalties is not None for sp in samplers):
        x = torch.stack([sp.penalties.apply(r) if sp.penalties is not None else r
                         for r, sp in zip(x, samplers, strict=True)])  # fmt: skip
    chosen = torch.argmax(x, dim=-1) if all(sp.greedy for sp in samplers) else _race(samplers, x)
    for i, sp in enumerate(samplers):  # the drawn token joins the answer the next draw penalizes
        if sp.penalties is not None:
            sp.penalties.observe(chosen[i])
    return chosen


def _race(samplers: list[Sampler], x: torch.Tensor) -> torch.Tensor:
    """``draw_rows``'s draw of the rows ``x`` ``[S, V]`` (biased, penalized) -> int64 ``[S]``."""
    dev, v = x.device, x.shape[1]
    temps = on_device(
        [sp.params.temperature if not sp.greedy else 1.0 for sp in samplers], torch.float32, dev
    )
    # shift first: the maximum becomes 0 and stays finite however small the temperature is
    x = (x - x.amax(dim=-1, keepdim=True)) / temps[:, None]  # [S, V], <= 0
    if any(sp.params.min_p > 0 for sp in samplers):
        # p_i >= min_p * p_max is x_i >= log(min_p) (the maximum is 0); min_p 0 is log 0 = -inf
        floor = on_device([sp.params.min_p for sp in samplers], torch.float32, dev).log()
        x = x.masked_fill(x < floor[:, None], float("-inf"))
    ks = [sp.params.top_k if 0 < sp.params.top_k < v else 0 for sp in samplers]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values  # [S, K] descending
        kth = top.gather(1, on_device([max(k - 1, 0) for k in ks], torch.int64, dev)[:, None])  # [S, 1]
        kth = kth.masked_fill(on_device([k == 0 for k in ks], torch.bool, dev)[:, None], float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [S, V]; each row's maximum contributes exp(0) = 1: no NaN
    tiny = torch.finfo(torch.float32).tiny
    if any(sp.params.top_p < 1.0 for sp in samplers):
        # keep the smallest prefix whose mass reaches top_p; the most likely token always stays
        # (its mass before it is exactly 0; a top_p below fp32's smallest normal would round to
        # 0, hence the floor); a row without a cut gets 2 and keeps everything
        cut = [max(sp.params.top_p, tiny) if sp.params.top_p < 1.0 else 2.0 for sp in samplers]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= on_device(cut, torch.float32, dev)[:, None]
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))
    # the exponential race: argmax(p / E), E ~ Exp(1) per token, is distributed as p
    race = torch.ones_like(probs)
    for i, sp in enumerate(samplers):
        if not sp.greedy:
            race[i].exponential_(generator=sp.generator)
    # (a draw of exactly 0 would make a masked token's 0/0 a NaN, which argmax would pick)
    chosen = torch.argmax(probs / race.clamp_min_(tiny), dim=-1)  # [S]
    greedy = [i for i, sp in enumerate(samplers) if sp.greedy]
    if greedy:  # greedy rows among sampled ones (a logit_bias made them need a draw): the argmax
        rows = on_device(greedy, torch.int64, dev)
        chosen = chosen.index_copy(0, rows, torch.argmax(x.index_select(0, rows), dim=-1))
    return chosen

"""How one model is cut over the ranks of a tensor-parallel group (no communication here).

Rank ``r`` of ``n`` holds (Megatron's split, as vLLM, SGLang and gpt-fast do):

- attention: query heads ``[r*Hq/n, (r+1)*Hq/n)`` and KV heads ``[r*Hkv/n, (r+1)*Hkv/n)`` -- the
  rows of q, k and v (column-parallel) and the matching input columns of o (row-parallel). A
  GQA group never straddles two ranks, so each rank's attention is the unchanged kernel on
  ``Hq/n`` heads over its own ``Hkv/n`` KV heads, and its KV rows are ``1/n`` of a row;
- MLP: rows ``[r*I/n, (r+1)*I/n)`` of gate and up (column-parallel), the same input columns of
  down (row-parallel);
- embedding and LM head: vocabulary rows ``[r*Vs, (r+1)*Vs)`` with ``Vs = ceil(V/n)`` (the last
  shard padded with zero rows, whose logits are dropped after the gather);
- norms, the o bias and the RoPE tables: whole on every rank.

``ShardPlan.config`` is the shard's ``ModelConfig`` (what ``LlamaModel`` is built with on that
rank); ``take_param`` cuts a full parameter (the model's fused layout) and ``take_hf`` a full
checkpoint tensor (Hugging Face names) to this rank's part.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from turnkv.config import ModelConfig


def valid_sizes(cfg: ModelConfig) -> list[int]:
    """Group sizes that split ``cfg`` evenly: divisors of gcd(heads, KV heads, intermediate)."""
    g = math.gcd(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
    return [d for d in range(1, g + 1) if g % d == 0]


def check_divisible(cfg: ModelConfig, size: int, name: str = "the model") -> None:
    """Raise ValueError (one line, with the sizes that work) unless ``size`` splits ``cfg`` evenly."""
    if size < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {size}")
    parts = {"attention heads": cfg.num_heads, "KV heads": cfg.num_kv_heads}
    parts["MLP rows (intermediate_size)"] = cfg.intermediate_size
    bad = [f"{v} {k}" for k, v in parts.items() if v % size]
    if bad:
        ok = ", ".join(str(d) for d in valid_sizes(cfg))
        raise ValueError(
            f"--tensor-parallel {size} must divide the heads, KV heads and MLP rows evenly, but "
            f"{name} has {' and '.join(bad)}; sizes that work for it: {ok}"
        )


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``size`` of the model ``full`` (see the module docstring)."""

    rank: int
    size: int
    full: ModelConfig

    def __post_init__(self) -> None:
        check_divisible(self.full, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of a group of {self.size}")

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and LM head on every rank (``ceil(V / size)``)."""
        return -(-self.full.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The token ids ``[lo, hi)`` whose rows this rank holds (``hi - lo`` may be short of
        ``vocab_rows`` on the last rank: the rest are zero padding)."""
        lo = self.rank * self.vocab_rows
        return lo, min(lo + self.vocab_rows, self.full.vocab_size)

    @property
    def config(self) -> ModelConfig:
        """The shard's config: ``LlamaModel(plan.config)`` allocates exactly this rank's part."""
        f, n = self.full, self.size
        return replace(
            f,
            num_heads=f.num_heads // n,
            num_kv_heads=f.num_kv_heads // n,
            intermediate_size=f.intermediate_size // n,
            vocab_size=self.vocab_rows,
        )

    # -- cutting ----------------------------------------------------------------------------------
    def _part(self, t: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        """This rank's ``1/size`` of ``t`` along ``dim`` (whose length is ``total``), a view."""
        step = total // self.size
        return t.narrow(dim, self.rank * step, step)

    def _vocab(self, t: torch.Tensor) -> torch.Tensor:
        lo, hi = self.vocab_range
        if hi - lo == self.vocab_rows:
            return t[lo:hi]
        out = t.new_zeros(self.vocab_rows, *t.shape[1:])  # the last rank's zero padding
        out[: hi - lo] = t[lo:hi]
        return out

    def _qkv(self, t: torch.Tensor) -> torch.Tensor:
        """Rows q | k | v of a fused ``[(Hq + 2 Hkv) D, ...]`` tensor, each cut by heads."""
        f = self.full
        qd, kd = f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
        q, k, v = t[:qd], t[qd : qd + kd], t[qd + kd :]
        return torch.cat([self._part(q, 0, qd), self._part(k, 0, kd), self._part(v, 0, kd)])

    def _gate_up(self, t: torch.Tensor) -> torch.Tensor:
        inter = self.full.intermediate_size
        return torch.cat([self._part(t[:inter], 0, inter), self._part(t[inter:], 0, inter)])

    def take_param(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full parameter ``name`` (``LlamaModel.named_parameters`` names)."""
        leaf = name.rsplit(".", 1)[-1]
        f = self.full
        if leaf in ("embed", "lm_head"):
            return self._vocab(full)
        if leaf in ("qkv", "qkv_bias"):
            return self._qkv(full)
        if leaf == "gate_up":
            return self._gate_up(full)
        if leaf == "o":
            return self._part(full, 1, f.num_heads * f.head_dim)
        if leaf == "down":
            return self._part(full, 1, f.intermediate_size)
        return full  # norms, the o bias: whole on every rank

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The whole model's shape of the checkpoint tensor ``name`` (KeyError if it has none)."""
        return tuple(_whole(self.full, torch.float32).hf_slot(name).shape)

    def take_hf(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor ``name`` (Hugging Face names and layout)."""
        f = self.full
        qd, kd = f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self._vocab(full)
        for proj, total in (("q_proj", qd), ("k_proj", kd), ("v_proj", kd)):
            if f"self_attn.{proj}." in name:
                return self._part(full, 0, total)
        if name.endswith("self_attn.o_proj.weight"):
            return self._part(full, 1, qd)
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return self._part(full, 0, f.intermediate_size)
        if name.endswith("mlp.down_proj.weight"):
            return self._part(full, 1, f.intermediate_size)
        return full


@functools.lru_cache(maxsize=4)
def _whole(cfg: ModelConfig, dtype: torch.dtype):
    """The whole model on the meta device: names and full shapes, no memory."""
    from turnkv.models.llama import LlamaModel

    return LlamaModel(cfg, "meta", dtype)


def init_random_shard(model, seed: int = 0, std: float = 0.02) -> None:
    """Fill a shard model (``parallel.group.shard_model``: its ``tp.plan``) with this rank's part
    of exactly the weights ``LlamaModel.init_random`` gives the whole model: each full parameter
    is drawn in the same order from the same generator on this rank's device, cut, and dropped
    (one full parameter in memory at a time)."""
    plan: ShardPlan = model.tp.plan
    whole = _whole(plan.full, model.dtype)
    mine = dict(model.named_parameters())
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in whole.named_parameters():
            full = torch.empty(p.shape, device=model.device, dtype=p.dtype)
            if "norm" in name:
                full.fill_(1.0)
            else:
                full.normal_(0.0, std, generator=gen)
            mine[name].copy_(plan.take_param(name, full))
            del full

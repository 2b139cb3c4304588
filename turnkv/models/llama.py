"""One decoder for the Llama family: Llama (incl. 3.x rope scaling), Mistral, Qwen2, Qwen3, SmolLM2.

The model runs one *step*: the flat rows of any number of conversations' windows (prefill chunks,
decode rows, verify windows), with their positions; every linear layer runs once over all rows,
and attention goes through the step's ``StepAttention`` (``turnkv.attention.backend``), which
knows each window's KV views. Everything a family member adds is a flag on ``ModelConfig``:
``attention_bias`` (q/k/v bias, Qwen2), ``qk_norm`` (per-head RMSNorm on q and k before RoPE,
Qwen3), ``tie_embeddings`` (the LM head is the embedding matrix), ``rope_scaling`` (``llama3``,
``linear``).

Weights are kept fused (q|k|v in one matrix, gate|up in another) so a layer costs four matmuls
(qkv, o, gate|up, down; the residual adds ride in the last two). ``hf_slot`` maps tensors named as
in a Hugging Face checkpoint onto the right slice; every loader speaks that one naming.

Numerics follow transformers' Llama so logits match it: RMSNorm in fp32 then cast back, RoPE
tables computed in fp32, residual stream in the model dtype, logits returned in fp32.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from turnkv.attention.backend import StepAttention
from turnkv.config import ModelConfig, RopeScaling
from turnkv.models import cpu_decoder
from turnkv.models.matmul import PLAIN, MatmulPlan, embedding, input_dtype, linear, residual_linear
from turnkv.models.pointwise import rms_norm, silu_mul
from turnkv.models.quant import QuantWeight

if TYPE_CHECKING:
    from turnkv.parallel.group import TensorParallel


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` in fp32, with ``llama3`` or ``linear`` scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind != "llama3":
        return inv
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # the two cut-offs blends linearly in 1/wavelength.
    old = scaling.original_max_position
    long_cut = old / scaling.low_freq_factor  # wavelengths above this are scaled fully
    short_cut = old / scaling.high_freq_factor  # wavelengths below this are untouched
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > long_cut, inv / scaling.factor, inv)
    blend = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * scaled / scaling.factor + blend * scaled
    middle = (wavelen >= short_cut) & (wavelen <= long_cut)
    return torch.where(middle, blended, scaled)


class Rope(nn.Module):
    """cos/sin tables ``[P, D]`` (rotate-half layout), grown lazily to the largest position asked for.

    Tables are computed in fp32 (positions times inverse frequencies) and kept in the model dtype
    too, so a window only slices. ``freq_factors`` (GGUF ``rope_freqs``) divide the frequencies.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dtype = dtype
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv.to(device), persistent=False)  # [D/2] fp32
        self._cos = torch.empty(0, cfg.head_dim, device=device, dtype=dtype)
        self._sin = torch.empty(0, cfg.head_dim, device=device, dtype=dtype)

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the inverse frequencies by ``factors`` ``[D/2]`` (llama.cpp's rope_freqs)."""
        if factors.numel() != self.inv_freq.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} entries, expected {self.inv_freq.numel()}")
        self.inv_freq = self.inv_freq / factors.to(self.inv_freq.device, torch.float32).flatten()
        self._cos = self._cos[:0]
        self._sin = self._sin[:0]

    def ensure(self, positions: int) -> bool:
        """Grow the tables to cover positions ``[0, positions)`` (host work; before a step, never
        inside a CUDA graph capture). True when they were reallocated: a graph captured before
        reads the old tables, so its owner must drop it (``StepGraphs._write``)."""
        if positions <= self._cos.shape[0]:
            return False
        size = max(positions, 2 * self._cos.shape[0], 256)
        pos = torch.arange(size, device=self.inv_freq.device, dtype=torch.int64).float()
        freqs = pos[:, None] * self.inv_freq[None, :]  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self._cos = emb.cos().to(self.dtype)
        # the sin table's first half is negated so apply_rope needs a roll, not a cat and a neg
        self._sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(self.dtype)
        return True

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin ``[P, D]`` (contiguous), the positions ``ensure`` covered."""
        return self._cos, self._sin

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin ``[N, D]`` for device ``positions`` ``[N]`` (covered by ``ensure``)."""
        return self._cos[positions], self._sin[positions]


def _param(*shape: int, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    """Weights of one block. ``qkv`` rows are q (Hq*D) | k (Hkv*D) | v (Hkv*D); ``gate_up`` is gate | up."""

    def __init__(self, cfg: ModelConfig, device, dtype):
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.attn_norm = _param(hidden, device=device, dtype=dtype)
        self.qkv = _param((hq + 2 * hkv) * d, hidden, device=device, dtype=dtype)
        self.qkv_bias = _param((hq + 2 * hkv) * d, device=device, dtype=dtype) if cfg.attention_bias else None
        self.o = _param(hidden, hq * d, device=device, dtype=dtype)
        # Llama/Qwen3 with attention_bias also bias o_proj; Qwen2 biases q/k/v only.
        self.o_bias = (
            _param(hidden, device=device, dtype=dtype) if cfg.attention_bias and cfg.arch != "qwen2" else None
        )
        self.q_norm = _param(d, device=device, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = _param(d, device=device, dtype=dtype) if cfg.qk_norm else None
        self.mlp_norm = _param(hidden, device=device, dtype=dtype)
        self.gate_up = _param(2 * inter, hidden, device=device, dtype=dtype)
        self.down = _param(hidden, inter, device=device, dtype=dtype)

    def weights(self) -> tuple:
        """``(attn_norm, qkv, qkv_bias, q_norm, k_norm, o, o_bias, mlp_norm, gate_up, down)``,
        looked up once: ``layer.qkv`` goes through ``nn.Module.__getattr__`` (its dicts of
        parameters and modules), ten lookups a layer every step (docs/BENCHMARKS.md, 'Figures
        moved out of code comments'). Dropped whenever an attribute is set, deleted or moved."""
        w = self.__dict__.get("_weights")
        if w is None:
            w = (self.attn_norm, self.qkv, self.qkv_bias, self.q_norm, self.k_norm, self.o, self.o_bias)
            w = self.__dict__["_weights"] = (*w, self.mlp_norm, self.gate_up, self.down)
        return w

    def __setattr__(self, name: str, value) -> None:
        self.__dict__.pop("_weights", None)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self.__dict__.pop("_weights", None)
        super().__delattr__(name)

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_weights", None)
        return super()._apply(fn, recurse)


class LlamaModel(nn.Module):
    """The decoder over one step's flat rows (see the module docstring).

    Invariants: parameters never require grad; ``forward`` runs under ``torch.inference_mode`` and
    writes KV rows only through the step's ``StepAttention.store``; its only host work is launching
    kernels, so a step of fixed shape can be captured in a CUDA graph.
    """

    def __init__(self, cfg: ModelConfig, device, dtype):
        super().__init__()
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(
                f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}"
            )
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, device=self.device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.device, dtype) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, device=self.device, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, device=self.device, dtype=dtype)
        )
        self.rope = Rope(cfg, self.device, dtype)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # tensor parallelism (turnkv.parallel): ``cfg`` is then this rank's shard and ``tp`` the
        # collectives around the vocabulary-split and row-parallel layers; None in one process
        self.tp: TensorParallel | None = None

    # ---- weights -------------------------------------------------------------------------
    def hf_names(self) -> list[str]:
        """Every tensor name (Hugging Face convention) this model needs from a checkpoint."""
        cfg = self.cfg
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_embeddings:
            names.append("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
            if layer.qkv_bias is not None:
                names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            if layer.o_bias is not None:
                names.append(p + "self_attn.o_proj.bias")
            if layer.q_norm is not None:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def hf_slot(self, name: str) -> torch.Tensor:
        """The parameter (or fused slice of one) that the checkpoint tensor ``name`` fills, for
        loaders that write in place. Raises KeyError for a name this model has no place for."""
        return self._slot(name).detach()

    def _slot(self, name: str) -> torch.Tensor:
        owner, attr, rows = self.hf_place(name)
        param = getattr(owner, attr)
        return param if rows is None else param[rows]

    def hf_place(self, name: str) -> tuple[nn.Module, str, slice | None]:
        """Where the checkpoint tensor ``name`` goes: ``(owner, attribute, rows)``, ``rows`` the
        slice of a fused matrix it fills or None for the whole. Raises KeyError like ``hf_slot``."""
        cfg = self.cfg
        top = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm"}
        if name in top:
            return self, top[name], None
        if name == "lm_head.weight" and self.lm_head is not None:
            return self, "lm_head", None
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            raise KeyError(name)
        layer: DecoderLayer = self.layers[int(parts[2])]
        rest = ".".join(parts[3:])
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv_rows = {"q": slice(0, qd), "k": slice(qd, qd + kd), "v": slice(qd + kd, qd + 2 * kd)}
        inter = cfg.intermediate_size
        simple = {
            "input_layernorm.weight": ("attn_norm", None),
            "post_attention_layernorm.weight": ("mlp_norm", None),
            "self_attn.o_proj.weight": ("o", None),
            "self_attn.o_proj.bias": ("o_bias", None),
            "self_attn.q_norm.weight": ("q_norm", None),
            "self_attn.k_norm.weight": ("k_norm", None),
            "mlp.down_proj.weight": ("down", None),
            "mlp.gate_proj.weight": ("gate_up", slice(0, inter)),
            "mlp.up_proj.weight": ("gate_up", slice(inter, 2 * inter)),
        }
        if rest in simple and getattr(layer, simple[rest][0]) is not None:
            return layer, *simple[rest]
        proj, _, kind = rest.removeprefix("self_attn.").partition("_proj.")
        if rest.startswith("self_attn.") and proj in qkv_rows:
            if kind == "weight":
                return layer, "qkv", qkv_rows[proj]
            if kind == "bias" and layer.qkv_bias is not None:
                return layer, "qkv_bias", qkv_rows[proj]
        raise KeyError(name)

    @staticmethod
    def replace_weight(owner: nn.Module, attr: str, value: nn.Module) -> None:
        """Swap the parameter ``owner.attr`` for a weight module that ``matmul.linear`` and
        ``matmul.embedding`` accept (a loader hook: quantized weights stay packed)."""
        del owner._parameters[attr]
        setattr(owner, attr, value)

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Fill every weight in place on its device (norms at 1): for benches and tests."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=gen)

    # ---- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        logit_rows: torch.Tensor,
        attention: StepAttention,
        matmul: MatmulPlan = PLAIN,
        upcast: bool = True,
    ) -> torch.Tensor:
        """One step: token ``ids`` ``[N]`` at ``positions`` ``[N]`` (device tensors; the step's
        windows back to back, as ``attention`` and ``matmul`` were planned) -> fp32 logits
        ``[R, V]`` of the rows ``logit_rows`` ``[R]``. ``matmul``: the matmul path of the rows
        (``matmul.plan_matmul``: packed weights' wide rows; ``solo`` rows, each rounding as
        alone; every other op is row-wise). Positions must be covered by ``rope.ensure``. Never
        commits. ``upcast`` False: the logits in the compute dtype (a CUDA graph's output, which
        ``engine.graphs`` upcasts after each replay into a tensor of its own)."""
        eps, tp = self.cfg.rms_norm_eps, self.tp
        x = embedding(ids if tp is None else tp.vocab_ids(ids), self.embed, self.dtype)  # [N, hidden]
        if tp is not None:
            x = tp.vocab_reduce(x, ids)  # rows of other ranks' ids zeroed, summed over ranks
        head = self.embed if self.lm_head is None else self.lm_head
        dtype = x.dtype
        native = getattr(attention, "native_only", None)  # (the CPU's portable steps have it)
        decoder = cpu_decoder.for_model(self) if native is not None else None
        step = native() if decoder is not None else None
        if step is not None:  # every layer in one C call (cpu_decoder), the same bits as the loop
            x = decoder.run(x, positions, self.rope.tables(), step)
        else:
            x = self._layers(x, positions, attention, matmul)
        # the final norm in C too where the head's C matmul rounds its fp32 rows as the cast would
        if step is not None and isinstance(head, QuantWeight) and head.native:
            x = decoder.final_norm(x, logit_rows, self.norm)  # [R, hidden] fp32
        else:
            x = rms_norm(x.index_select(0, logit_rows), self.norm, eps, input_dtype(head))  # [R, hidden]
        logits = linear(x, head, None, matmul.head(), dtype)  # [R, V] ([R, V / n] per rank)
        if tp is not None:
            logits = tp.gather_vocab(logits)  # -> [R, V]
        return logits.float() if upcast else logits

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attention: StepAttention, matmul: MatmulPlan):
        """The decoder layers as torch ops and kernel calls, one layer after another: x ``[N,
        hidden]`` -> the residual stream after the last layer."""
        cfg = self.cfg
        n, d, hq, hkv, eps = x.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        cos, sin = self.rope.at(positions)  # [N, D]
        for i, layer in enumerate(self.layers):
            attn_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, mlp_norm, gate_up, down = layer.weights()
            # packed weights take bf16 rows: the norms round to it (once, as the matmul would)
            h = rms_norm(x, attn_norm, eps, input_dtype(qkv_w))
            qkv = linear(h, qkv_w, qkv_b, matmul, x.dtype).view(n, hq + 2 * hkv, d)  # [N, Hq+2Hkv, D]
            # [N, Hq+Hkv, D], [N, Hkv, D] (one call for both views, cheaper than two slices)
            qk, v = qkv.split_with_sizes((hq + hkv, hkv), 1)
            if q_norm is not None:
                qk = torch.cat([rms_norm(qk[:, :hq], q_norm, eps), rms_norm(qk[:, hq:], k_norm, eps)], 1)
            q = attention.rope_store(i, qk, v, cos, sin)  # [N, Hq, D]; k and v into every tail
            o = attention.attend(i, q, self.scale)  # [N, Hq, D]
            x = self._row_linear(x, o.reshape(n, hq * d), o_w, o_b, matmul)
            h = rms_norm(x, mlp_norm, eps, input_dtype(gate_up))
            up = silu_mul(linear(h, gate_up, None, matmul, x.dtype))  # [N, I]
            x = self._row_linear(x, up, down, None, matmul)
        return x

    def _row_linear(
        self, x: torch.Tensor, h: torch.Tensor, w, b: torch.Tensor | None, matmul: MatmulPlan
    ) -> torch.Tensor:
        """``x + h @ w.T (+ b)``, the residual add of o and down. Under tensor parallelism ``w``
        holds this rank's input columns (row-parallel): rank 0 adds the residual and the bias to
        its partial product, the other ranks compute theirs alone, and one all-reduce sums them
        (no extra kernel for the residual)."""
        tp = self.tp
        if tp is None:
            return residual_linear(x, h, w, b, matmul)
        y = residual_linear(x, h, w, b, matmul) if tp.rank == 0 else linear(h, w, None, matmul)  # [N, hidden]
        return tp.all_reduce(y)

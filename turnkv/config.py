"""Configuration records: what the model is (ModelConfig) and how the engine runs (EngineConfig).

ModelConfig is filled by ``turnkv.models.load`` from a Hugging Face ``config.json`` or from GGUF
metadata; EngineConfig from CLI flags, each of which has a ``TURNKV_*`` environment twin
(``--bank-bytes`` <-> ``TURNKV_BANK_BYTES``). A flag given on the command line wins over its env twin.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """``512M`` -> 536870912; plain integers are bytes. Units are binary (K=1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(
            f"not a size: {text!r} (expected bytes or a number with K, M, G or T, e.g. 512M, 8G)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class RopeScaling:
    """``llama3`` rope scaling (Llama 3.1+); ``kind == "none"`` means plain RoPE."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of one Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2).

    Invariants: ``num_heads % num_kv_heads == 0``; ``head_dim`` need not equal hidden/num_heads
    (Qwen3 sets it explicitly).
    """

    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position: int = 8192
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class EngineConfig:
    """Flags of ``turnkv serve|chat|generate``; each has a ``TURNKV_<NAME>`` env twin."""

    model: str = "default"
    device: str = "auto"  # auto | cpu | cuda | any torch device string
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    kv_layout: str = "segmented"  # segmented | contiguous
    attention: str = "auto"  # auto | fused | lse
    bank_bytes: str = "auto"  # N | auto
    max_context: int = 0  # 0: the model's max_position
    prefill_chunk: int = 512
    cuda_graphs: str = "auto"  # auto | off: captured decode steps on CUDA
    speculate: str = "auto"  # auto | off: context-copy speculative decoding (verify windows)
    max_running: int = 64  # turns in the running set (one window each per step)
    max_batch_tokens: int = 0  # prefill rows per step beside the decode rows; 0: --prefill-chunk
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: list[str] = field(default_factory=list)

    @classmethod
    def env_defaults(cls) -> dict[str, object]:
        """Values from ``TURNKV_*`` variables, typed like the fields; unknown names are ignored."""
        out: dict[str, object] = {}
        for f in fields(cls):
            raw = os.environ.get("TURNKV_" + f.name.upper())
            if raw is None:
                continue
            default = getattr(cls(), f.name)
            if isinstance(default, bool):
                out[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif isinstance(default, int):
                out[f.name] = int(raw)
            elif isinstance(default, list):
                out[f.name] = [x for x in raw.split(",") if x]
            else:
                out[f.name] = raw
        return out

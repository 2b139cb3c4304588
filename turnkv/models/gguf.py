"""GGUF files: metadata -> ModelConfig, tensor table, tokenizer, and dequantized tensors in HF layout.

Reading a GGUF's header with ``gguf.GGUFReader`` and converting its vocabulary take seconds, so
the first load writes what it learned (config, tensor table, tokenizer) to
``$TURNKV_CACHE_DIR`` (default ``$XDG_CACHE_HOME/turnkv``, else ``~/.cache/turnkv``) under
``gguf/<fingerprint>/``; later loads read that and map the tensor bytes straight from the file with
``numpy.memmap``. Packed weights are cached beside it (``pack_cache``).

llama.cpp's converter permutes the rows of the Q and K projections of ``llama`` models so its
own RoPE (adjacent pairs) applies; ``unpermute_rows`` restores the Hugging Face layout
(rotate-half pairs) so the same decoder serves both sources.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from turnkv import cbuild
from turnkv.config import ModelConfig, RopeScaling
from turnkv.tokenizer import Tokenizer, gguf_backend

log = logging.getLogger(__name__)

CACHE_FORMAT = 3  # bump when what is cached changes meaning
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
# ggml type names this loader dequantizes (F32/F16/BF16/Q8_0/Q4_0/Q4_1 in torch, the rest through
# gguf.quants); tests check each against transformers' dequantizer or the block layout itself.
SUPPORTED_TYPES = (
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
)


class GGUFError(ValueError):
    """The file is not something this loader supports; the message names what is."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in the file: ``shape`` in torch order (rows first), absolute byte offset."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    """What a load needs from a GGUF besides the tensor bytes."""

    config: ModelConfig
    tensors: list[TensorEntry]
    permuted_qk: bool  # llama.cpp permuted the Q/K rows (llama arch): undo on load
    sampling: dict = field(default_factory=dict)  # general.sampling.* values (models/generation.py)


def cache_root() -> Path:
    """``$TURNKV_CACHE_DIR``, else the C kernels' cache home (``$XDG_CACHE_HOME/turnkv``)."""
    return Path(os.environ.get("TURNKV_CACHE_DIR") or cbuild.cache_home())


# ---- header ---------------------------------------------------------------------------------
def _scalar(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def _config(reader, arch: str, tensor_names: set[str], bos: int | None, eos: set[int]) -> ModelConfig:
    def meta(key: str, default=None):
        return _scalar(reader, f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    n_vocab = meta("vocab_size")
    if n_vocab is None:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = RopeScaling()
    if meta("rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(meta("rope.scaling.factor", 1.0)))
    elif meta("rope.scaling.type") not in (None, "none"):
        raise GGUFError(
            f"GGUF rope scaling {meta('rope.scaling.type')!r} is not supported (supported: none, linear)"
        )
    return ModelConfig(
        arch=arch,
        vocab_size=int(n_vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position=int(meta("context_length", 4096)),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=bos,
        eos_token_ids=tuple(sorted(eos)),
    )


def read_header(path: Path) -> tuple[GGUFHeader, Tokenizer]:
    """Parse a GGUF with ``gguf.GGUFReader``. Raises GGUFError for an unsupported arch, tensor
    type or tokenizer, naming what is supported."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _scalar(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    entries = []
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise GGUFError(
                f"GGUF tensor {t.name} has type {type_name}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists the fastest dim first
        entries.append(TensorEntry(t.name, type_name, shape, int(t.data_offset), int(t.n_bytes)))
    names = {e.name for e in entries}

    def opt_int(key: str) -> int | None:
        value = _scalar(reader, key)
        return None if value is None else int(value)

    bos = opt_int("tokenizer.ggml.bos_token_id")
    eos = {
        i for i in (opt_int(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")) if i is not None
    }
    config = _config(reader, arch, names, bos, eos)
    try:
        backend = gguf_backend(
            model=_scalar(reader, "tokenizer.ggml.model"),
            pre=_scalar(reader, "tokenizer.ggml.pre"),
            tokens=reader.fields["tokenizer.ggml.tokens"].contents(),
            token_types=_scalar(reader, "tokenizer.ggml.token_type", []),
            merges=_scalar(reader, "tokenizer.ggml.merges", []),
        )
    except (ValueError, KeyError) as exc:
        raise GGUFError(str(exc)) from exc
    tokenizer = Tokenizer(
        backend,
        chat_template=_scalar(reader, "tokenizer.chat_template"),
        bos_token_id=bos,
        eos_token_ids=eos,
        add_bos=bool(_scalar(reader, "tokenizer.ggml.add_bos_token", False)),
        eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
    )
    sampling = {k: _scalar(reader, k) for k in reader.fields if k.startswith("general.sampling.")}
    return GGUFHeader(config, entries, permuted_qk=arch == "llama", sampling=sampling), tokenizer


# ---- cache ----------------------------------------------------------------------------------
def _to_json(header: GGUFHeader) -> dict:
    cfg = asdict(header.config)
    return {
        "format": CACHE_FORMAT,
        "config": cfg,
        "tensors": [asdict(e) for e in header.tensors],
        "permuted_qk": header.permuted_qk,
        "sampling": header.sampling,
    }


def _from_json(data: dict) -> GGUFHeader:
    if data.get("format") != CACHE_FORMAT:
        raise ValueError("stale cache format")
    cfg = dict(data["config"])
    cfg["rope_scaling"] = RopeScaling(**cfg["rope_scaling"])
    cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
    tensors = [TensorEntry(**{**e, "shape": tuple(e["shape"])}) for e in data["tensors"]]
    return GGUFHeader(ModelConfig(**cfg), tensors, bool(data["permuted_qk"]), dict(data["sampling"]))


def cached_header(path: Path, fingerprint: str) -> tuple[GGUFHeader, Tokenizer, bool]:
    """The header and tokenizer, from the cache when it holds this fingerprint (third value True),
    else parsed and written to the cache. A cache that cannot be read or written is skipped."""
    folder = cache_root() / "gguf" / fingerprint
    try:
        header = _from_json(json.loads((folder / "header.json").read_text()))
        return header, Tokenizer.load(folder), True
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError, OSError) as exc:
        log.warning("ignoring unreadable cache %s: %s", folder, exc)
    header, tokenizer = read_header(path)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Written in a temp folder and renamed, so a concurrent or killed load never sees half.
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        tokenizer.save(tmp)
        (tmp / "header.json").write_text(json.dumps(_to_json(header)))
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError as exc:
        log.warning("could not write the model cache under %s: %s", folder.parent, exc)
    return header, tokenizer, False


# ---- tensors --------------------------------------------------------------------------------
_HF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's precomputed llama3 frequency factors


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _HF_NAMES:
        return f"model.layers.{parts[1]}.{_HF_NAMES[parts[2]]}"
    raise GGUFError(f"GGUF tensor {name!r} is not part of a Llama/Qwen2/Qwen3 decoder")


def unpermute_perm(rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: ``w_hf = w_gguf[perm]``.

    llama.cpp stores each head's rows as interleaved pairs (row ``2i`` and ``2i+1`` rotate
    together); Hugging Face keeps the two halves apart (row ``i`` with row ``i + D/2``).
    """
    d = rows // n_heads
    half = torch.arange(d // 2)
    within = torch.cat([2 * half, 2 * half + 1])  # hf row j <- gguf row within[j] of the same head
    return (torch.arange(n_heads)[:, None] * d + within[None, :]).flatten()


_BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20)}  # values, bytes per block


def dequant_rows(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """raw ``[rows, row_bytes]`` uint8 on any device -> fp32 ``[rows, cols]`` for the simple formats."""
    rows = raw.shape[0]
    if type_name == "F32":
        return raw.view(torch.float32).clone()
    if type_name in ("F16", "BF16"):
        return raw.view(torch.float16 if type_name == "F16" else torch.bfloat16).float()
    _, nbytes = _BLOCK[type_name]
    blocks = raw.reshape(-1, nbytes)  # [B, nbytes]
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # [B, 1] scale
    if type_name == "Q8_0":
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * d).reshape(rows, -1)
    qs = blocks[:, 4:] if type_name == "Q4_1" else blocks[:, 2:]  # [B, 16]
    # Byte j holds value j in its low nibble and value j+16 in its high nibble.
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()  # [B, 32]
    if type_name == "Q4_0":
        out = (q - 8.0) * d
    else:
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()  # [B, 1] minimum
        out = q * d + m
    return out.reshape(rows, -1)


def read_tensor(
    data: np.ndarray, entry: TensorEntry, device: torch.device | None = None, unpermute_heads: int = 0
) -> torch.Tensor:
    """One tensor from the file's bytes (``data``: a uint8 memmap, mode "c") as fp32 in torch shape.

    The simple formats dequantize in torch on ``device`` (so a GPU gets the small quantized
    bytes); the rest go through ``gguf.quants``. ``unpermute_heads > 0`` undoes llama.cpp's Q/K
    row permutation on the raw rows (rows are quantized independently, so that is exact).
    """
    device = device or torch.device("cpu")
    rows = int(np.prod(entry.shape[:-1])) if len(entry.shape) > 1 else 1
    raw = torch.from_numpy(np.asarray(data[entry.offset : entry.offset + entry.nbytes]).reshape(rows, -1))
    if unpermute_heads and len(entry.shape) > 1:
        raw = raw[unpermute_perm(rows, unpermute_heads)]  # a copy, in the HF row order
    if entry.type_name in ("F32", "F16", "BF16", *_BLOCK):
        out = dequant_rows(raw.to(device), entry.type_name)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        arr = dequantize(raw.numpy(), GGMLQuantizationType[entry.type_name])
        out = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(device)
    out = out.reshape(entry.shape)
    if unpermute_heads and len(entry.shape) == 1:  # a bias: permute its values
        out = out[unpermute_perm(entry.shape[0], unpermute_heads).to(out.device)]
    return out


def raw_rows(data: np.ndarray, entry: TensorEntry, unpermute_heads: int = 0) -> torch.Tensor:
    """A matrix's stored bytes as uint8 ``[rows, row_bytes]`` in Hugging Face row order (llama.cpp's
    Q/K permutation undone when ``unpermute_heads > 0``; rows are quantized independently)."""
    rows = int(np.prod(entry.shape[:-1]))
    raw = torch.from_numpy(np.asarray(data[entry.offset : entry.offset + entry.nbytes]).reshape(rows, -1))
    return raw[unpermute_perm(rows, unpermute_heads)] if unpermute_heads else raw


def map_rows(path: Path, entry: TensorEntry) -> torch.Tensor:
    """A matrix's stored bytes ``[rows, row_bytes]`` through a memory map of its own: pages become
    resident only as rows are read, and stay file-backed (the map lives as long as the tensor)."""
    rows = int(np.prod(entry.shape[:-1]))
    mapped = np.memmap(path, dtype=np.uint8, mode="c", offset=entry.offset, shape=(entry.nbytes,))
    return torch.from_numpy(mapped.reshape(rows, -1))


def read_into(data: np.ndarray, entry: TensorEntry, dst: torch.Tensor, unpermute_heads: int = 0) -> None:
    """Like ``read_tensor`` but written into ``dst`` (any dtype/device) a chunk of rows at a
    time, so no full-size fp32 copy of a tensor is ever made (fresh memory is slow to touch)."""
    if len(entry.shape) == 1 or entry.type_name not in ("F32", "F16", "BF16", *_BLOCK):
        dst.copy_(read_tensor(data, entry, dst.device, unpermute_heads))
        return
    rows = int(np.prod(entry.shape[:-1]))
    raw = torch.from_numpy(np.asarray(data[entry.offset : entry.offset + entry.nbytes]).reshape(rows, -1))
    perm = unpermute_perm(rows, unpermute_heads) if unpermute_heads else None
    flat = dst.view(rows, -1)
    step = max(1, (1 << 22) // flat.shape[1])  # about 4M values per chunk
    for lo in range(0, rows, step):
        part = raw[lo : lo + step] if perm is None else raw[perm[lo : lo + step]]
        flat[lo : lo + step].copy_(dequant_rows(part.to(dst.device), entry.type_name))

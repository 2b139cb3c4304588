"""Loading: HF folders (one file or sharded), GGUF files (dequantization, llama.cpp's Q/K
permutation, metadata -> config, the header/tokenizer cache), random models, and the one-line
errors a user can cause."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.integrations.gguf import dequant as hf_dequant

from turnkv.attention.portable import PortableBackend
from turnkv.attention.verdict import Verdict
from turnkv.engine.step import Window, forward
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import ConversationKV
from turnkv.models import gguf as gg
from turnkv.models.load import (
    SHAPES,
    ModelLoadError,
    build_random_model,
    load_model,
    resolve_device,
    resolve_dtype,
)
from turnkv.tokenizer import byte_level

VOCAB = 320


def tiny_llama(path: Path, rope_scaling: dict | None = None, **save_kwargs) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        rope_scaling=rope_scaling,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path, **save_kwargs)
    byte_level().backend.save(str(path / "tokenizer.json"))
    return model


def our_logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    cfg = loaded.config
    shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, loaded.device)
    window = Window(ConversationKV(shape), ids.tolist(), logits=len(ids))
    return forward(loaded.model, [window], PortableBackend(Verdict(), loaded.model.dtype))[1]


# ---- errors ---------------------------------------------------------------------------------
def test_missing_path_is_one_clear_line(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "nope"), device="cpu", progress=False)
    msg = str(err.value)
    assert "does not exist" in msg and "gguf" in msg and "\n" not in msg


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path), device="cpu", progress=False)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg
    assert "\n" not in msg


def test_unsupported_rope_scaling(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"yarn.*supported: default, llama3, linear"):
        load_model(str(tmp_path), device="cpu", progress=False)


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_gguf_tensor_type(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "int8.gguf"
    write_gguf(path, "llama", {"token_embd.weight": np.zeros((8, 32), dtype=np.int8)})
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path), device="cpu", progress=False)
    msg = str(err.value)
    assert "I8" in msg and "Q4_1" in msg and "Q8_0" in msg and "\n" not in msg


def test_unsupported_gguf_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2", {"token_embd.weight": np.zeros((8, 32), dtype=np.float32)})
    with pytest.raises(ModelLoadError, match=r"'gpt2' is not supported.*llama, qwen2, qwen3"):
        load_model(str(path), device="cpu", progress=False)


def test_bad_device_dtype_and_shape():
    with pytest.raises(ModelLoadError, match="dtype"):
        resolve_dtype("int4")
    with pytest.raises(ModelLoadError, match="device"):
        resolve_device("tpu9")
    with pytest.raises(ModelLoadError, match="llama3-8b"):
        build_random_model("gpt-5", "cpu", "float32")
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bf16") == torch.bfloat16


# ---- HF folders -----------------------------------------------------------------------------
def test_sharded_folder_loads_the_same_weights(tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    tiny_llama(one)
    tiny_llama(many, max_shard_size="40KB")
    assert (many / "model.safetensors.index.json").is_file()
    a = load_model(str(one), device="cpu", dtype="float32", progress=False)
    b = load_model(str(many), device="cpu", dtype="float32", progress=False)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert len(a.fingerprint) == 24 and a.name == "one"
    c = load_model(str(one), device="cpu", dtype="float32", progress=False)
    assert c.fingerprint == a.fingerprint  # stable across loads


def test_half_precision_load_and_forward(tmp_path):
    hf = tiny_llama(tmp_path)
    ids = torch.arange(10) * 7 % VOCAB
    ours = load_model(str(tmp_path), device="cpu", dtype="bfloat16", progress=False)
    assert ours.model.embed.dtype == torch.bfloat16
    got = our_logits(ours, ids)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() < 0.1  # bf16 weights and activations


def test_random_model_builds_on_device_in_dtype():
    rm = build_random_model("test", "cpu", "bfloat16", seed=3)
    assert rm.name == "random:test" and rm.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in rm.model.parameters())
    logits = our_logits(rm, torch.tensor([1, 2, 3]))
    assert logits.shape == (3, SHAPES["test"].vocab_size) and torch.isfinite(logits).all()
    again = build_random_model("test", "cpu", "bfloat16", seed=3)
    assert torch.equal(again.model.embed, rm.model.embed) and again.fingerprint == rm.fingerprint
    assert rm.config.eos_token_ids and set(rm.config.eos_token_ids) == rm.tokenizer.eos_token_ids


# ---- GGUF -----------------------------------------------------------------------------------
def _sane_blocks(type_name: str, n_blocks: int, seed: int) -> np.ndarray:
    """Random blocks whose every even-aligned 16-bit word is a finite fp16 below 2 in magnitude
    (so the fp16 scales inside a block are sane whatever their offset)."""
    _, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = np.random.default_rng(seed).integers(0, 256, size=n_blocks * nbytes, dtype=np.uint8)
    words = raw.view(np.uint16)
    words &= np.uint16(0xBFFF)  # clear the exponent's top bit
    return raw


@pytest.mark.parametrize("type_name", [t for t in gg.SUPPORTED_TYPES if t not in ("F32", "F16", "BF16")])
def test_dequantization_matches_reference(type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    per_block, _ = gguf.GGML_QUANT_SIZES[qtype]
    cols = 2 * max(per_block, 256)
    rows = 6
    raw = _sane_blocks(type_name, rows * cols // per_block, seed=qtype.value)
    entry = gg.TensorEntry("blk.0.ffn_up.weight", type_name, (rows, cols), 0, raw.size)
    got = gg.read_tensor(raw, entry)
    if not type_name.endswith("_K"):  # 32-value blocks: the layout, written out below
        want = torch.from_numpy(block_reference(raw, type_name)).reshape(rows, cols)
    elif qtype.value in hf_dequant.GGML_BLOCK:  # k-quants: transformers' own dequantizer
        want = hf_dequant.dequantize(torch.from_numpy(raw.copy()), qtype.value, torch.float32)
        want = want.reshape(rows, cols)
    else:
        pytest.skip(f"this transformers has no {type_name} dequantizer to compare with")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    into = torch.empty(rows, cols)
    gg.read_into(raw, entry, into)
    torch.testing.assert_close(into, want, rtol=0, atol=0)


def block_reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    """ggml's 32-value blocks, element by element: fp16 scale d [, fp16 min m] [, 32 high bits],
    then the quants (Q8_0: 32 int8; 4/5-bit: 16 bytes, value j in the low nibble of byte j and
    value j+16 in its high nibble, the fifth bit of value i in bit i of the high bits)."""
    layout = {"Q8_0": (34, False, False), "Q4_0": (18, False, False), "Q4_1": (20, True, False)}
    layout |= {"Q5_0": (22, False, True), "Q5_1": (24, True, True)}
    nbytes, has_min, has_high = layout[type_name]
    out = []
    for b in raw.reshape(-1, nbytes):
        d = float(b[0:2].view(np.float16)[0])
        m = float(b[2:4].view(np.float16)[0]) if has_min else 0.0
        at = 4 if has_min else 2
        if type_name == "Q8_0":
            out.append([float(q) * d for q in b[2:].view(np.int8)])
            continue
        qh = int(b[at : at + 4].view(np.uint32)[0]) if has_high else 0
        qs = b[at + 4 :] if has_high else b[at:]
        offset = 0 if has_min else (16 if has_high else 8)  # symmetric formats centre the quants
        vals = [0.0] * 32
        for j in range(16):
            lo = int(qs[j] & 0x0F) | (((qh >> j) & 1) << 4)
            hi = int(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
            vals[j], vals[j + 16] = (lo - offset) * d + m, (hi - offset) * d + m
        out.append(vals)
    return np.asarray(out, dtype=np.float32)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows reordered so rotation pairs are adjacent."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp():
    w = torch.randn(3 * 64, 5)
    perm = gg.unpermute_perm(w.shape[0], 3)
    assert torch.equal(torch.from_numpy(llama_cpp_permute(w.numpy(), 3))[perm], w)


LLAMA3_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def llama_cpp_rope_factors(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """What llama.cpp's converter stores as ``rope_freqs.weight`` for llama3 rope scaling: the
    divisor of each frequency (1 for short wavelengths, ``factor`` for long ones, blended between)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        old = s["original_max_position_embeddings"]
        if wavelen < old / s["high_freq_factor"]:
            out.append(1.0)
        elif wavelen > old / s["low_freq_factor"]:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


@pytest.mark.parametrize("llama3", [False, True], ids=["plain-rope", "llama3-rope-freqs"])
def test_gguf_tiny_llama_matches_dequantized_reference(tmp_path, monkeypatch, llama3):
    """A GGUF written the way llama.cpp converts (names, permuted Q/K, Q8_0/Q4_0/F16/F32 tensors,
    byte-level vocabulary, llama3 scaling as a ``rope_freqs`` tensor) loads into the same logits
    as the HF model with those dequantized weights."""
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_llama(tmp_path / "hf", rope_scaling=LLAMA3_SCALING if llama3 else None)
    c = hf.config
    hd = c.hidden_size // c.num_attention_heads
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if llama3:
        w.add_tensor(
            "rope_freqs.weight", llama_cpp_rope_factors(hd, c.rope_parameters["rope_theta"], LLAMA3_SCALING)
        )
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(hd)
    tok = byte_level().backend
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab] + [f"<pad{i}>" for i in range(VOCAB - len(vocab))])
    w.add_token_types([3 if t.startswith("<|") else 1 for t, _ in vocab] + [3] * (VOCAB - len(vocab)))
    w.add_token_merges([])
    w.add_eos_token_id(258)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    qtypes = ["Q8_0", "Q4_0", "F16"]
    sd = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    reference = {}
    for i, (hf_name, arr) in enumerate(sd.items()):
        gname = llama_cpp_name(hf_name)
        if gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in gname else c.num_key_value_heads
            stored = llama_cpp_permute(arr, heads)
        else:
            stored = arr
        if arr.ndim == 2:
            qt = gguf.GGMLQuantizationType[qtypes[i % len(qtypes)]]
            q = gguf.quants.quantize(stored, qt)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qt)
            back = gguf.quants.dequantize(q, qt)
            # The reference is the HF layout of the same quantized values.
            reference[hf_name] = torch.from_numpy(
                np.ascontiguousarray(back if stored is arr else llama_cpp_permute_inverse(back, heads))
            )
        else:
            w.add_tensor(gname, stored)
            reference[hf_name] = torch.from_numpy(arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(reference[name])
    ids = torch.tensor([5, 77, 300, 12, 9, 250, 31])
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    ours = load_model(str(path), device="cpu", dtype="float32", progress=False, weights="dequant")
    assert ours.name == "tiny" and ours.config.num_kv_heads == 2 and not ours.config.tie_embeddings
    assert ours.tokenizer.eos_token_ids == {258}
    assert ours.tokenizer.decode(ours.tokenizer.encode("héllo")) == "héllo"
    got = our_logits(ours, ids)
    assert (got - want).abs().max().item() < 1e-4
    # The second load reads the header cache and gives the same model.
    again = load_model(str(path), device="cpu", dtype="float32", progress=False, weights="dequant")
    assert again.fingerprint == ours.fingerprint and again.config == ours.config
    assert any((tmp_path / "cache" / "gguf" / ours.fingerprint).iterdir())
    assert torch.equal(our_logits(again, ids), got)


def llama_cpp_permute_inverse(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_name(hf_name: str) -> str:
    """The tensor name llama.cpp's converter writes for a Hugging Face Llama tensor."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    part = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }[".".join(rest)]
    return f"blk.{layer}.{part}"


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_tensors_read_exactly(type_name):
    values = torch.randn(3, 40)
    stored = values.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name])
    raw = stored.contiguous().view(torch.uint8).numpy().reshape(-1)
    entry = gg.TensorEntry("output_norm.weight", type_name, (3, 40), 0, raw.size)
    assert torch.equal(gg.read_tensor(raw, entry), stored.float())
    into = torch.empty(3, 40, dtype=torch.bfloat16)
    gg.read_into(raw, entry, into)
    assert torch.equal(into, stored.float().to(torch.bfloat16))

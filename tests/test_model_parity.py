"""Logit parity of ``LlamaModel`` with Hugging Face transformers on the same random weights.

Each case builds a tiny random model with transformers (llama3 rope scaling + tied embeddings;
Qwen3 q/k norm with an explicit head_dim; Qwen2 q/k/v bias), saves it with ``save_pretrained``,
loads the folder with ``turnkv.models.load.load_model`` and runs the prompt in windows (a prefill
chunk, a seal so later windows read two views, single rows, a 3-row window) through the real
segmented and contiguous caches. Every row's logits must match transformers' single full
forward: fp32, max abs diff < 1e-4 (logits are O(1) here), argmax identical on every row.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from turnkv.attention.portable import PortableBackend
from turnkv.attention.verdict import Verdict
from turnkv.engine.step import Window, forward
from turnkv.kv.cache import KVShape
from turnkv.kv.contiguous import ContiguousKV
from turnkv.kv.segments import ConversationKV
from turnkv.models.load import load_model
from turnkv.tokenizer import byte_level

TOL = 1e-4  # fp32, max abs logit diff
VOCAB = 320  # the byte tokenizer's 259 ids fit
WINDOWS = [7, "seal", 1, 1, 1, 3, 1]  # 14 rows
PROMPT = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(1))

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
CASES = {
    "llama3-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            # original_max_position 32: the three wavelength bands (kept, blended, scaled) all occur.
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen3-qknorm": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0),
    ),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
}


def make_folder(path: Path, case: str) -> transformers.PreTrainedModel:
    """A random transformers model saved at ``path`` (with a tokenizer.json so the loader accepts it)."""
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    cfg = cfg_cls(**COMMON, **extra, initializer_range=0.1)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    byte_level().backend.save(str(path / "tokenizer.json"))
    return model


def run_windows(loaded, cache) -> tuple[torch.Tensor, list[str]]:
    """Our logits for PROMPT, fed window by window through ``cache``; ``[T, V]`` and the routes."""
    backend = PortableBackend(Verdict(), loaded.model.dtype)
    rows, labels, pos = [], [], 0
    for w in WINDOWS:
        if w == "seal":
            cache.seal()
            continue
        ids = PROMPT[pos : pos + w].tolist()
        plan, logits = forward(loaded.model, [Window(cache, ids, logits=len(ids))], backend)
        rows.append(logits)
        labels += plan.labels
        cache.commit(ids)
        pos += w
    assert pos == len(PROMPT) and cache.num_tokens == pos
    return torch.cat(rows), labels


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_folder(folder, request.param)
    with torch.no_grad():
        want = hf(PROMPT[None]).logits[0].float()  # [T, V]
    ours = load_model(str(folder), device="cpu", dtype="float32", progress=False)
    return ours, want


@pytest.mark.parametrize("layout", ["segmented", "contiguous"])
def test_logits_match_transformers(pair, layout):
    ours, want = pair
    cfg = ours.config
    shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    cache = ConversationKV(shape) if layout == "segmented" else ContiguousKV(shape)
    got, labels = run_windows(ours, cache)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert want.abs().max() > 0.5  # logits large enough that TOL is a real bound
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"max abs diff {diff}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    if layout == "segmented":  # windows after the seal read a segment plus the tail
        assert any(k.startswith("lse_") for k in labels), labels


def test_a_window_asking_for_its_last_logits_only(pair):
    ours, want = pair
    cfg = ours.config
    shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    cache = ConversationKV(shape)
    _, last = forward(
        ours.model, [Window(cache, PROMPT.tolist(), logits=1)], PortableBackend(Verdict(), ours.model.dtype)
    )
    assert last.shape == (1, cfg.vocab_size)
    assert (last[0] - want[-1]).abs().max().item() < TOL
    assert cache.num_tokens == 0  # the model never commits; the engine does

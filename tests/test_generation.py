"""A model's recommended sampling defaults (turnkv/models/generation.py): read from an HF folder's
``generation_config.json``, a GGUF's ``general.sampling.*`` keys and the default model's card, and
the one rule that fills unset fields (flag, else model, else built-in)."""

from __future__ import annotations

import json
import logging

import gguf
import pytest
from test_load import tiny_llama

from turnkv.models import generation
from turnkv.models import gguf as gg
from turnkv.models.generation import BUILTIN, DEFAULT_MAX_TOKENS, SamplingDefaults, resolve
from turnkv.models.load import load_model
from turnkv.tokenizer import byte_level


def test_an_hf_folder_brings_its_generation_config(tmp_path, caplog):
    tiny_llama(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.8,
                "top_k": 20,
                "max_new_tokens": 300,
                "repetition_penalty": 1.05,
                "eos_token_id": 2,
            }
        )
    )
    with caplog.at_level(logging.INFO, logger="turnkv.models.generation"):
        loaded = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)
    assert loaded.sampling == SamplingDefaults(temperature=0.6, top_p=0.8, top_k=20, max_tokens=300)
    assert "repetition_penalty 1.05" in caplog.text  # said, not applied: the sampler has none


def test_an_hf_folder_without_one_says_nothing(tmp_path):
    tiny_llama(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)
    assert loaded.sampling == SamplingDefaults()


def test_do_sample_false_is_greedy_and_bad_values_are_dropped(caplog):
    greedy = generation.from_generation_config({"do_sample": False, "temperature": 0.7, "top_p": 0.5})
    assert greedy == SamplingDefaults(temperature=0.0)
    with caplog.at_level(logging.WARNING, logger="turnkv.models.generation"):
        odd = generation.from_generation_config(
            {"temperature": -1, "top_p": 0, "top_k": 2.5, "max_new_tokens": 0}
        )
    assert odd == SamplingDefaults()  # a model's file never stops it loading
    assert all(name in caplog.text for name in ("temperature", "top_p", "top_k", "max_tokens"))
    assert generation.from_generation_config({"temperature": 1, "top_p": 1}) == SamplingDefaults(1.0, 1.0)


def _header_only_gguf(path, sampling: dict) -> None:
    """A GGUF with metadata and a vocabulary but no tensors: enough for ``read_header``."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "embedding_length": 64, "feed_forward_length": 128}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_head_count(4)
    tok = byte_level().backend
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])])
    w.add_token_merges([])
    for key, value in sampling.items():
        (w.add_float32 if isinstance(value, float) else w.add_int32)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def test_a_gguf_brings_its_sampling_keys_through_the_header_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    keys = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.min_p": 0.05}
    _header_only_gguf(path, keys)
    parsed, _, hit = gg.cached_header(path, "fp")
    cached, _, hit_again = gg.cached_header(path, "fp")
    assert (hit, hit_again) == (False, True)
    for header in (parsed, cached):
        assert generation.from_gguf(header.sampling) == SamplingDefaults(temperature=0.7, top_k=40)


def test_the_default_model_samples_as_its_card_says(default_model):
    assert default_model.sampling == SamplingDefaults(temperature=0.2, top_p=0.9)


def test_the_flag_wins_then_the_model_then_the_built_in():
    model = SamplingDefaults(temperature=0.2, top_p=0.9, max_tokens=300)
    r = resolve(SamplingDefaults(temperature=0.0, top_k=5), model)
    assert r.values == SamplingDefaults(temperature=0.0, top_p=0.9, top_k=5, max_tokens=300)
    assert r.sources == {"temperature": "flag", "top_p": "model", "top_k": "flag", "max_tokens": "model"}
    bare = resolve(SamplingDefaults(), SamplingDefaults())
    assert bare.values == BUILTIN and set(bare.sources.values()) == {"built-in"}
    assert BUILTIN == SamplingDefaults(1.0, 1.0, 0, DEFAULT_MAX_TOKENS) and DEFAULT_MAX_TOKENS < 4096
    assert r.doc()["source"]["top_p"] == "model" and r.doc()["top_k"] == 5


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", float("nan")), ("top_p", 1.5), ("top_k", -1), ("max_tokens", 0)]
)
def test_problems_name_the_field(field, value):
    assert set(SamplingDefaults(**{field: value}).problems()) == {field}

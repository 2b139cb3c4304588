"""Tokenizer: the default model's vocabulary and chat template against transformers' tokenizer
built from the same GGUF, HF-folder tokenizers (BOS handling, template sources), content parts,
and StreamDecoder reproducing ``decode(all)`` exactly when fed one token at a time."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnkv.models import gguf as gg
from turnkv.models.load import default_model_path, file_fingerprint
from turnkv.tokenizer import ChatTemplateError, StreamDecoder, Tokenizer, byte_level

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "line one\nline two\n\n\tindented",
    "Numbers: 12345, 3.14159 and 2024-06-01.",
    "naïve café, Ærøskøbing, 東京タワー, 🙂👍🏽 emoji",
    "code: def f(x):\n    return x**2  # square",
    "It's, they're, we'll; I'd've",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi in 2 words."},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "Now in French, with émojis 🙂"},
    ],
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> Tokenizer:
    mp = pytest.MonkeyPatch()
    mp.setenv("TURNKV_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    path = default_model_path()
    _, tok, _ = gg.cached_header(path, file_fingerprint(path))
    mp.undo()
    return tok


@pytest.fixture(scope="module")
def hf_smol():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_encode_matches_transformers(smol, hf_smol):
    for text in TEXTS:
        assert smol.encode(text) == hf_smol(text, add_special_tokens=False).input_ids, text
        assert smol.decode(smol.encode(text)) == text
    assert smol.encode("2024") == [smol.encode(d)[0] for d in "2024"]  # SmolLM splits digits


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(smol, hf_smol, gen):
    for chat in CHATS:
        want = hf_smol.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)
        want = want["input_ids"] if not isinstance(want, list) else want
        assert smol.apply_chat_template(chat, add_generation_prompt=gen) == want


def test_default_special_tokens(smol):
    assert smol.eos_token_ids == {2}  # <|im_end|>
    assert smol.bos_token_id == 1 and not smol.add_bos  # the GGUF says no BOS on raw prompts
    assert smol.prompt_text("Once upon") == smol.encode("Once upon")
    assert smol.encode("<|im_start|>user") == [1, *smol.encode("user")]  # special text -> its id
    assert smol.decode([1, *smol.encode("hi"), 2]) == "hi"  # special ids are skipped
    assert smol.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    assert smol.vocab_size == 49152


def test_content_parts_and_errors(smol):
    plain = [{"role": "user", "content": "Hello there"}]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}
    ]
    assert smol.apply_chat_template(parts) == smol.apply_chat_template(plain)
    with pytest.raises(ChatTemplateError, match="image_url"):
        smol.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ChatTemplateError, match="role"):
        smol.apply_chat_template([{"content": "no role"}])
    bare = Tokenizer(
        byte_level().backend, chat_template=None, bos_token_id=None, eos_token_ids=(), add_bos=False
    )
    with pytest.raises(ValueError, match="no chat template"):  # a ValueError: the server answers 400
        bare.apply_chat_template(plain)


def test_template_raise_exception_is_a_clear_error():
    tok = byte_level()
    strict = Tokenizer(
        tok.backend,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x",
        bos_token_id=256,
        eos_token_ids={256},
        add_bos=False,
    )
    assert strict.render_chat([{"role": "user", "content": "a"}]) == "x"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        strict.render_chat([{"role": "assistant", "content": "a"}])


def test_hf_folder_bos_and_template_sources(tmp_path):
    """A folder whose post-processor adds BOS (Llama 3 style) gives prompt_text a BOS; the
    template comes from tokenizer_config.json, or chat_template.jinja when present."""
    from tokenizers import processors

    backend = byte_level().backend
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 256)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    cfg = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "chat_template": "T:{{ messages[0]['content'] }}{{ eos_token }}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.add_bos and tok.prompt_text("ab") == [256, 97, 98]
    assert tok.encode("ab") == [97, 98]
    assert tok.eos_token_ids == {256, 258} and tok.eos_token_id == 258
    assert tok.render_chat([{"role": "user", "content": "q"}]) == "T:q<|im_end|>"  # not min(eos ids)
    (tmp_path / "chat_template.jinja").write_text("J:{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_folder(tmp_path).render_chat([{"role": "user", "content": "q"}]) == "J:q"


def test_save_load_roundtrip(smol, tmp_path):
    smol.save(tmp_path)
    back = Tokenizer.load(tmp_path)
    assert back.eos_token_ids == smol.eos_token_ids and back.add_bos == smol.add_bos
    for chat in CHATS:
        assert back.apply_chat_template(chat) == smol.apply_chat_template(chat)


# ---- StreamDecoder --------------------------------------------------------------------------
def stream(tok: Tokenizer, ids: list[int]) -> tuple[str, list[str]]:
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return "".join(pieces), pieces


def test_stream_decoder_default_vocab(smol):
    for text in TEXTS:
        ids = smol.encode(text)
        whole, pieces = stream(smol, ids)
        assert whole == smol.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces), pieces  # never half a character
    # A chat turn with special tokens, which decode skips.
    ids = smol.apply_chat_template(CHATS[1], add_generation_prompt=False)
    assert stream(smol, ids)[0] == smol.decode(ids)


def test_stream_decoder_splits_multibyte_characters():
    tok = byte_level()  # one token per byte: every multi-byte character arrives in pieces
    text = "a€b😀c東"
    ids = tok.encode(text)
    assert len(ids) > len(text)
    whole, pieces = stream(tok, ids)
    assert whole == text
    assert pieces[:3] == ["a", "", ""] and pieces[3] == "€"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 258), max_size=40))
def test_stream_decoder_equals_decode_on_any_bytes(ids):
    """Any byte sequence, invalid UTF-8 and special tokens included."""
    tok = _BYTES
    assert stream(tok, ids)[0] == tok.decode(ids)


_BYTES = byte_level()

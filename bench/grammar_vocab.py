"""Vocabularies for the grammar benchmarks: the default model's real one, and a synthetic 128K one.

A grammar's mask cost grows with the vocabulary and depends on what its tokens look like, so the
benches use the default model's tokenizer (SmolLM2, 49152 byte-level BPE tokens) as is, and a
128K vocabulary made from it: its 49152 tokens, then tokens that are the concatenation of two of
its tokens of at most 8 characters (picked with a fixed seed, no duplicates) up to the size asked
(128256, Llama 3's). BPE vocabularies grow that way (a merge joins two tokens), so the new tokens
look like real ones; none is a special token. Encoding keeps the default model's merges, so text
tokenizes as before, and a grammar must still judge all 128K tokens at every step.

``--tokenizer DIR`` in the benches reads a folder ``Tokenizer.save`` wrote (``tokenizer.json`` and
``turnkv_tokenizer.json``): the way to bring the default model's tokenizer to a machine without the
model package or the ``gguf`` module (the GPU box): copy it from ``~/.cache/turnkv/gguf/<id>/``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer as Backend

from turnkv.tokenizer import Tokenizer

SEED = 13


def default_tokenizer(folder: str | None = None) -> Tokenizer:
    """The default model's tokenizer: from ``folder`` (a saved one), else from the installed model
    (its GGUF header, cached under ~/.cache/turnkv after the first read)."""
    if folder:
        return Tokenizer.load(folder)
    from turnkv.models import gguf
    from turnkv.models.load import default_model_path, file_fingerprint

    path = default_model_path()
    return gguf.cached_header(path, file_fingerprint(path))[1]


def synthetic(base: Tokenizer, size: int, seed: int = SEED) -> Tokenizer:
    """``base`` with its vocabulary extended to ``size`` tokens (see the module doc)."""
    spec = json.loads(base.backend.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {a["content"] for a in spec.get("added_tokens", [])}
    short = sorted(t for t in vocab if len(t) <= 8 and t not in special)
    rng = random.Random(seed)
    n = max(vocab.values()) + 1
    while n < size:
        token = rng.choice(short) + rng.choice(short)
        if token not in vocab:
            vocab[token] = n
            n += 1
    backend = Backend.from_str(json.dumps(spec))
    return Tokenizer(
        backend,
        chat_template=base.chat_template,
        bos_token_id=base.bos_token_id,
        eos_token_ids=base.eos_token_ids,
        eos_token_id=base.eos_token_id,
        add_bos=base.add_bos,
    )


def vocabularies(names: str, folder: str | None = None) -> dict[str, Tokenizer]:
    """``"49152,128256"`` -> {"49152": the default tokenizer, "128256": the synthetic one}."""
    base = default_tokenizer(folder)
    out = {}
    for name in names.split(","):
        size = int(name)
        out[name] = base if size <= base.vocab_size else synthetic(base, size)
        assert out[name].vocab_size == max(size, base.vocab_size), (name, out[name].vocab_size)
    return out


def save_default(folder: str | Path) -> None:
    """Write the default model's tokenizer to ``folder`` (for ``--tokenizer`` on another machine)."""
    default_tokenizer().save(folder)

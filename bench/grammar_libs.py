"""Which grammar library: the cost of a token mask in xgrammar, llguidance and outlines-core.

For each library and vocabulary (``grammar_vocab``: the default model's 49152 tokens, and 128256),
the same JSON document is walked token by token under a JSON schema (and under "any JSON object",
which outlines-core, a regex engine, cannot express): at each token the library fills the
bitmask of allowed tokens (``fill``), the mask is applied to a logits row (``apply``: the same
op for all three, turnkv's ``engine.masks.apply_bitmask``, since the bitmask layout is the
same), and the token is consumed. Reported per token: fill and apply in microseconds (the best of ``--reps`` walks), and
once per library and vocabulary: the tokenizer set-up (s) and the schema's compile time (ms).

Libraries that are not installed are skipped; to compare all three:
    pip install xgrammar==0.2.9 llguidance==1.9.1 outlines-core==0.2.14
    python bench/grammar_libs.py --vocab 49152,128256
Prints a table; writes bench/out/<tag>.json/.png.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from grammar_vocab import vocabularies
from report import save

from turnkv.engine.masks import apply_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "score", "active"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace of London",
    "age": 36,
    "email": "ada@analytical-engine.org",
    "tags": ["mathematics", "poetry", "engines", "notes on the Bernoulli numbers"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "score": 99.25,
    "active": True,
}
CANONICAL = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _xgrammar(tok, vocab: int, kind: str):
    import xgrammar as xg
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    info = xg.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tok.backend),
        vocab_size=vocab,
        stop_token_ids=sorted(tok.eos_token_ids),
    )
    compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    schema = SCHEMA if kind == "schema" else {"type": "object"}
    compiled = compiler.compile_json_schema(
        schema, any_whitespace=False, separators=(", ", ": "), strict_mode=kind == "schema"
    )
    t2 = time.perf_counter()
    matcher = xg.GrammarMatcher(compiled)
    return (
        t1 - t0,
        t2 - t1,
        lambda mask: matcher.fill_next_token_bitmask(mask, 0),
        matcher.accept_token,
        matcher.reset,
    )


def _llguidance(tok, vocab: int, kind: str):
    import llguidance

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=sorted(tok.eos_token_ids))
    t1 = time.perf_counter()
    schema = SCHEMA if kind == "schema" else {"type": "object"}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=CANONICAL)
    matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    t2 = time.perf_counter()

    def fill(mask):
        row = mask[0]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    return t1 - t0, t2 - t1, fill, matcher.consume_token, matcher.reset


def _outlines(tok, vocab: int, kind: str):
    import llguidance
    import outlines_core as oc

    if kind != "schema":
        return None  # a regex engine: no recursive grammar such as "any JSON object"
    ll = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab)
    decoded = [ll.decode_bytes([i]) for i in range(tok.vocab_size)]  # each token's bytes
    t0 = time.perf_counter()
    eos = min(tok.eos_token_ids)
    table: dict[bytes, list[int]] = {}
    for i, piece in enumerate(decoded[: tok.vocab_size]):
        if i not in tok.eos_token_ids and piece:
            table.setdefault(piece, []).append(i)
    vocabulary = oc.Vocabulary(eos, table)
    t1 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[ ]?")
    guide = oc.Guide(oc.Index(regex, vocabulary))
    t2 = time.perf_counter()

    def fill(mask):
        guide.write_mask_into(mask.data_ptr(), mask[0].numel(), 4)

    return t1 - t0, t2 - t1, fill, guide.advance, guide.reset


LIBRARIES = {"xgrammar": _xgrammar, "llguidance": _llguidance, "outlines-core": _outlines}


def walk(lib: str, tok, vocab: int, kind: str, reps: int) -> dict | None:
    made = LIBRARIES[lib](tok, vocab, kind)
    if made is None:
        return None
    init_s, compile_s, fill, consume, reset = made
    ids = tok.encode(json.dumps(DOC))
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(1, vocab)
    best = None
    for _ in range(reps):
        reset()
        t_fill = t_apply = 0.0
        for t in ids:
            a = time.perf_counter()
            fill(mask)
            b = time.perf_counter()
            apply_bitmask(logits, mask, [0])
            c = time.perf_counter()
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"{lib} refuses token {t} of a valid document"
            consume(t)
            t_fill, t_apply = t_fill + b - a, t_apply + c - b
        cur = (t_fill / len(ids) * 1e6, t_apply / len(ids) * 1e6)
        best = cur if best is None or sum(cur) < sum(best) else best
    return {
        "init_s": round(init_s, 3),
        "compile_ms": round(compile_s * 1e3, 1),
        "fill_us": round(best[0], 1),
        "apply_us": round(best[1], 1),
        "tokens": len(ids),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="49152,128256")
    ap.add_argument("--tokenizer", help="a saved tokenizer folder (default: the installed default model's)")
    ap.add_argument("--libs", default=",".join(LIBRARIES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tag", default="grammar_libs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, tok in vocabularies(args.vocab, args.tokenizer).items():
        for kind in ("schema", "object"):
            for lib in args.libs.split(","):
                try:
                    r = walk(lib, tok, int(name), kind, args.reps)
                except ImportError as e:
                    print(f"skip {lib}: {e}")
                    continue
                if r is not None:
                    rows.append({"vocab": int(name), "grammar": kind, "library": lib, **r})
    print(
        f"{'vocab':>7} {'grammar':>7} {'library':>14} {'fill us':>8} {'apply us':>9} {'compile ms':>10} {'init s':>7}"
    )
    for r in rows:
        print(
            f"{r['vocab']:>7} {r['grammar']:>7} {r['library']:>14} {r['fill_us']:>8} {r['apply_us']:>9} {r['compile_ms']:>10} {r['init_s']:>7}"
        )
    save({"rows": rows, "reps": args.reps, "threads": 1}, args.tag, plot)


def plot(results: dict, plt, path) -> None:
    rows = [r for r in results["rows"] if r["grammar"] == "schema"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['library']}\n{r['vocab']}" for r in rows]
    ax.bar(labels, [r["fill_us"] for r in rows], label="fill (library)")
    ax.bar(
        labels,
        [r["apply_us"] for r in rows],
        bottom=[r["fill_us"] for r in rows],
        label="apply (shared kernel)",
    )
    ax.set_ylabel("µs per token (JSON schema)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

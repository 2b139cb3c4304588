"""Constrained decoding (turnkv/chat_format/grammar.py compiles, turnkv/engine/masks.py masks) on
``random:test`` through the scheduler: any schema within what the grammar library enforces yields
output that parses and validates (random weights, sampled: the grammar alone makes it valid),
masks stay on their own turn's row, ``logit_bias`` still applies under a grammar, a schema the
library cannot enforce is refused with the reason. No server: fast."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnkv.chat_format.grammar import GrammarError, Grammars, Matcher, ToolCallShape
from turnkv.chat_format.toolcalls import HERMES, parse
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler, run_turn
from turnkv.runtime import load_engine, new_bank


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", prefill_chunk=64))


@pytest.fixture(scope="module")
def grammars(engine) -> Grammars:
    return Grammars(engine.tokenizer, engine.loaded.config.vocab_size)


def answer(engine, grammar, params: SamplingParams, max_tokens: int = 400, prompt: str = "Answer in JSON."):
    """The text and finish reason of one constrained turn."""
    req = TurnRequest(engine.tokenizer.encode(prompt), params, max_tokens=max_tokens, grammar=grammar)
    events = [
        e
        for e in run_turn(Scheduler(engine, new_bank(engine), max_running=1), req)
        if isinstance(e, GenEvent)
    ]
    return "".join(e.text for e in events), events[-1].finish_reason


# Schemas whose every output is bounded (so random weights end within max_tokens): strings with a
# maxLength or a pattern, integers with bounds, enums, small arrays, objects of declared properties.
leaf = st.one_of(
    st.integers(0, 6).flatmap(
        lambda hi: st.builds(
            lambda lo: {"type": "string", "minLength": lo, "maxLength": hi}, st.integers(0, hi)
        )
    ),
    st.just({"type": "string", "pattern": "^[a-z]{1,4}$"}),
    st.tuples(st.integers(-50, 50), st.integers(0, 99)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", 7, None, 'a"b']), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}
    ),
    st.just({"const": "fixed"}),
    st.just({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}]}),
)


def _object(children):
    props = st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), children, min_size=1, max_size=3)
    return props.flatmap(
        lambda p: st.sets(st.sampled_from(sorted(p))).map(
            lambda req: {
                "type": "object",
                "properties": p,
                "required": sorted(req),
                "additionalProperties": False,
            }
        )
    )


def _array(children):
    return st.tuples(children, st.integers(0, 3), st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": min(t[1], t[2]), "maxItems": max(t[1], t[2])}
    )


schemas = st.recursive(leaf, lambda inner: _object(inner) | _array(inner), max_leaves=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**32 - 1))
def test_any_supported_schema_gives_valid_json(engine, grammars, schema, seed):
    text, finish = answer(engine, grammars.json_schema(schema), SamplingParams(temperature=1.0, seed=seed))
    assert finish == "stop", (schema, text)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_gives_an_object(engine, grammars):
    ended = 0
    for seed in range(4):
        text, finish = answer(engine, grammars.json_object(), SamplingParams(temperature=1.0, seed=seed), 200)
        if finish == "stop":  # random weights can write a long string: cut by length it is a prefix
            assert isinstance(json.loads(text), dict)
            ended += 1
    assert ended


def test_a_grammar_ends_the_answer_even_under_ignore_eos(engine, grammars):
    g = grammars.json_schema({"enum": ["yes", "no"]})
    text, finish = answer(engine, g, SamplingParams(temperature=0.0, ignore_eos=True), 50)
    assert (finish, json.loads(text) in ("yes", "no")) == ("stop", True)


def test_logit_bias_applies_inside_the_grammar(engine, grammars):
    g = grammars.json_schema({"enum": ["yes", "no"]})
    for letter, want in (("y", "yes"), ("n", "no")):
        bias = ((ord(letter), 100.0), (ord("x"), 100.0))  # "x" is outside the grammar: stays banned
        text, finish = answer(engine, g, SamplingParams(temperature=0.0, logit_bias=bias))
        assert (json.loads(text), finish) == (want, "stop")


def test_masks_touch_only_their_own_turn(engine, grammars):
    """A constrained turn in the same steps as free ones: the free ones answer token for token as
    they do alone (greedy), and the constrained one still validates."""
    tok = engine.tokenizer
    prompts = ["one two three", "four five"]
    alone = [answer(engine, None, SamplingParams(temperature=0.0), 24, p)[0] for p in prompts]
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a"],
        "additionalProperties": False,  # else random weights add properties of their own
    }
    sched = Scheduler(engine, new_bank(engine), max_running=4)
    texts: dict[int, list[str]] = {0: [], 1: [], 2: [], 3: []}
    sched.submit(  # constrained rows first and last in the step: masks are matched to their rows
        TurnRequest(
            tok.encode("{"), SamplingParams(temperature=1.0, seed=3), 40, grammar=grammars.json_object()
        ),
        _collect(texts[3]),
    )
    for i, p in enumerate(prompts):
        sched.submit(TurnRequest(tok.encode(p), SamplingParams(temperature=0.0), 24), _collect(texts[i]))
    sched.submit(
        TurnRequest(
            tok.encode("json"), SamplingParams(temperature=0.0), 40, grammar=grammars.json_schema(schema)
        ),
        _collect(texts[2]),
    )
    while sched.busy:
        sched.step()
    assert ["".join(texts[0]), "".join(texts[1])] == alone
    jsonschema.validate(json.loads("".join(texts[2])), schema)
    assert isinstance(json.loads("".join(texts[3])), dict)
    assert sched.pipeline.masks.rows >= 10  # the constrained turns' rows went through the step's masks


def test_masks_filled_ahead_equal_masks_filled_in_the_step(engine, grammars, monkeypatch):
    """``StepMasks.start`` fills the next step's masks on a thread while the turns take their
    tokens: six constrained turns (greedy and seeded, answers ending at different steps, so the
    next step masks a subset of what was filled) and a free one answer token for token as with
    every mask filled in the step, and most rows were filled ahead."""
    tok = engine.tokenizer
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9999},
            "s": {"type": "string", "maxLength": 12},
        },
        "required": ["n", "s"],
        "additionalProperties": False,
    }

    def run(prefetch: bool) -> tuple[list[str], int, int]:
        sched = Scheduler(engine, new_bank(engine), max_running=8)
        monkeypatch.setattr(sched.pipeline.masks, "prefetch", prefetch)
        texts: list[list[str]] = [[] for _ in range(7)]
        for i in range(6):
            params = SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0, seed=i)
            g = grammars.json_schema(schema) if i % 3 else grammars.json_object()
            sched.submit(
                TurnRequest(tok.encode(f"record {i}"), params, 10 + 9 * i, grammar=g), _collect(texts[i])
            )
        sched.submit(TurnRequest(tok.encode("free"), SamplingParams(temperature=0.0), 30), _collect(texts[6]))
        while sched.busy:
            sched.step()
        return ["".join(t) for t in texts], sched.pipeline.masks.rows, sched.pipeline.masks.prefetched

    off, rows_off, ahead_off = run(False)
    on, rows_on, ahead_on = run(True)
    assert on == off and rows_on == rows_off and ahead_off == 0
    assert ahead_on >= rows_on // 2, (ahead_on, rows_on)  # all but each turn's first token, mostly


def _collect(into: list[str]):
    return lambda ev: into.append(ev.text) if isinstance(ev, GenEvent) else None


def test_a_forced_tool_call_parses(engine, grammars):
    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 5}},
        "required": ["city"],
        "additionalProperties": False,
    }
    shapes = [
        ToolCallShape(HERMES.header.format(name=n), params, HERMES.close) for n in ("get_weather", "get_time")
    ]
    for seed in range(3):
        grammar = grammars.tool_calls(shapes, HERMES.separator, max_calls=3)
        text, finish = answer(engine, grammar, SamplingParams(temperature=1.0, seed=seed))
        content, calls = parse(HERMES, text)
        assert finish == "stop" and content == "" and 1 <= len(calls) <= 3
        for call in calls:
            assert call.name in ("get_weather", "get_time")
            jsonschema.validate(json.loads(call.arguments), params)


def allowed(con: Matcher, vocab: int) -> set[int]:
    """The tokens ``con``'s grammar allows next."""
    words = (vocab + 31) // 32
    mask = torch.zeros(words, dtype=torch.int32)
    con.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


@pytest.mark.parametrize("most", [1, 3])
def test_a_forced_call_grammar_ends_the_turn_after_its_calls(engine, grammars, most):
    """The end of the turn is allowed right after every complete call; after ``max_calls`` calls it
    is the only token allowed, and another call is refused."""
    tok, vocab = engine.tokenizer, engine.loaded.config.vocab_size
    eos = tok.eos_token_ids
    params = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    shape = ToolCallShape(HERMES.header.format(name="f"), params, HERMES.close)
    grammar = grammars.tool_calls([shape], HERMES.separator, max_calls=most)
    call = tok.encode(HERMES.header.format(name="f") + '{"a": 1}' + HERMES.close)
    sep, opener = tok.encode(HERMES.separator), tok.encode(HERMES.open)
    for calls in range(1, most + 1):  # a turn of 1..most calls, then its end
        con = grammar.start()
        for n in range(1, calls + 1):
            for t in (sep if n > 1 else []) + call:
                con.accept(t)
            after = allowed(con, vocab)
            assert eos <= after and (after == eos) == (n == most), (n, after)
        con.accept(min(eos))
        assert con.done
    con = grammar.start()
    for t in call + (sep + call) * (most - 1):
        con.accept(t)
    with pytest.raises(RuntimeError, match="refused"):
        for t in sep + opener:  # one more call
            con.accept(t)


def test_several_calls_need_a_separator(grammars):
    shape = ToolCallShape(HERMES.header.format(name="f"), None, HERMES.close)
    assert grammars.tool_calls([shape], None, max_calls=1)
    with pytest.raises(ValueError, match="separator"):
        grammars.tool_calls([shape], None, max_calls=2)


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
        ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "Unimplemented keys"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, '["uniqueItems"]'),
        ({"type": "string", "pattern": "^a(?=b)"}, "look-around"),
        ({"type": "strin"}, "Invalid type: strin"),
        ({"type": "string", "pattern": "(("}, "unclosed group"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) is greater than maximum (1)"),
        ({"$ref": "#/nope"}, "'/nope' does not exist"),
    ],
)
def test_a_schema_the_library_cannot_enforce_is_refused_with_the_reason(grammars, schema, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        grammars.json_schema(schema)


@pytest.fixture(scope="module")
def smol_tokenizer(tmp_path_factory):
    from turnkv.models import gguf
    from turnkv.models.load import default_model_path, file_fingerprint

    mp = pytest.MonkeyPatch()
    mp.setenv("TURNKV_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    path = default_model_path()
    tok = gguf.cached_header(path, file_fingerprint(path))[1]
    mp.undo()
    return tok


# strings bounded at every length around the slices' steps (2, 4, 8, 10, 16, 30), and unbounded
bounded = st.tuples(st.integers(0, 40), st.integers(0, 12)).map(
    lambda t: {"type": "string", "maxLength": t[0], "minLength": min(t[1], t[0])}
)
slice_schemas = st.recursive(
    bounded | st.just({"type": "string"}) | leaf, lambda inner: _object(inner), max_leaves=4
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=slice_schemas, seed=st.integers(0, 2**32 - 1))
def test_the_finer_slices_give_the_masks_of_a_plain_trie_walk(smol_tokenizer, schema, seed):
    """``SLICES`` only speed llguidance's masks up: along a walk through a schema (the default
    model's 49152 tokens; a random allowed token at each step), every mask equals the one computed
    with no slices at all (each token checked against the grammar) and with llguidance's defaults."""
    import random

    import llguidance

    from turnkv.chat_format.grammar import SLICES

    vocab = smol_tokenizer.vocab_size
    ll = Grammars(smol_tokenizer, vocab).ll_tokenizer()
    source = llguidance.LLMatcher.grammar_from_json_schema(schema)
    sliced = [ll.with_slices(s) for s in (SLICES, [], llguidance.LLTokenizer.general_slices())]
    matchers = [llguidance.LLMatcher(t, source, log_level=0) for t in sliced]
    words = (vocab + 31) // 32
    rng = random.Random(seed)
    for _ in range(60):
        masks = torch.zeros(len(matchers), words, dtype=torch.int32)
        for m, row in zip(matchers, masks, strict=True):
            m.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
        assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
        bits = (masks[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[:vocab].nonzero().flatten().tolist()
        if not allowed or matchers[0].is_stopped():
            break
        token = rng.choice(allowed)
        assert all(m.consume_token(token) for m in matchers)


UNION = {  # 150 objects whose properties may all come first: llguidance's row of them is 2850 items
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}, "o1": {"type": "integer"}, "o2": {}}}
        for i in range(150)
    ]
}


@pytest.mark.parametrize(
    "schema, words",
    [
        (
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            "#: every value it admits is infinite",
        ),
        ({"$ref": "#"}, "#: every value it admits is infinite"),
        (
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
            "#: every value it admits is infinite",
        ),
        ({"type": "object", "x-guidance": {"whitespace_flexible": True}}, "#: x-guidance"),
        ({"type": "string", "pattern": "^(([a-z]{1,20}){1,20}){1,20}$"}, "repeats up to 8000 characters"),
        (UNION, "the grammar library cannot follow it: Parser Error: Current row has"),
        (
            {"type": "object", "properties": {"a": {"type": "string"}, "b": UNION}, "required": ["a", "b"]},
            "#/properties/b: the grammar library cannot follow it: Parser Error: Current row has",
        ),
        (
            {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}},
            "cannot follow it: Parser Error: Current row has",
        ),
    ],
)
def test_a_schema_that_would_fail_mid_turn_is_refused_when_compiled(grammars, schema, words):
    """Each of these compiles in llguidance and then fails at the first token (500), answers ''
    (the empty grammar), or lets the client's layout override the canonical one."""
    with pytest.raises(GrammarError, match=re.escape(words)):
        grammars.json_schema(schema)


def test_a_grammar_with_no_value_is_refused_when_compiled(grammars):
    import llguidance

    from turnkv.chat_format.grammar_probe import token_lengths, walk_start

    ll = grammars.ll_tokenizer()
    lengths = token_lengths(ll, grammars.vocab_size, grammars.tokenizer.eos_token_ids)
    for lark, why in (('start: ""', "nothing but an empty answer"), ('start: a\na: a "x"', "no first token")):
        matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        assert not matcher.is_error()  # llguidance itself accepts both
        assert why in (walk_start(matcher, lengths) or ""), lark
    ok = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark('start: "x"*'), log_level=0)
    assert walk_start(ok, lengths) is None  # empty or x...: it has values


LINKED = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["v", "next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}


def test_recursive_schemas_with_a_way_out_still_answer_valid_json(engine, grammars):
    eos = tuple((t, 100.0) for t in sorted(engine.tokenizer.eos_token_ids))  # end once it may
    ended = 0
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, logit_bias=eos)
        text, finish = answer(engine, grammars.json_schema(LINKED), params, 300)
        if finish == "stop":
            jsonschema.validate(json.loads(text), LINKED)
            ended += 1
    assert ended


def test_a_forced_call_grammar_names_the_call_whose_parameters_are_refused(grammars):
    good = ToolCallShape(HERMES.header.format(name="f"), {"type": "object"}, HERMES.close)
    bad = ToolCallShape(HERMES.header.format(name="g"), {"$ref": "#"}, HERMES.close)
    with pytest.raises(GrammarError, match="infinite") as e:
        grammars.tool_calls([good, bad], HERMES.separator, 2)
    assert e.value.call == 1

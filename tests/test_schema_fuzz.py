"""Hostile JSON schemas and tool-call histories through a real server (issue 36; hypothesis).

Schemas: recursive ``$ref`` (to the root, through definitions, in cycles, behind required
properties and ``minItems``), references that do not resolve, deep nesting, odd and contradictory
types, absurd bounds, huge enums and unions, patterns llguidance refuses or that explode, long
literals, a client's ``x-guidance``; as ``response_format`` on both routes and as a forced call's
``parameters``. Histories: earlier calls whose ``arguments`` nest deep, are not JSON, are JSON but
not an object, are not a string at all, with odd names, ids and roles around them.

Every answer is a 4xx in the OpenAI shape naming its field, or a 200 whose JSON, when the answer
ended by itself, parses and is valid against the schema; never a 5xx. The model has random weights
(tests/tool_models.py) so a turn costs milliseconds; the end of the turn is favoured so answers
end as soon as the grammar allows. The counts are printed at the end (``-s``; docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_server import Live
from tool_models import tool_model

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
COUNTS: Counter[str] = Counter()

NUMBERS = [0, 1, -1, 3, 64, 10**6, 10**9, 2**31, 2**63, 2**64, 10**30, 0.5, -0.0, 1e308, 1e-300]
PATTERNS = [
    "^[a-z]{1,4}$",
    r"^\d{3}$",
    "((",  # unclosed: refused by llguidance
    "^a(?=b)",  # look-around
    r"^(a)\1$",  # a back-reference
    "^(a{1000}){1000}$",  # a lexer that runs out
    "^(([a-z]{1,20}){1,20}){1,20}$",
    "^a{100000}$",  # forced text re-tokenized every step
    r"^\p{L}{1,3}$",
    "",
    "[",
    "^(x+x+)+y$",
]
REFS = ["#", "#/$defs/a", "#/$defs/b", "#/$defs/missing", "#/properties/x", "#/definitions/a", "#a", ""]
REFS += ["http://example.com/s.json", "#/$defs/a/properties/x"]
TYPES = [
    "string",
    "integer",
    "number",
    "boolean",
    "null",
    "object",
    "array",
    "strin",
    ["string", "null"],
    [],
    5,
]
BOUNDS = ["minLength", "maxLength", "minimum", "maximum", "multipleOf", "minItems", "maxItems"]
BOUNDS += ["minProperties", "maxProperties", "exclusiveMinimum"]
NAMES = st.sampled_from(["x", "a", "b", "", "x-guidance", "$ref", "é"])

leaf = st.one_of(
    st.booleans(),
    st.just({}),
    st.builds(
        lambda t, b: {"type": t, **b},
        st.sampled_from(TYPES),
        st.fixed_dictionaries({}, optional=dict.fromkeys(BOUNDS, st.sampled_from(NUMBERS))),
    ),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
    st.builds(lambda r: {"$ref": r}, st.sampled_from(REFS)),
    st.sampled_from([0, 3, 2500, 30_000]).map(lambda n: {"enum": [f"v{i}" for i in range(n)]}),
    st.sampled_from(
        [
            {"const": "x" * 100},
            {"const": "y" * 50_000},
            {"const": {"a": [1]}},
            {"enum": [[1], {"a": 1}, None, 1.5]},
            {"not": {}},
            {"type": "string", "format": "date-time"},
            {"type": "string", "x-guidance": {"lenient": True}},
        ]
    ),
)


def _combine(inner):
    obj = st.builds(
        lambda props, req, extra: {"type": "object", "properties": props, "required": req, **extra},
        st.dictionaries(NAMES, inner, max_size=3),
        st.lists(NAMES, max_size=3, unique=True),
        st.fixed_dictionaries({}, optional={"additionalProperties": st.booleans() | inner}),
    )
    arr = st.builds(
        lambda items, least: {"type": "array", "items": items, "minItems": least},
        inner,
        st.sampled_from([0, 1, 2, 10**9]),
    )
    tup = st.builds(
        lambda pre, rest: {"type": "array", "prefixItems": pre, "items": rest},
        st.lists(inner, max_size=3),
        inner,
    )
    union = st.builds(
        lambda kw, subs: {kw: subs}, st.sampled_from(["anyOf", "oneOf", "allOf"]), st.lists(inner, max_size=4)
    )
    return obj | arr | tup | union


def _nested(levels: int, schema) -> dict:
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


core = st.recursive(leaf, _combine, max_leaves=8)
WIDE = {"type": "object", "properties": {"p": {"type": "integer"}, "q": {}}}
schemas = st.one_of(
    core,
    st.builds(  # definitions that refer to each other and to the root
        lambda defs, root: {**(root if isinstance(root, dict) else {"allOf": [root]}), "$defs": defs},
        st.fixed_dictionaries({"a": core, "b": core}),
        core,
    ),
    st.builds(_nested, st.sampled_from([10, 40, 70]), core),
    st.builds(
        lambda kw, n, sub: {kw: [sub] * n},
        st.sampled_from(["anyOf", "oneOf"]),
        st.sampled_from([150, 600]),
        leaf | st.just(WIDE),
    ),
).filter(lambda s: len(json.dumps(s)) < 900_000)

arguments = st.one_of(
    st.sampled_from([1, 64, 128, 129, 5000]).map(lambda n: "[" * n + "]" * n),
    st.sampled_from([1, 100, 129]).map(lambda n: '{"a": ' * n + "1" + "}" * n),
    st.text(max_size=40),  # mostly not JSON
    st.sampled_from(['{"tz": "UTC"}', "[1, 2]", "7", "null", '"s"', "{", "}", "[[[", '{"a": NaN}']),
    st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
    st.integers() | st.none() | st.booleans() | st.lists(st.integers(), max_size=3),  # not a string
)
call = st.fixed_dictionaries(
    {
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_time", "", "x" * 300, "é"]), "arguments": arguments}
        )
    },
    optional={
        "id": st.sampled_from(["call_0", "", None]),
        "type": st.sampled_from(["function"] * 3 + ["other"]),
    },
)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "tool_calls": st.lists(call, max_size=3)},
        optional={"content": st.sampled_from([None, "", "ok"])},
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": st.sampled_from(["12:00", ""])},
        optional={"tool_call_id": st.sampled_from(["call_0", "nope", None])},
    ),
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer"]), "content": st.just("hi")}
    ),
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC"]}}},
        },
    }
]


@pytest.fixture(scope="module")
def live():
    srv = Live(tool_model("qwen25"), no_disk=True)
    # end as soon as the grammar allows: the end of the turn, and (byte tokens) '"', ']' and '}'
    srv.end = {
        **{str(t): 100 for t in srv.engine.tokenizer.eos_token_ids},
        **dict.fromkeys(("34", "93", "125"), 10),
    }
    yield srv
    srv.close()
    print(
        f"\nschema and history fuzz: {COUNTS['cases']} requests, {COUNTS['4xx']} 4xx, {COUNTS['200']} 200 "
        f"({COUNTS['validated']} ended and validated), {COUNTS['5xx']} 5xx"
    )


def send(live, route: str, body: dict, what) -> dict | None:
    """POST; never a 5xx; a 4xx in the OpenAI shape; the 200 body, else None."""
    r = live.post(route, {"max_tokens": 32, "temperature": 1.0, "logit_bias": live.end, **body})
    COUNTS["cases"] += 1
    assert r.status_code < 500, (r.status_code, r.text[:400], json.dumps(what)[:600])
    if r.status_code != 200:
        COUNTS["4xx"] += 1
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", err
        return None
    COUNTS["200"] += 1
    return r.json()


def validate(text: str, schema) -> None:
    """``text`` is JSON valid against ``schema`` (where jsonschema itself can read the schema)."""
    value = json.loads(text)
    try:
        validator = jsonschema.Draft202012Validator(schema)
        validator.check_schema(schema)
        errors = list(validator.iter_errors(value))
    except (jsonschema.SchemaError, jsonschema.exceptions._RefResolutionError, ValueError, RecursionError):
        return
    assert not errors, (text, errors[0].message)
    COUNTS["validated"] += 1


# fixed examples in CI (derandomized); TURNKV_FUZZ_SCALE=10 explores ten times as many, new ones each run
SCALE = int(os.environ.get("TURNKV_FUZZ_SCALE", "1"))
FUZZ = settings(
    max_examples=60 * SCALE,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
    derandomize=SCALE == 1,
)


RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # the attack's


@FUZZ
@given(schema=schemas, seed=st.integers(0, 2**32 - 1), completion=st.booleans())
@example(schema=RECURSIVE, seed=0, completion=False)  # was: 500 at the first token
@example(schema={"$ref": "#"}, seed=0, completion=False)  # was: 200 with content ""
def test_hostile_schemas_are_4xx_or_valid_json(live, schema, seed, completion):
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    if completion:
        body = {"prompt": "JSON:", "response_format": rf, "seed": seed}
        route = COMPLETIONS
    else:
        body = {"messages": [{"role": "user", "content": "JSON"}], "response_format": rf, "seed": seed}
        route = CHAT
    reply = send(live, route, body, schema)
    if reply is None:
        return
    choice = reply["choices"][0]
    if choice["finish_reason"] == "stop":
        validate(choice["text"] if completion else choice["message"]["content"], schema)


@FUZZ
@given(schema=schemas, seed=st.integers(0, 2**32 - 1))
@example(schema=RECURSIVE, seed=0)
def test_hostile_forced_call_parameters_are_4xx_or_valid_calls(live, schema, seed):
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"messages": [{"role": "user", "content": "call"}], "tools": [tool], "tool_choice": "required"}
    reply = send(live, CHAT, {**body, "seed": seed, "parallel_tool_calls": False}, schema)
    if reply is None or reply["choices"][0]["finish_reason"] != "tool_calls":
        return
    for c in reply["choices"][0]["message"]["tool_calls"]:
        validate(
            c["function"]["arguments"], schema if isinstance(schema, dict) and schema else {"type": "object"}
        )


@settings(FUZZ, max_examples=80 * SCALE)
@given(
    history=st.lists(message, min_size=1, max_size=4),
    tools=st.booleans(),
    choice=st.sampled_from(["auto", "none", "required"]),
)
@example(  # was: 500, a RecursionError
    history=[
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_time", "arguments": "[" * 5000}}]}
    ],
    tools=True,
    choice="auto",
)
def test_hostile_tool_call_histories_are_4xx_or_answers(live, history, tools, choice):
    body = {"messages": [{"role": "user", "content": "hi"}, *history]}
    if tools:
        body.update(tools=TOOLS, tool_choice=choice)
    send(live, CHAT, {**body, "max_tokens": 8}, history)

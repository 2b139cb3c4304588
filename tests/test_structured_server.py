"""Structured output and tool calls through the real server and the official ``openai`` client:
the default model (JSON modes; its template has no tools: 400) and random-weight models with
tool templates (tests/tool_models.py): forced calls parse, streamed deltas rebuild the same calls,
an agent loop of 10 rounds restores all but the new tool result every round, errors are 400s."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from test_server import MODEL, Live
from tool_models import tool_model

from turnkv.chat_format.structured import FORCED_CALLS_MAX

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "rivers": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 2},
    },
    "required": ["name", "rivers"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather by city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["UTC", "CET"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def default_live(default_model):
    live = Live(default_model, no_disk=True)
    yield live
    live.close()


@pytest.fixture(scope="module", params=["qwen25", "llama31", "qwen3"])
def tool_live(request):
    live = Live(tool_model(request.param), no_disk=True)
    live.family = request.param
    yield live
    live.close()


def ask(live, messages, **kw):
    return live.client().chat.completions.create(
        model=live.engine.info.model_name, messages=messages, temperature=0, **kw
    )


def test_default_model_json_schema_and_json_object(default_live):
    c = default_live.client()
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON: its name and two rivers."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY, "strict": True},
        },
        max_tokens=64,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    r = c.completions.create(
        model=MODEL,
        prompt="France as a JSON object:",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut by max_tokens: what came is the start of an object
        assert r.choices[0].text.startswith("{")


def test_default_model_has_no_tool_template_so_tools_are_a_400(default_live):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    r = default_live.post("/v1/chat/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tools" and "no tool support" in err["message"]
    r = default_live.post("/v1/chat/completions", {**body, "tools": [], "max_tokens": 2})  # no tools: fine
    assert r.status_code == 200


def test_forced_calls_parse_and_validate(tool_live):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = ask(tool_live, msgs, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    r = ask(tool_live, msgs, tools=TOOLS, tool_choice=named, parallel_tool_calls=False, max_tokens=120)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), PARAMS["get_time"])
    # the round trip: the call and its result go back, and the model answers (auto: text or calls)
    msgs += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"},
    ]
    r = ask(tool_live, msgs, tools=TOOLS, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def no_end_of_turn(live) -> dict[str, int]:
    """A ``logit_bias`` that makes the model rather go on than end its turn (a model that repeats)."""
    return {str(t): -100 for t in live.engine.tokenizer.eos_token_ids}


@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_choice_is_one_call_that_ends_the_turn(tool_live, parallel):
    """Even a model that would repeat the call: the grammar allows nothing but the end of the turn
    after it, with or without ``parallel_tool_calls``."""
    named = {"type": "function", "function": {"name": "get_time"}}
    msgs = [{"role": "user", "content": "What time is it?"}]
    kw = {"tool_choice": named, "parallel_tool_calls": parallel, "logit_bias": no_end_of_turn(tool_live)}
    r = ask(tool_live, msgs, tools=TOOLS, max_tokens=400, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert [c.function.name for c in ch.message.tool_calls] == ["get_time"]
    assert r.usage.completion_tokens < 100  # one call and the end-of-turn token
    chunks = ask(tool_live, msgs, tools=TOOLS, stream=True, **kw)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_required_calls_are_bounded_and_end_the_turn(tool_live):
    """``required`` with parallel calls, from a model that would call forever: at most
    ``FORCED_CALLS_MAX`` calls, then the end of the turn (a family with one call per message: one)."""
    msgs = [{"role": "user", "content": "What time is it?"}]
    r = ask(
        tool_live,
        msgs,
        tools=TOOLS[1:],
        tool_choice="required",
        max_tokens=2000,
        logit_bias=no_end_of_turn(tool_live),
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", (ch.finish_reason, r.usage)
    assert len(ch.message.tool_calls) == (FORCED_CALLS_MAX if tool_live.family != "llama31" else 1)


def test_streamed_call_deltas_rebuild_the_non_streamed_calls(tool_live):
    msgs = [{"role": "user", "content": "Weather in Oslo for three days?"}]
    kw = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 160}
    whole = ask(tool_live, msgs, **kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(tool_live, msgs, stream=True, **kw):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in calls:  # the first chunk of a call: id, type, name, no arguments yet
                assert d.id.startswith("call_") and d.type == "function" and d.function.arguments == ""
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            else:  # then argument fragments only
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    want = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == want
    assert finish == whole.finish_reason


def test_an_agent_loop_restores_everything_but_the_new_tool_result(tool_live):
    """Ten rounds of call, result, resend: every round after the first reads from the bank all of
    the history, the previous calls included (also where the template re-renders a call once a
    tool message follows it: the qwen3 template's empty think block)."""
    tok = tool_live.engine.tokenizer
    msgs = [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "Plan a trip."}]
    cached = []
    for rnd in range(10):
        r = ask(
            tool_live,
            msgs,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            extra_body={"cache_salt": "agent-loop"},  # a namespace of its own: round 1 starts cold
        )
        usage = r.usage
        if rnd:
            result = msgs[-1]["content"]
            text = tok.render_chat(msgs, tools=TOOLS)
            after = text[text.rindex(result) :]  # the new result and the template's text after it
            assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens <= len(
                tok.encode(after)
            ), rnd
        cached.append(usage.prompt_tokens_details.cached_tokens)
        call = r.choices[0].message.tool_calls[0]
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"round": rnd})},
        ]
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached))


def test_json_modes_on_both_routes(tool_live):
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    r = ask(tool_live, [{"role": "user", "content": "JSON please"}], response_format=rf, max_tokens=80)
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    r = tool_live.client().completions.create(
        model=tool_live.engine.info.model_name,
        prompt="{",
        max_tokens=80,
        temperature=0,
        extra_body={"response_format": rf},
    )
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER)


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"functions": [{"name": "f"}]}, "functions", "send tools and tool_choice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not one of the tools",
        ),
        ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot both be enforced",
        ),
        (
            {
                "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
            },
            "tools",
            "Invalid type: strin",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools",
            "function names must match",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
            "response_format",
            'Unimplemented keys: ["not"]',
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", None),
    ],
)
def test_bad_tool_and_format_fields_are_400s_naming_the_field(tool_live, extra, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 4, **extra}
    r = tool_live.post("/v1/chat/completions", {k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param is None or (err["param"] or "").startswith(param), err
    assert words is None or words in err["message"], err


RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
UNION = {
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}, "o1": {"type": "integer"}, "o2": {}}}
        for i in range(150)
    ]
}


def call_history(arguments) -> list[dict]:
    """A user turn, an assistant call with ``arguments``, its result, and the next question."""
    call = {"id": "call_0", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    return [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "12:00"},
        {"role": "user", "content": "And now?"},
    ]


@pytest.mark.parametrize(
    "schema, words",
    [
        (RECURSIVE, "every value it admits is infinite"),  # was: 500 at the first token
        ({"$ref": "#"}, "every value it admits is infinite"),  # was: 200 with content ""
        (CYCLE, "every value it admits is infinite"),
        ({"type": "object", "x-guidance": {"whitespace_flexible": True}}, "x-guidance"),  # was: honoured
        (UNION, "Current row has"),  # was: 500 at the first token
        ({"type": "string", "pattern": "^(([a-z]{1,20}){1,20}){1,20}$"}, "repeats up to 8000"),
    ],
)
def test_hostile_schemas_are_400s_naming_the_schema_before_the_turn(default_live, schema, words):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for route, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "JSON"}], "response_format": rf}),
        ("/v1/completions", {"prompt": "JSON:", "response_format": rf}),
    ):
        r = default_live.post(route, {"model": MODEL, "max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format.json_schema.schema" and words in err["message"], err


def test_history_arguments_nested_too_deep_are_a_400_naming_them(default_live):
    """5000 levels was a RecursionError (500) rendering the history; the default model's template
    has no tools, but its requests' history is still read."""
    for arguments in ("[" * 5000 + "]" * 5000, "[" * 200):
        body = {"model": MODEL, "messages": call_history(arguments), "max_tokens": 2}
        r = default_live.post("/v1/chat/completions", body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages[1].tool_calls[0].function.arguments", err
        assert "nest" in err["message"] and "at most 128" in err["message"], err


@pytest.mark.parametrize("arguments", ['{"tz": "UTC"', "[1, 2]", "7", "null", '"a string"', {"tz": "UTC"}])
def test_history_arguments_that_are_not_an_object_still_render(tool_live, arguments):
    """The template gets the text when it is not JSON, the value when it is (any JSON value)."""
    body = {"messages": call_history(arguments), "tools": TOOLS, "max_tokens": 4, "temperature": 0}
    r = tool_live.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text


def test_a_forced_calls_parameters_are_checked_as_a_response_format_is(tool_live):
    bad = {"type": "function", "function": {"name": "loop", "parameters": RECURSIVE}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [*TOOLS, bad], "max_tokens": 8}
    r = tool_live.post("/v1/chat/completions", {**body, "tool_choice": "required"})  # was: 500
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[2].function.parameters" and "infinite" in err["message"], err
    named = {"type": "function", "function": {"name": "loop"}}
    r = tool_live.post("/v1/chat/completions", {**body, "tool_choice": named})
    assert r.json()["error"]["param"] == "tools[2].function.parameters", r.text
    r = tool_live.post("/v1/chat/completions", {**body, "tool_choice": "auto"})  # not enforced: rendered
    assert r.status_code == 200, r.text

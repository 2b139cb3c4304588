"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the real
server and the official ``anthropic`` SDK: the default model for text (its answer equals the chat
route's, whole and streamed), a random-weight model with a tool template (tests/tool_models.py)
for ``tool_use`` / ``tool_result`` turns; usage and prefix reuse across turns, Claude Code's
billing line kept out of the prompt, errors of every field in Anthropic's shape. Greedy, short
answers."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from test_server import MODEL, Live
from test_structured_server import WEATHER
from tool_models import tool_model

from turnkv.server.messages_schema import Conversation, MessagesRequest
from turnkv.server.schemas import parse_body

pytestmark = pytest.mark.slow

KEY = "sk-test-messages"
SYSTEM = "You are a terse assistant."
USER = [{"role": "user", "content": "Name a colour of the sky."}]
BILLING = "x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch={};"
TOOLS = [{"name": "get_weather", "description": "Weather by city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def live(default_model):
    srv = Live(default_model, no_disk=True)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def tool_live():
    srv = Live(tool_model("qwen25"), no_disk=True)
    yield srv
    srv.close()


def client(srv: Live, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120)


GREEDY = {"temperature": 0}  # the SDK (2.x) has no sampling arguments: sent as extra fields


def ask(srv: Live, messages: list[dict], max_tokens: int = 12, salt: str | None = None, **kw):
    extra = {**GREEDY, **({"cache_salt": salt} if salt else {})}
    return client(srv).messages.create(
        model=srv.engine.info.model_name, messages=messages, max_tokens=max_tokens, extra_body=extra, **kw
    )


def prompt_of(m: anthropic.types.Message) -> int:
    u = m.usage
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_create_answers_what_the_chat_route_answers(live):
    m = ask(live, USER, system=SYSTEM, max_tokens=10)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.stop_sequence is None
    chat = live.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *USER],
        max_tokens=10,
        temperature=0,
    )
    assert m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert prompt_of(m) == chat.usage.prompt_tokens and m.usage.cache_creation_input_tokens == 0
    n = client(live).messages.count_tokens(model=MODEL, messages=USER, system=SYSTEM)
    assert n.input_tokens == prompt_of(m)


def test_stream_events_rebuild_the_whole_answer(live):
    whole = ask(live, USER, system=SYSTEM, max_tokens=10)
    kinds, text = [], ""
    with client(live).messages.stream(
        model=MODEL, messages=USER, system=SYSTEM, max_tokens=10, extra_body=GREEDY
    ) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "content_block_delta":
                assert ev.delta.type == "text_delta" and ev.index == 0
                text += ev.delta.text
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_of(final) == prompt_of(whole)
    # the wire: event lines, a ping after message_start
    r = live.post(
        "/v1/messages",
        {"model": MODEL, "messages": USER, "max_tokens": 3, "stream": True, "temperature": 0},
    )
    events = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[:2] == ["message_start", "ping"] and events[-1] == "message_stop"


def test_stop_sequences_end_the_answer_and_are_named(live):
    text = ask(live, USER, system=SYSTEM, max_tokens=10).content[0].text
    stop = text.split()[1]  # a word the greedy answer writes
    m = ask(live, USER, system=SYSTEM, max_tokens=10, stop_sequences=["@@never@@", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text.startswith(m.content[0].text) and stop not in m.content[0].text
    with client(live).messages.stream(
        model=MODEL, messages=USER, system=SYSTEM, max_tokens=10, extra_body=GREEDY, stop_sequences=[stop]
    ) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == (
        "stop_sequence",
        stop,
        m.content[0].text,
    )


def test_a_conversation_reuses_its_prefix(live):
    msgs = [{"role": "user", "content": "Count to three."}]
    first = ask(live, msgs, system=SYSTEM, metadata={"user_id": "u1"}, salt="conv")
    assert first.usage.cache_read_input_tokens == 0
    msgs += [
        {"role": "assistant", "content": [{"type": "text", "text": first.content[0].text}]},
        {"role": "user", "content": [{"type": "text", "text": "Now backwards."}]},
    ]
    second = ask(live, msgs, system=[{"type": "text", "text": SYSTEM}], salt="conv")
    assert second.usage.cache_read_input_tokens >= prompt_of(first)  # the whole first turn and its answer


def billing_pair(srv: Live) -> tuple[anthropic.types.Message, anthropic.types.Message]:
    """Two requests that differ only in Claude Code's per-request billing line."""
    out = []
    for cch in ("36ee5", "0aaa9"):
        system = [{"type": "text", "text": BILLING.format(cch)}, {"type": "text", "text": SYSTEM}]
        out.append(ask(srv, USER, system=system, max_tokens=2, salt="billing"))
    return out[0], out[1]


def test_the_billing_line_is_kept_out_of_the_prompt(live, default_model):
    a, b = billing_pair(live)
    assert b.usage.cache_read_input_tokens == prompt_of(b) - 1  # all but the row that gives the logits
    plain = client(live).messages.count_tokens(model=MODEL, messages=USER, system=SYSTEM)
    assert prompt_of(a) == plain.input_tokens  # the line is not in the prompt at all
    kept = Live(default_model, no_disk=True, strip_billing_header=False)
    try:
        a, b = billing_pair(kept)
        line = prompt_of(b) - plain.input_tokens  # the tokens the line adds
        assert line > 0 and b.usage.cache_read_input_tokens < line  # the reuse ends inside it
    finally:
        kept.close()


# -- tools ----------------------------------------------------------------------------------------


def test_tool_use_then_tool_result(tool_live):
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    one = {"type": "any", "disable_parallel_tool_use": True}
    m = ask(tool_live, msgs, max_tokens=120, tools=TOOLS, tool_choice=one)
    assert m.stop_reason == "tool_use"
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) >= 1 and calls[0].id.startswith("toolu_") and calls[0].name == "get_weather"
    jsonschema.validate(calls[0].input, WEATHER)
    n = client(tool_live).messages.count_tokens(
        model=tool_live.engine.info.model_name, messages=msgs, tools=TOOLS
    )
    assert n.input_tokens == prompt_of(m)  # the tools are rendered into the prompt it counts
    with client(tool_live).messages.stream(
        model=tool_live.engine.info.model_name,
        messages=msgs,
        max_tokens=120,
        extra_body=GREEDY,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ) as s:
        deltas = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert "input_json_delta" in deltas and streamed.stop_reason == "tool_use"
    (call,) = [b for b in streamed.content if b.type == "tool_use"]
    assert call.input == calls[0].input  # greedy: the same call, rebuilt from its JSON pieces
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in streamed.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": [{"type": "text", "text": "sunny"}],
                }
            ],
        },
    ]
    after = ask(tool_live, msgs, max_tokens=16, tools=TOOLS)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert after.usage.cache_read_input_tokens >= prompt_of(
        streamed
    )  # the call turn, as the template renders it


LONG_SYSTEM = " ".join(
    f"Rule {i}: answer with one tool call when a tool fits the request." for i in range(36)
)


def test_a_tool_loop_reads_95_percent_of_its_prompt_from_the_cache(tool_live):
    msgs = [{"role": "user", "content": "Plan a week of trips."}]
    shares = []
    for rnd in range(5):
        m = ask(
            tool_live,
            msgs,
            max_tokens=100,
            system=LONG_SYSTEM,
            tools=TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            salt="tool-loop",
        )
        shares.append(m.usage.cache_read_input_tokens / prompt_of(m))
        call = next(b for b in m.content if b.type == "tool_use")
        msgs += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps({"day": rnd})}
                ],
            },
        ]
    assert shares[0] == 0 and min(shares[1:]) >= 0.95, shares


def test_a_call_cut_by_max_tokens_and_sent_back_as_received_breaks_no_cache(tool_live):
    """A ``tool_use`` cut by ``max_tokens`` has arguments that are no JSON: its ``input`` is their
    partial parse (what the SDK's stream builds, non-streamed the same), and the next turn, which
    sends that ``input`` back, reuses everything banked (the bank holds the call as sent back)."""
    msgs = [{"role": "user", "content": "Weather in Bergen today?"}]  # no other test's conversation
    one = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    kw = {"model": tool_live.engine.info.model_name, "messages": msgs, "tools": TOOLS, "tool_choice": one}
    whole = ask(tool_live, msgs, max_tokens=120, tools=TOOLS, tool_choice=one, salt="cut-whole")
    assert whole.stop_reason == "tool_use"
    cut = whole.usage.output_tokens - 16  # inside the arguments: the call's tail is 14 bytes or more
    answers = {
        "create": ask(tool_live, msgs, max_tokens=cut, tools=TOOLS, tool_choice=one, salt="cut-create")
    }
    with client(tool_live).messages.stream(
        **kw, max_tokens=cut, extra_body={**GREEDY, "cache_salt": "cut-stream"}
    ) as s:
        raw = "".join(
            ev.delta.partial_json
            for ev in s
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta"
        )
        answers["stream"] = s.get_final_message()
    with pytest.raises(ValueError):
        json.loads(raw)  # the premise: the arguments were cut
    inputs = [next(b for b in m.content if b.type == "tool_use").input for m in answers.values()]
    assert inputs[0] == inputs[1]  # non-streamed, the partial parse the SDK's stream builds
    for (mode, m), result in zip(answers.items(), ("rain", "snow"), strict=True):  # apart from the 1st byte
        assert m.stop_reason == "max_tokens", mode
        call = next(b for b in m.content if b.type == "tool_use")
        turn = [
            *msgs,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]},
        ]
        after = ask(tool_live, turn, max_tokens=2, tools=TOOLS, salt=f"cut-{mode}")
        brk = after.usage.model_extra["cache_break"]
        assert brk["reason"] == "none", (mode, brk)
        assert after.usage.cache_read_input_tokens >= prompt_of(m), mode


# -- keys and errors ------------------------------------------------------------------------------


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def ask_keyed(srv: Live, key: str) -> anthropic.types.Message:
    return client(srv, key).messages.create(model=MODEL, messages=USER, max_tokens=2, extra_body=GREEDY)


def test_x_api_key_is_the_key(default_model):
    srv = Live(default_model, no_disk=True, api_key=[KEY])
    try:
        assert ask_keyed(srv, KEY).content
        with pytest.raises(anthropic.AuthenticationError):
            ask_keyed(srv, "wrong")
        r = srv.post("/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 2})
        assert "--api-key" in anthropic_error(r, 401, "authentication_error")
        r = srv.post(
            "/v1/messages/count_tokens",
            {"model": MODEL, "messages": USER},
            headers={"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"},
        )
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
    finally:
        srv.close()


GOOD = {"model": MODEL, "messages": USER, "max_tokens": 4}
BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}
            ]
        },
        "assistant",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
        "tool_use_id",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}
            ]
        },
        "content[0].tool_use.input: Input should be an object",
    ),
    ({"system": 3}, "system"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"stream": "yes"}, "stream"),
    ({"metadata": {"user_id": 5}}, "metadata"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tool names"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tool_choice": {"type": "tool"}}, "name"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "no tool support"),  # the default model
]


@pytest.mark.parametrize(("change", "words"), BAD, ids=[w for _, w in BAD])
def test_bad_bodies_are_400s_in_anthropics_shape(live, change, words):
    body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    message = anthropic_error(live.post("/v1/messages", body), 400, "invalid_request_error")
    assert words in message, message


def test_other_errors_in_anthropics_shape(live):
    with pytest.raises(anthropic.NotFoundError):
        client(live).messages.create(model="claude-sonnet-4-5", messages=USER, max_tokens=2)
    anthropic_error(live.post("/v1/messages", b"{not json"), 400, "invalid_request_error")
    anthropic_error(live.post("/v1/messages", b""), 400, "invalid_request_error")
    r = live.post("/v1/messages", json.dumps(GOOD), headers={"content-type": "text/plain"})
    anthropic_error(r, 415, "invalid_request_error")
    big = {**GOOD, "system": "x" * (live.server.max_body_bytes + 1)}
    anthropic_error(live.post("/v1/messages", big), 413, "request_too_large")
    r = live.post("/v1/messages/count_tokens", {"model": MODEL})
    assert "messages" in anthropic_error(r, 400, "invalid_request_error")
    too_long = {**GOOD, "max_tokens": live.engine.max_context + 1}
    anthropic_error(live.post("/v1/messages", too_long), 400, "invalid_request_error")
    metrics = httpx.get(live.url + "/metrics", timeout=30).text
    assert 'route="/v1/messages",status="400"' in metrics


def test_kv_memory_exhausted_stays_507_in_anthropics_shape(default_model):
    srv = Live(default_model, no_disk=True, bank_bytes="8M")
    try:
        big = [{"role": "user", "content": "Summarise: " + "river stone lantern " * 200}]
        for stream in (False, True):
            r = srv.post("/v1/messages", {"model": MODEL, "messages": big, "max_tokens": 8, "stream": stream})
            anthropic_error(r, 507, "api_error")
            err = r.json()["error"]
            assert err["needed_bytes"] > err["available_bytes"] >= 0 and "--bank-bytes" in err["message"]
        with pytest.raises(anthropic.APIStatusError) as exc:
            client(srv).messages.create(model=MODEL, messages=big, max_tokens=8)
        assert exc.value.status_code == 507
        assert ask(srv, USER, max_tokens=2).content  # the server goes on serving
    finally:
        srv.close()


def test_the_adapter_renders_blocks_as_the_chat_template_takes_them():
    """No server: a body's template messages (billing lines out, thinking left out, results as
    tool messages named by their call, text after them as a user message)."""
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "system": BILLING.format("12345") + "\nYou are terse.",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny", "is_error": False},
                    {"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
    }
    req = parse_body(MessagesRequest, json.dumps(body).encode())
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    assert Conversation(req, strip=True).template_messages() == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny", "name": "get_weather"},
        {"role": "user", "content": "Thanks."},
    ]
    assert Conversation(req, strip=False).template_messages()[0]["content"] == body["system"]

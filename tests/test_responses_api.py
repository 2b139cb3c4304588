"""The Responses API (``/v1/responses``) through a live server and the official ``openai`` SDK.

The oracle is chat completions: a response answers as the chat request of the same messages does
(greedy, same prompt ids), and a ``previous_response_id`` chain answers as the chat request of the
whole conversation, while reading the previous prompt and answer from the bank. Tools run on a
random-weight model with a tool template (tests/tool_models.py)."""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest
from test_server import MODEL, Live
from tool_models import tool_model

from turnkv.bank.disk_blocks import BLOCK_TOKENS as B

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
FACTS = " ".join(f"Fact {i}: river {i} flows into lake {i * 7 % 13}." for i in range(30)) + " Which lake?"
TOOL_MODEL = "random:qwen25"
AGENT = "You are an agent that plans trips. Call a tool for every fact you need. " * 20  # ~1.5k tokens
TOOL = {"type": "function", "name": "get_weather", "description": "Weather by city", "parameters": WEATHER}


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


def respond(client: openai.OpenAI, **kw):
    return client.responses.create(**{"model": MODEL, "max_output_tokens": 12, "temperature": 0, **kw})


def chat(client: openai.OpenAI, messages: list[dict]):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)


def same_as_chat(r, c) -> None:
    """A response answered as the chat completion ``c`` of the same conversation."""
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens


def test_string_input_items_and_instructions_answer_as_chat(live):
    client = live.client()
    r = respond(client, input="Name a color.")
    same_as_chat(r, chat(client, [{"role": "user", "content": "Name a color."}]))
    assert (
        r.object == "response"
        and r.status == "incomplete"
        and r.incomplete_details.reason == "max_output_tokens"
    )
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"

    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"role": "user", "content": "Another one."},
    ]
    r = respond(client, input=items, instructions="Answer in one word.")
    want = chat(
        client,
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one."},
        ],
    )
    same_as_chat(r, want)


def test_the_stream_builds_the_same_text_with_numbered_events(live):
    client = live.client()
    whole = respond(client, input="Say something kind.")
    with client.responses.stream(
        model=MODEL, input="Say something kind.", max_output_tokens=12, temperature=0
    ) as s:
        events = list(s)
    types = [e.type for e in events]
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == deltas  # a streamed response is stored too


def test_a_chain_reads_the_previous_prompt_and_answer_from_the_bank(live):
    client = live.client()
    first = respond(client, input="Count to three.", extra_body={"metadata": {"t": "chain"}})
    second = respond(client, input="Now to four.", previous_response_id=first.id)
    held = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= held
    convo = [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Now to four."},
    ]
    same_as_chat(second, chat(client, convo))
    third = respond(client, input="And five.", previous_response_id=second.id)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.total_tokens
    convo += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "And five."}]
    same_as_chat(third, chat(client, convo))


def test_a_chain_made_on_one_server_continues_on_another_over_one_redis(default_model, live):
    """Replicas over ``--disk-store redis://``: the id and the chain's blocks are in Redis, so
    another server answers the follow-up as the chat of the whole conversation, its cache from
    the first one's blocks; a Redis that stops answering makes a stored id a 503, not a 500."""
    from redis_helpers import redis_server

    with contextlib.ExitStack() as stack:
        with redis_server() as url:
            one = Live(default_model, disk_store=url)
            first = respond(one.client(), instructions=FACTS, input="Which lake does river 5 flow into?")
            one.idle()
            one.close()  # shutdown drains the write behind of its blocks
            other = Live(default_model, disk_store=url)
            stack.callback(other.close)
            second = respond(
                other.client(), instructions=FACTS, input="And river 6?", previous_response_id=first.id
            )
            convo = [
                {"role": "system", "content": FACTS},
                {"role": "user", "content": "Which lake does river 5 flow into?"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And river 6?"},
            ]
            same_as_chat(second, chat(live.client(), convo))
            cached = second.usage.input_tokens_details.cached_tokens
            assert cached >= B and cached >= first.usage.input_tokens // B * B
        # redis-server is stopped
        r = other.post("/v1/responses", {"model": MODEL, "input": "More?", "previous_response_id": second.id})
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unreachable"
        assert httpx.get(f"{other.url}/v1/responses/{second.id}", timeout=30).status_code == 503


def test_a_streamed_turn_continues_a_chain_and_is_a_link_of_it(live):
    client = live.client()
    first = respond(client, input="Name a fruit.")
    whole = respond(client, input="Another.", previous_response_id=first.id)
    with client.responses.stream(
        model=MODEL, input="Another.", previous_response_id=first.id, max_output_tokens=12, temperature=0
    ) as s:
        final = list(s)[-1].response
    assert final.output_text == whole.output_text and final.previous_response_id == first.id
    assert final.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens
    after = respond(client, input="And one more.", previous_response_id=final.id)
    assert after.usage.input_tokens_details.cached_tokens >= final.usage.total_tokens


def test_two_requests_from_one_id_are_two_branches(live):
    client = live.client()
    root = respond(client, input="Pick an animal.")
    branches = {q: respond(client, input=q, previous_response_id=root.id) for q in ("Why?", "Another?")}
    for q, r in branches.items():
        assert r.usage.input_tokens_details.cached_tokens >= root.usage.total_tokens
        convo = [
            {"role": "user", "content": "Pick an animal."},
            {"role": "assistant", "content": root.output_text},
            {"role": "user", "content": q},
        ]
        same_as_chat(r, chat(client, convo))


def test_retrieve_delete_store_false_and_unknown_ids(live):
    client = live.client()
    r = respond(client, input="Hello.")
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as e:
        respond(client, input="Hi.", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"
    gone = respond(client, input="Hello.", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools"),
        ({"input": "x", "tools": [TOOL]}, "tools"),  # the default model's template has no tools
        ({"input": "x", "model": "nope"}, "model"),
    ],
)
def test_bad_bodies_are_4xx_in_the_openai_shape(live, body, param):
    r = live.post("/v1/responses", body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["message"] and (err["param"] or "").startswith(param), err


def test_json_schema_format_answers_valid_json(live):
    fmt = {"type": "json_schema", "name": "city", "schema": WEATHER}
    r = respond(live.client(), input="A city?", text={"format": fmt}, max_output_tokens=40)
    assert r.status == "completed"
    assert set(json.loads(r.output_text)) == {"city"}
    r = respond(
        live.client(), input="A JSON object?", text={"format": {"type": "json_object"}}, max_output_tokens=40
    )
    want = live.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A JSON object?"}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    assert r.output_text == want.choices[0].message.content and r.output_text.lstrip().startswith("{")


def test_metrics_label_the_routes(live):
    text = httpx.get(live.url + "/metrics", timeout=30).text
    assert 'route="/v1/responses",status="200"' in text
    assert 'route="/v1/responses/{id}",status="404"' in text


FORCED = {  # one forced call (a random model writes the grammar's whitespace at length)
    "model": TOOL_MODEL,
    "tools": [TOOL],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "max_output_tokens": 120,
    "temperature": 0,
}


def tool_turn(client, **kw):
    return client.responses.create(**FORCED, **kw)


def test_a_tool_loop_on_previous_response_id_reuses_its_prompt(tool_live):
    """A call, its output, the next call: from turn 2 on >= 95 % of every prompt is read from
    the bank, and each turn answers as the chat request of the whole conversation would."""
    client = tool_live.client()
    r = tool_turn(client, input="Plan a trip.", instructions=AGENT)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    first_call = calls[0]
    history = [{"role": "system", "content": AGENT}, {"role": "user", "content": "Plan a trip."}]
    for turn in range(4):
        out = {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"t": turn})}
        prev, r = r, tool_turn(client, input=[out], previous_response_id=r.id, instructions=AGENT)
        u = r.usage
        assert u.input_tokens_details.cached_tokens >= prev.usage.total_tokens, turn  # the whole chain
        assert u.input_tokens_details.cached_tokens >= 0.95 * u.input_tokens, (turn, u)
        history += [
            {"role": "assistant", "content": "", "tool_calls": [chat_call(c) for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": out["output"]},
        ]
        want = client.chat.completions.create(
            model=TOOL_MODEL,
            messages=history,
            tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=0,
        )
        calls = [o for o in r.output if o.type == "function_call"]
        assert [chat_call(c)["function"] for c in calls] == [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in want.choices[0].message.tool_calls
        ]
        assert u.input_tokens == want.usage.prompt_tokens
        if turn == 0:  # the same turn with the items sent back (no previous_response_id) answers alike
            items = [
                {"role": "user", "content": "Plan a trip."},
                first_call.model_dump(exclude_none=True),
                out,
            ]
            alone = tool_turn(client, input=items, instructions=AGENT)
            assert [chat_call(c)["function"] for c in alone.output] == [
                chat_call(c)["function"] for c in calls
            ]
            assert alone.usage.input_tokens == u.input_tokens


def chat_call(item) -> dict:
    return {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }


def test_streamed_calls_rebuild_the_whole_calls(tool_live):
    client = tool_live.client()
    whole = tool_turn(client, input="Weather?")
    with client.responses.stream(**FORCED, input="Weather?") as s:
        events = list(s)
        final = s.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    want = [(o.name, o.arguments) for o in whole.output if o.type == "function_call"]
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == want
    assert [(e.name, e.arguments) for e in done] == want and args == "".join(a for _, a in want)
    assert events[-1].type == "response.completed"


def test_a_new_server_on_the_same_disk_dir_continues_a_chain(default_model, tmp_path):
    first = Live(default_model, disk_dir=str(tmp_path))
    r = respond(first.client(), input=FACTS)
    first.idle()
    first.close()  # shutdown drains the disk tier's writes
    assert (tmp_path / "responses.sqlite").exists()
    second = Live(default_model, disk_dir=str(tmp_path))
    try:
        r2 = respond(second.client(), input="And mountains?", previous_response_id=r.id)
    finally:
        second.close()
    cached = r2.usage.input_tokens_details.cached_tokens
    assert cached >= (r.usage.total_tokens // B - 1) * B and cached % B == 0  # the chain's whole blocks
    fresh = Live(default_model, no_disk=True)
    try:
        convo = [
            {"role": "user", "content": FACTS},
            {"role": "assistant", "content": r.output_text},
            {"role": "user", "content": "And mountains?"},
        ]
        same_as_chat(r2, chat(fresh.client(), convo))
    finally:
        fresh.close()


def test_a_chain_whose_rows_were_evicted_is_rebuilt_from_its_items(default_model):
    """A memory-only bank too small for five conversations: the first response's rows are gone,
    so its chain is re-rendered from the stored items, counted, and answers as chat does."""
    small = Live(default_model, no_disk=True, bank_bytes="3M")
    try:
        client = small.client()
        first = respond(client, input="Name a river.")
        for i in range(6):
            chat(
                client, [{"role": "user", "content": f"Tell me story number {i} about a cat named {i * 17}."}]
            )
        small.idle()
        again = respond(client, input="Another.", previous_response_id=first.id)
        metrics = httpx.get(small.url + "/metrics", timeout=30).text
        convo = [
            {"role": "user", "content": "Name a river."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Another."},
        ]
        same_as_chat(again, chat(client, convo))
    finally:
        small.close()
    assert "turnkv_responses_rebuilt_total 1.0" in metrics
    assert again.usage.input_tokens_details.cached_tokens < first.usage.total_tokens


def test_a_stored_response_belongs_to_its_key(default_model):
    keyed = Live(default_model, no_disk=True, api_key=["sk-one", "sk-two"])
    try:
        one, two = keyed.client("sk-one"), keyed.client("sk-two")
        r = respond(one, input="Hello.")
        assert one.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            two.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            respond(two, input="Hi.", previous_response_id=r.id)
        with pytest.raises(openai.AuthenticationError):
            keyed.client("sk-wrong").responses.retrieve(r.id)
    finally:
        keyed.close()

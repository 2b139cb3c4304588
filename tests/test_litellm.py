"""``litellm`` as a third client: its ``openai/`` provider through ``/v1/chat/completions``, its
``litellm.responses`` through ``/v1/responses`` (``previous_response_id``) and its ``anthropic/``
provider through ``/v1/messages``, against a live server. Each answers what the official SDK's call
of the same request answers (greedy), its usage counts the same prompt, and a follow-up turn reads
the first turn from the cache; a tool-call turn and its result go through each on a random-weight
model with a tool template (tests/tool_models.py)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
litellm = pytest.importorskip("litellm")

import anthropic  # noqa: E402
import test_messages  # noqa: E402
from test_server import MODEL, Live  # noqa: E402

pytestmark = pytest.mark.slow
# the Messages tests' servers (module-scoped: this module gets its own): the default model, a tool template
live, tool_live = test_messages.live, test_messages.tool_live

KEY = "sk-litellm"
USER = [{"role": "user", "content": "Name a colour of the sky."}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}}


def via(srv: Live, provider: str, messages: list[dict], **kw):
    """``litellm.completion`` of ``provider`` (openai: /v1/chat/completions, anthropic: /v1/messages)."""
    base = srv.url + "/v1" if provider == "openai" else srv.url
    return litellm.completion(
        model=f"{provider}/{srv.engine.info.model_name}",
        api_base=base,
        api_key=KEY,
        messages=messages,
        temperature=0,
        max_tokens=kw.pop("max_tokens", 12),
        num_retries=0,
        **kw,
    )


def cached(resp) -> int:
    details = resp.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_completion_answers_as_the_sdk_and_reads_the_first_turn_from_the_cache(live, provider):
    first = via(live, provider, USER)
    if provider == "openai":
        want = live.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0)
        text, prompt = want.choices[0].message.content, want.usage.prompt_tokens
    else:
        sdk = anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0)
        want = sdk.messages.create(model=MODEL, messages=USER, max_tokens=12, extra_body={"temperature": 0})
        text = want.content[0].text
        prompt = want.usage.input_tokens + want.usage.cache_read_input_tokens
    assert first.choices[0].message.content == text and text
    assert first.usage.prompt_tokens == prompt and first.usage.completion_tokens > 0
    convo = [*USER, {"role": "assistant", "content": text}, {"role": "user", "content": "And at night?"}]
    second = via(live, provider, convo)
    assert second.choices[0].message.content
    assert cached(second) >= first.usage.prompt_tokens  # the first prompt (and its answer) reused
    assert second.usage.prompt_tokens > cached(second)


def respond(srv: Live, **kw):
    return litellm.responses(
        model=f"openai/{srv.engine.info.model_name}",
        api_base=srv.url + "/v1",
        api_key=KEY,
        temperature=0,
        max_output_tokens=kw.pop("max_output_tokens", 16),  # litellm raises smaller ones to 16
        **kw,
    )


def output_text(r) -> str:
    return "".join(c.text for o in r.output if o.type == "message" for c in o.content)


def test_responses_chain_on_previous_response_id(live):
    first = respond(live, input="Count to three.")
    want = live.client().responses.create(
        model=MODEL, input="Count to three.", max_output_tokens=16, temperature=0
    )
    assert output_text(first) == want.output_text and first.usage.input_tokens == want.usage.input_tokens
    second = respond(live, input="Now to four.", previous_response_id=first.id)
    assert output_text(second)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # litellm wraps the server's id (base64 of its provider and the id); get_responses unwraps it
    got = litellm.get_responses(response_id=second.id, api_base=live.url + "/v1", api_key=KEY)
    assert output_text(got) == output_text(second) and got.usage.input_tokens == second.usage.input_tokens


def test_a_tool_call_turn_and_its_result_through_each_route(tool_live):
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    force = {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120}
    for provider in ("openai", "anthropic"):
        m = via(tool_live, provider, msgs, **force)
        (call,) = m.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        turn = [
            *msgs,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})},
        ]
        after = via(tool_live, provider, turn, tools=[TOOL], max_tokens=8)
        assert cached(after) >= m.usage.prompt_tokens, provider  # the call turn as the template renders it

    fn = {"type": "function", **TOOL["function"]}
    r = respond(
        tool_live, input="Weather in Oslo?", tools=[fn], tool_choice="required", max_output_tokens=120
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    out = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "clear"})}
    after = respond(tool_live, input=[out], previous_response_id=r.id, tools=[fn])
    assert after.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + r.usage.output_tokens - 1

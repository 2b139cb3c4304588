"""The server's refusals and edges with the real default model: bad input (4xx in the OpenAI shape,
never a 500, the worker survives), API keys and cache namespaces, the 507 admission, a prompt
longer than the context, and clients that go away mid-answer (what was computed is banked).
"""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server import MODEL, SYSTEM, Live, chat

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model


@pytest.fixture(scope="module")
def live(loaded):
    srv = Live(loaded, max_context=256)
    yield srv
    srv.close()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "code"} <= set(err) and err["message"]
    return err


def _chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 0, **fields}


BAD_CHAT = {
    "invalid json": b'{"model": "x", "messages": [',
    "empty body": b"",
    "not an object": b"[]",
    "missing messages": {"model": MODEL},
    "empty messages": _chat_body(messages=[]),
    "messages not a list": _chat_body(messages="hi"),
    "content wrong type": _chat_body(messages=[{"role": "user", "content": 5}]),
    "unknown role": _chat_body(messages=[{"role": "wizard", "content": "hi"}]),
    "image part": _chat_body(
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    ),
    "temperature a string": _chat_body(temperature="hot"),
    "temperature too high": _chat_body(temperature=2.5),
    "temperature negative": _chat_body(temperature=-0.1),
    "top_p zero": _chat_body(top_p=0),
    "top_p above one": _chat_body(top_p=1.5),
    "max_tokens zero": _chat_body(max_tokens=0),
    "max_tokens a float": _chat_body(max_tokens=2.5),
    "n past the cap": _chat_body(n=17),
    "five stop strings": _chat_body(stop=["a", "b", "c", "d", "e"]),
    "stream not a bool": _chat_body(stream="yes"),
}


@pytest.mark.parametrize("name", list(BAD_CHAT))
def test_bad_chat_input_is_a_400_in_the_openai_shape(live, name):
    err = _error(live.post("/v1/chat/completions", BAD_CHAT[name]), 400)
    assert err["type"] == "invalid_request_error"


BAD_COMPLETION = {
    "missing prompt": {"model": MODEL, "max_tokens": 2},
    "batch of prompts": {"model": MODEL, "prompt": ["a", "b"]},
    "token id out of range": {"model": MODEL, "prompt": [1, 10**9]},
    "prompt a number": {"model": MODEL, "prompt": 7},
    "max_tokens 0 without echo": {"model": MODEL, "prompt": "a", "max_tokens": 0, "logprobs": 1},
    "max_tokens negative with echo": {"model": MODEL, "prompt": "a", "max_tokens": -1, "echo": True},
    "echo with too many logprobs": {"model": MODEL, "prompt": "a", "echo": True, "logprobs": 6},
}


@pytest.mark.parametrize("name", list(BAD_COMPLETION))
def test_bad_completion_input_is_a_400(live, name):
    _error(live.post("/v1/completions", BAD_COMPLETION[name]), 400)


# Fields turnkv refuses rather than ignore (they would change the output): each refusal's `param`
# names the field, as docs/SERVER.md says (they came back with `param: null`).
REFUSED_CHAT = {
    "n": 17,  # past MAX_CHOICES
    "top_logprobs": 2,  # without logprobs: true
    "presence_penalty": 2.5,  # -2..2
    "frequency_penalty": -2.5,
    "min_p": 1.1,  # 0..1
    "repetition_penalty": 0,  # > 0
    "logit_bias": {"abc": 1},
    "stop": ["a", "b", "c", "d", "e"],
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
}
REFUSED_COMPLETION = {
    "n": 0,
    "logprobs": 6,  # 0-5
    "suffix": "!",
    "best_of": 2,
    "presence_penalty": -3.0,
    "min_p": -0.2,
    "prompt": ["a", "b"],
}


@pytest.mark.parametrize(
    ("route", "field"), [("chat", f) for f in REFUSED_CHAT] + [("text", f) for f in REFUSED_COMPLETION]
)
def test_every_refused_field_is_named_by_param(live, route, field):
    if route == "chat":
        r = live.post("/v1/chat/completions", _chat_body(**{field: REFUSED_CHAT[field]}))
    else:
        r = live.post(
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "max_tokens": 2, field: REFUSED_COMPLETION[field]},
        )
    err = _error(r, 400)
    assert err["param"] == field and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize(
    ("name", "param"),
    [
        ("temperature a string", "temperature"),
        ("five stop strings", "stop"),
        ("stream not a bool", "stream"),
        ("content wrong type", "messages[0].content"),  # not pydantic's union tag (content.str)
        ("n past the cap", "n"),
        ("missing messages", "messages"),
    ],
)
def test_a_bad_field_is_named_by_param(live, name, param):
    assert _error(live.post("/v1/chat/completions", BAD_CHAT[name]), 400)["param"] == param


def test_unknown_model_route_and_method(live):
    err = _error(live.post("/v1/chat/completions", _chat_body(model="gpt-9")), 404)
    assert err["code"] == "model_not_found"
    _error(live.post("/v1/nothing", {}), 404)
    _error(httpx.get(live.url + "/v1/chat/completions"), 405)


def test_prompt_longer_than_the_context(live):
    long = [{"role": "user", "content": "word " * 400}]  # the server's context is 256 tokens
    err = _error(live.post("/v1/chat/completions", _chat_body(messages=long)), 400)
    assert err["code"] == "context_length_exceeded"
    err = _error(live.post("/v1/chat/completions", _chat_body(max_tokens=250)), 400)
    assert err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        chat(live.client(), long)


def test_the_worker_survives_bad_input(live):
    for body in list(BAD_CHAT.values())[:5]:
        live.post("/v1/chat/completions", body)
    r = chat(live.client(), USER, max_tokens=3)
    assert r.choices[0].message.content
    assert live.health()["status"] == "ok"


# -- keys and namespaces ---------------------------------------------------------------------------


def test_api_keys_and_namespaces(loaded):
    srv = Live(loaded, api_key=["key-one", "key-two"])
    try:
        msgs = [SYSTEM, {"role": "user", "content": "Pick a number."}]
        for headers in ({}, {"authorization": "Bearer wrong"}):
            err = _error(srv.post("/v1/chat/completions", _chat_body(), headers=headers), 401)
            assert err["code"] == "invalid_api_key"
        _error(httpx.get(srv.url + "/v1/models"), 401)
        assert httpx.get(srv.url + "/health").status_code == 200  # not under /v1
        one, two = srv.client("key-one"), srv.client("key-two")
        a = chat(one, msgs)
        assert a.usage.prompt_tokens_details.cached_tokens == 0
        assert chat(two, msgs).usage.prompt_tokens_details.cached_tokens == 0  # another tenant
        again = chat(one, msgs)
        assert again.usage.prompt_tokens_details.cached_tokens == a.usage.prompt_tokens - 1
        salted = chat(one, msgs, extra_body={"cache_salt": "s1"})
        assert salted.usage.prompt_tokens_details.cached_tokens == 0
        salted2 = chat(one, msgs, extra_body={"cache_salt": "s1"})
        assert salted2.usage.prompt_tokens_details.cached_tokens == a.usage.prompt_tokens - 1
    finally:
        srv.close()


# -- admission -------------------------------------------------------------------------------------


def test_507_then_a_small_turn_succeeds_and_the_bank_still_hits(loaded):
    srv = Live(loaded, bank_bytes="8M")
    try:
        c = srv.client()
        msgs = [SYSTEM, {"role": "user", "content": "Say yes."}]
        first = chat(c, msgs, max_tokens=4)
        srv.idle()
        entries = srv.health()["bank"]["entries"]
        assert entries == 1
        big = [{"role": "user", "content": "Summarise: " + "river stone lantern " * 200}]
        r = srv.post("/v1/chat/completions", _chat_body(messages=big, max_tokens=8))
        err = _error(r, 507)
        assert err["code"] == "kv_memory_exhausted"
        assert isinstance(err["needed_bytes"], int) and isinstance(err["available_bytes"], int)
        assert err["needed_bytes"] > err["available_bytes"] >= 0
        h = srv.health()["bank"]
        assert h["refusals"] == 1 and h["entries"] == entries and h["evictions"] == 0
        msgs += [{"role": "assistant", "content": first.choices[0].message.content}]
        msgs += [{"role": "user", "content": "Say no."}]
        follow = chat(c, msgs, max_tokens=4)
        assert follow.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        with pytest.raises(openai.InternalServerError) as exc:  # the openai client's view of a 507
            chat(c, big, max_tokens=8)
        assert exc.value.status_code == 507
        assert "turnkv_kv_refusals_total 2.0" in httpx.get(srv.url + "/metrics").text
    finally:
        srv.close()


# -- clients that go away --------------------------------------------------------------------------


def _banked_after(srv: Live, prompt: list[int]) -> list[int]:
    srv.idle()
    lens = [len(e.tokens) for e in srv.server.bank.entries() if list(e.tokens[: len(prompt)]) == prompt]
    assert lens, "the cancelled turn was not banked"
    return lens


def test_disconnect_mid_stream_cancels_and_banks(live):
    msgs = [{"role": "user", "content": "Write a very long story about a lighthouse."}]
    prompt = live.engine.tokenizer.apply_chat_template(msgs)
    body = _chat_body(messages=msgs, max_tokens=200, stream=True, ignore_eos=True)
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line:
                seen += 1
                if seen == 3:
                    break
    lens = _banked_after(live, prompt)
    assert max(lens) < len(prompt) + 150  # it stopped well before max_tokens
    r = chat(live.client(), msgs, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1


def test_disconnect_while_waiting_for_a_non_streamed_answer(live):
    msgs = [{"role": "user", "content": "Describe the ocean at length."}]
    prompt = live.engine.tokenizer.apply_chat_template(msgs)
    body = _chat_body(messages=msgs, max_tokens=200, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=1.5)
    lens = _banked_after(live, prompt)
    assert max(lens) < len(prompt) + 150


def test_session_header_protects_that_sessions_newest_entry(loaded):
    srv = Live(loaded)
    try:
        c, bank = srv.client(), srv.server.bank
        a_msgs = [{"role": "user", "content": "Session A says hi."}]
        b_msgs = [{"role": "user", "content": "Session B says hello."}]
        a = chat(c, a_msgs, max_tokens=3, extra_headers={"X-Session-Id": "session-a"})
        b = chat(c, b_msgs, max_tokens=3)  # more recent than A, but no session
        srv.idle()
        # a raw completion shares no prefix with the chats, so its price does not depend on them
        big = {"model": MODEL, "prompt": "Summarise: " + "copper meadow signal " * 40, "max_tokens": 3}
        bank.budget_bytes = 1  # learn what the big turn is priced at: a 507 names it
        needed = _error(srv.post("/v1/completions", big), 507)["needed_bytes"]
        # room for the big turn beside one of the two entries, not beside both
        bank.budget_bytes = bank.unique_bytes() + needed - 1
        assert srv.post("/v1/completions", big).status_code == 200
        assert bank.stats.evictions == 1
        assert (
            chat(c, a_msgs, max_tokens=1).usage.prompt_tokens_details.cached_tokens
            == a.usage.prompt_tokens - 1
        )
        # B's own rows went; what it shares with A (the default system prompt) still hits
        tok = srv.engine.tokenizer
        pa, pb = tok.apply_chat_template(a_msgs), tok.apply_chat_template(b_msgs)
        shared = next(i for i, (x, y) in enumerate(zip(pa, pb, strict=False)) if x != y)
        assert chat(c, b_msgs, max_tokens=1).usage.prompt_tokens_details.cached_tokens == shared
        assert shared < b.usage.prompt_tokens - 1
    finally:
        srv.close()

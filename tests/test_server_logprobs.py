"""Logprobs, penalties and min_p through the HTTP routes with the default model: the OpenAI shapes (parsed by the
``openai`` SDK), streamed equal to whole, and bad values a 400 naming the field. That the values
are the log-softmax of the step's logits is tests/test_logprobs.py's (the prompt's, with ``echo``:
tests/test_prompt_logprobs.py's; here they are checked once more against an uncached forward of
the server's own engine)."""

from __future__ import annotations

import pytest
import torch
from test_server import MODEL, Live, chat

from turnkv.engine.step import Window

MSGS = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def live(default_model):
    srv = Live(default_model)
    yield srv
    srv.close()


def test_chat_logprobs_in_the_openai_shape_streamed_as_whole(live):
    c = live.client()
    # each request cold (its own cache_salt): a prompt row the bank holds was computed in another
    # window, which rounds its logits differently
    r = chat(c, MSGS, max_tokens=12, logprobs=True, top_logprobs=3, extra_body={"cache_salt": "whole"})
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # no EOS entry
    assert b"".join(bytes(e.bytes) for e in content).decode() == text
    for e in content:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.logprob == e.top_logprobs[0].logprob <= 0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    streamed = []
    for ch in chat(
        c, MSGS, max_tokens=12, logprobs=True, top_logprobs=3, stream=True, extra_body={"cache_salt": "s"}
    ):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = chat(c, MSGS, max_tokens=12)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_completion_logprobs_with_text_offsets(live):
    c = live.client()
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r = c.completions.create(logprobs=2, extra_body={"cache_salt": "whole"}, **kw)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert "".join(lp.tokens) == text
    for tok, off, top, v in zip(lp.tokens, lp.text_offset, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert text[off : off + len(tok)] == tok and len(top) == 2 and top[tok] == v
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in c.completions.create(logprobs=2, stream=True, extra_body={"cache_salt": "s"}, **kw):
        if ch.choices and ch.choices[0].logprobs is not None:
            for k, v in ch.choices[0].logprobs.model_dump().items():
                streamed[k] += v
    assert streamed == lp.model_dump()
    zero = c.completions.create(logprobs=0, extra_body={"cache_salt": "0"}, **kw).choices[0].logprobs
    assert zero.token_logprobs == lp.token_logprobs and zero.top_logprobs == [{}] * len(lp.tokens)


def _oracle(engine, ids: list[int]) -> torch.Tensor:
    """``[P, V]``: the log-softmax of every prompt row's logits, one uncached window."""
    logits = engine.run_step([Window(engine.new_cache(), ids, logits=len(ids))]).logits
    return torch.log_softmax(logits.float(), -1)


def test_echo_with_logprobs_scores_the_prompt_as_an_uncached_forward(live):
    c = live.client()
    text = "The capital of France is"
    ids = live.post("/tokenize", {"model": MODEL, "prompt": text}).json()["tokens"]
    kw = {"model": MODEL, "prompt": text, "temperature": 0, "echo": True, "logprobs": 2}
    zero = c.completions.create(max_tokens=0, **kw)
    ch = zero.choices[0]
    assert ch.text == text and ch.finish_reason == "length" and zero.usage.completion_tokens == 0
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == text
    live.idle()  # the worker is idle: the oracle runs the engine alone
    want = _oracle(live.engine, ids)
    piece = live.server.logprobs.piece
    for j in range(1, len(ids)):
        assert lp.tokens[j] == piece(ids[j])[0] and text[lp.text_offset[j] :].startswith(lp.tokens[j])
        torch.testing.assert_close(lp.token_logprobs[j], want[j - 1, ids[j]].item(), rtol=0, atol=1e-4)
        top = torch.topk(want[j - 1], 2)
        assert list(lp.top_logprobs[j]) == [piece(t)[0] for t in top.indices.tolist()]
        torch.testing.assert_close(list(lp.top_logprobs[j].values()), top.values.tolist(), rtol=0, atol=1e-4)
    more = c.completions.create(max_tokens=6, **kw)
    full, m = more.choices[0].text, more.choices[0].logprobs
    assert full.startswith(text) and more.usage.prompt_tokens_details.cached_tokens == 0  # nothing read
    assert m.tokens[: len(ids)] == lp.tokens and m.token_logprobs[: len(ids)] == lp.token_logprobs
    assert len(m.tokens) == len(ids) + more.usage.completion_tokens - (
        more.choices[0].finish_reason == "stop"
    )
    for tok, off in zip(m.tokens, m.text_offset, strict=True):  # offsets in the returned text
        assert full[off : off + len(tok)] == tok
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    texts = []
    for chunk in c.completions.create(max_tokens=6, stream=True, **kw):
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            if chunk.choices[0].logprobs is not None:
                for k, v in chunk.choices[0].logprobs.model_dump().items():
                    streamed[k] += v
    assert "".join(texts) == full and streamed == m.model_dump()


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": 1}, "logprobs"),  # a bool (strict)
        ("text", {"logprobs": 6}, "logprobs"),
        ("text", {"logprobs": True}, "logprobs"),
        ("text", {"echo": True, "logprobs": 6}, "logprobs"),
        ("text", {"logprobs": 1, "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("text", {"echo": True, "logprobs": 1, "max_tokens": -1}, "max_tokens"),
    ],
)
def test_bad_logprobs_are_a_400_naming_the_field(live, route, body, param):
    if route == "chat":
        r = live.post("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 2, **body})
    else:
        r = live.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2} | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_penalties_and_min_p_change_the_answer_as_the_sampler_does(live):
    c = live.client()
    plain = chat(c, MSGS, max_tokens=16).choices[0].message.content
    penalized = chat(c, MSGS, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0)
    assert penalized.choices[0].message.content != plain  # greedy, yet no longer the argmax
    again = chat(c, MSGS, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0)
    assert again.choices[0].message.content == penalized.choices[0].message.content
    extra = {"repetition_penalty": 1.3, "min_p": 0.1}
    r = c.completions.create(
        model=MODEL, prompt="One, two,", max_tokens=8, temperature=0.7, seed=3, extra_body=extra
    )
    assert r.choices[0].finish_reason in ("stop", "length")

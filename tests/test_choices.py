"""n > 1 through the HTTP routes with the default model: the choices are forks of one prompt.

The prompt is prefilled once and its rows are shared by reference, so the bank grows by the
answers only (measured against the segments it holds); choice i samples as a single request with
seed + i does; streaming names each chunk's choice; usage counts the prompt once; a bad n is a 400
in the OpenAI error shape; n choices that cannot fit the budget are a 507."""

from __future__ import annotations

import pytest
from test_server import MODEL, Live

MSGS = [{"role": "user", "content": "Write one sentence about the sea."}]
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def live(default_model):
    srv = Live(default_model)
    yield srv
    srv.close()


def test_n_choices_share_the_prompt_rows_and_equal_single_requests_by_seed(live):
    c = live.client()
    bank = live.server.bank
    before = bank.unique_bytes(live=False)
    r = c.chat.completions.create(
        model=MODEL, messages=MSGS, n=4, seed=7, extra_body={"cache_salt": "fork"}, **SAMPLED
    )
    live.idle()
    texts = [ch.message.content for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    prompt = r.usage.prompt_tokens
    assert r.usage.completion_tokens > 4 and r.usage.prompt_tokens_details.cached_tokens == 0
    # the bank holds the prompt's rows once: every entry of this namespace starts with the same
    # segment, and the bytes are that segment plus each answer's own rows (a fork's own rows start
    # with the prompt's last one, which it recomputed)
    entries = [e for e in bank.entries() if "salt:" in e.namespace]
    assert len(entries) == len(set(texts))  # identical answers bank once
    first = {e.snapshot.refs[0].segment.id for e in entries}
    assert len(first) == 1
    bpr = bank.bytes_per_row
    own = sum(len(e.tokens) - prompt for e in entries) + (len(entries) - 1)
    assert bank.unique_bytes(live=False) - before == bpr * (prompt + own)
    # each choice is what a single request with seed + i answers (each one cold: its own salt)
    for i, text in enumerate(texts):
        one = c.chat.completions.create(
            model=MODEL, messages=MSGS, seed=7 + i, extra_body={"cache_salt": f"one{i}"}, **SAMPLED
        )
        assert one.choices[0].message.content == text, i
    # greedy: n equal answers
    g = c.chat.completions.create(model=MODEL, messages=MSGS, n=3, temperature=0, max_tokens=6)
    assert len({ch.message.content for ch in g.choices}) == 1 and len(g.choices) == 3


def test_streamed_choices_carry_their_index_and_join_into_the_whole(live):
    c = live.client()
    kw = {"model": MODEL, "prompt": "The sea is", "n": 3, "seed": 3, **SAMPLED}
    whole = c.completions.create(extra_body={"cache_salt": "w"}, **kw)
    parts = {0: "", 1: "", 2: ""}
    usage = None
    for ch in c.completions.create(
        stream=True, stream_options={"include_usage": True}, extra_body={"cache_salt": "s"}, **kw
    ):
        for choice in ch.choices:
            parts[choice.index] += choice.text
        usage = ch.usage or usage
    assert [parts[i] for i in range(3)] == [ch.text for ch in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("n", [0, 17, -1])
def test_bad_n_is_a_400_naming_the_cap(live, n):
    r = live.post("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "n": n, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "16" in err["message"] and err["type"] == "invalid_request_error"


def test_choices_that_cannot_fit_are_a_507(default_model):
    srv = Live(default_model, bank_bytes="4M")
    try:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 20}
        assert srv.post("/v1/chat/completions", body).status_code == 200  # one choice fits
        r = srv.post("/v1/chat/completions", {**body, "n": 16})
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["needed_bytes"] > err["available_bytes"] and "n=16" in err["message"]
    finally:
        srv.close()

"""The prompt's text and ids through the HTTP routes with the default model: ``/tokenize`` gives
the ids the generation routes prefill (the completion's and the chat's ``usage.prompt_tokens``
agree), ``/detokenize`` inverts it, ``echo`` puts the prompt before each choice's text (streamed
too); bad bodies are 400s in the OpenAI shape naming the field."""

from __future__ import annotations

import pytest
from test_server import MODEL, Live

MSGS = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def live(default_model):
    srv = Live(default_model)
    yield srv
    srv.close()


def test_tokenize_counts_what_the_routes_prefill_and_detokenize_inverts_it(live):
    c = live.client()
    tok = live.post("/tokenize", {"model": MODEL, "prompt": "The sea is blue"}).json()
    r = c.completions.create(model=MODEL, prompt="The sea is blue", max_tokens=1, temperature=0)
    assert tok["count"] == len(tok["tokens"]) == r.usage.prompt_tokens
    assert tok["max_model_len"] == live.server.engine.max_context
    back = live.post("/detokenize", {"model": MODEL, "tokens": tok["tokens"]}).json()
    assert back["prompt"].endswith("The sea is blue")
    chat = live.post("/tokenize", {"model": MODEL, "messages": MSGS, "return_token_strs": True}).json()
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, temperature=0)
    assert chat["count"] == r.usage.prompt_tokens and len(chat["token_strs"]) == chat["count"]
    text = live.post("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text == live.server.engine.tokenizer.render_chat(MSGS)  # special tokens kept
    no_gen = live.post("/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    assert no_gen["count"] < chat["count"] and chat["tokens"][: no_gen["count"]] == no_gen["tokens"]


def test_echo_puts_the_prompt_before_each_choice(live):
    c = live.client()
    kw = {"model": MODEL, "prompt": "The sea is", "max_tokens": 6, "temperature": 0}
    plain = c.completions.create(**kw).choices[0].text
    echoed = c.completions.create(echo=True, n=2, **kw)
    assert [ch.text for ch in echoed.choices] == ["The sea is" + plain] * 2
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(echo=True, stream=True, **kw))
    assert streamed == "The sea is" + plain
    ids = live.post("/tokenize", {"prompt": "The sea is", "add_special_tokens": False}).json()["tokens"]
    by_ids = c.completions.create(echo=True, **{**kw, "prompt": ids}).choices[0].text
    assert by_ids.startswith("The sea is")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": MSGS}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(live, path, body, param):
    r = live.post(path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_unknown_model_is_a_404(live):
    assert live.post("/tokenize", {"model": "nope", "prompt": "a"}).status_code == 404

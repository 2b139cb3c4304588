"""Cache breaks are visible (``bank.breaks``): every usage, on every API, says where the reused
prefix ended and why, and ``/metrics`` counts the reasons. Driven with the default model: a new
conversation, its follow-up (nothing lost), an edited earlier turn (the token it differs at is
the one ``/tokenize`` shows), another cache_salt of the same key, and an eviction."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import MODEL, Live

from turnkv.bank.breaks import REASONS
from turnkv.kv.cache import common_prefix_len

FIRST = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def live(default_model):
    srv = Live(default_model)
    yield srv
    srv.close()


def _chat(live, messages, salt, **kw) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "cache_salt": salt, **kw}
    r = live.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def _breaks(live) -> dict[str, float]:
    out = {}
    for line in httpx.get(live.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("turnkv_cache_breaks_total{"):
            out[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_conversation_tells_each_break_and_metrics_count_them(live):
    before = _breaks(live)
    first = _chat(live, FIRST, "conv")
    assert first["usage"]["cache_break"] == {"reason": "new_conversation", "at": 0, "detail": None}
    answer = first["choices"][0]["message"]["content"]
    follow = [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": "Another."}]
    second = _chat(live, follow, "conv")["usage"]
    assert second["cache_break"]["reason"] == "none"
    assert second["cache_break"]["at"] == second["prompt_tokens_details"]["cached_tokens"] > 0
    edited = [{"role": "user", "content": "Name a fruit."}, *follow[1:]]
    third = _chat(live, edited, "conv")["usage"]["cache_break"]
    ids = [live.post("/tokenize", {"messages": m}).json()["tokens"] for m in (follow, edited)]
    k = common_prefix_len(ids[0], ids[1])
    assert third["reason"] == "history_differs" and third["at"] == k
    assert f"at token {k}" in third["detail"]
    other = _chat(live, follow, "another salt")["usage"]["cache_break"]
    assert other["reason"] == "namespace" and other["at"] == 0
    after = _breaks(live)
    for reason, n in {"new_conversation": 1, "none": 1, "history_differs": 1, "namespace": 1}.items():
        assert after[reason] - before.get(reason, 0) == n, reason
    assert set(after) == {"none", "new_conversation", "history_differs", "evicted", "namespace", "not_read"}


def test_every_api_carries_the_break(live):
    """Each API's usage has it; the second of two equal requests lost nothing (``none``)."""
    msg = {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": "A bird?"}],
    }
    calls = [
        ("/v1/messages", msg, "cache_read_input_tokens"),
        ("/v1/responses", {"model": MODEL, "input": "Name a tree.", "max_output_tokens": 4}, None),
        ("/v1/completions", {"model": MODEL, "prompt": "Name a tree.", "max_tokens": 2}, None),
        ("/v1/chat/completions", {**msg, "stream": True, "stream_options": {"include_usage": True}}, None),
    ]
    for path, body, _ in calls:
        for turn in range(2):
            r = live.post(path, body, headers={"anthropic-version": "2023-06-01"})
            assert r.status_code == 200, r.text
            if body.get("stream"):
                usage = json.loads(r.text.split("data: ")[-2])["usage"]
            else:
                usage = r.json()["usage"]
            brk = usage["cache_break"]
            assert brk["reason"] in REASONS and isinstance(brk["at"], int), (path, brk)
            if turn:
                assert brk["reason"] == "none", (path, brk)


def test_an_evicted_conversation_is_told_apart_from_a_new_one(default_model):
    srv = Live(default_model, bank_bytes="6M", no_disk=True, no_ram=True)
    try:
        first = _chat(srv, FIRST, "")
        answer = first["choices"][0]["message"]["content"]
        follow = [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": "Another."}]
        bank = srv.server.bank
        i = 0
        while bank.stats.evictions == 0:  # the oldest entry (this conversation) goes first
            _chat(srv, [{"role": "user", "content": f"Count to {i} in words, slowly, please."}], "")
            i += 1
            assert i < 40, "nothing was evicted"
        brk = _chat(srv, follow, "")["usage"]["cache_break"]
        assert brk["reason"] == "evicted", brk
        assert brk["detail"].startswith(f"prompt tokens [{brk['at']}, ")
    finally:
        srv.close()

"""``/dashboard`` and ``/dashboard/state`` against a live server with the real default model.

The state is checked against independent sources after scripted multi-turn chats: ``/health``
(the same document), ``/metrics`` (token counters), the responses' ``usage`` (tokens generated),
the chat template (rows banked per conversation) and the segments themselves (unique bytes);
and it must hold no prompt or answer text, no token ids and no key material.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from html.parser import HTMLParser

import httpx
import pytest
from test_server import Live, chat, history_tokens

from turnkv.models.load import load_model
from turnkv.server.dashboard import ASSETS
from turnkv.server.dashboard.features import features

pytestmark = pytest.mark.slow

# A long system prompt (as agents send) and short turns: the merge policy keeps the system
# prompt's segment apart (a new turn has under half its rows), so conversations share it.
SYSTEM_LONG = {
    "role": "system",
    "content": (
        "You are the quartermaster of the research vessel Kestrel Meridian. Answer in one short "
        "sentence. The crew logs every request in the ledger: rations, charts, spare rope, lamp "
        "oil, tide tables, the barometer readings at dawn and dusk, the names of the islands "
        "sighted, the depth soundings of each anchorage, and the weather the lookout reports. "
        "Never invent a reading; say that the ledger has no entry instead. Keep a calm tone, "
        "prefer plain words, and do not repeat the question back to the crew member. "
    )
    * 2,
}
TOPICS = {  # words that must never appear in the dashboard state
    "alpha": ["How much lamp oil is aboard?", "And the spare rope?", "Thanks. Any tide tables?"],
    "beta": ["Which islands were sighted yesterday?", "What depth at the last anchorage?"],
}
SECRET = "sk-dashboard-Zq8vR2"
STATE_KEYS = {
    "schema",
    "time",
    "uptime_s",
    "health",
    "memory",
    "conversations",
    "conversations_total",
    "requests",
    "history",
    "features",
}
MEMORY_KEYS = {"bytes_per_row", "logical_bytes", "live_bytes", "segments", "shared_segments", "shared_bytes"}
CONV_KEYS = {"id", "ns_hash", "rows", "own_bytes", "in_use", "protected", "segments"}
SEG_KEYS = {"id", "rows", "segment_rows", "bytes", "shared"}
REQUEST_KEYS = {
    "running",
    "waiting",
    "live",
    "live_rows_per_s",
    "generated_tokens",
    "prefilled_tokens",
    "answers",
    "tokens_per_s",
    "prefill_tokens_per_s",
    "ttft_s",
    "ttft_mean_s",
}
HISTORY_KEYS = {
    "t",
    "banked_bytes",
    "live_bytes",
    "logical_bytes",
    "generated_tok_s",
    "prefilled_tok_s",
    "hits",
    "misses",
    "evictions",
    "refusals",
}


def run_conversations(client, topics=TOPICS, max_tokens: int = 10) -> tuple[list[list[dict]], list]:
    """Each topic as a multi-turn chat over the long system prompt; returns the final histories
    (with the last answer) and every response."""
    histories, responses = [], []
    for questions in topics.values():
        msgs = [SYSTEM_LONG]
        for q in questions:
            msgs.append({"role": "user", "content": q})
            r = chat(client, msgs, max_tokens=max_tokens)
            responses.append(r)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        histories.append(msgs)
    return histories, responses


def state(live: Live, key: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(live.url + "/dashboard/state", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    return r.json()


def metric(live: Live, name: str) -> float:
    text = httpx.get(live.url + "/metrics", timeout=30).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def loaded():
    return load_model("default", "cpu", "auto", progress=False)


@pytest.fixture(scope="module")
def chatted(loaded):
    """A fresh server after two scripted conversations and a fork of the first."""
    srv = Live(loaded)
    histories, responses = run_conversations(srv.client())
    fork = [*histories[0][:-2], {"role": "user", "content": "And the charts?"}]
    responses.append(chat(srv.client(), fork, max_tokens=10))
    histories.append([*fork, {"role": "assistant", "content": responses[-1].choices[0].message.content}])
    srv.idle()
    time.sleep(1.2)  # the sampler has taken a sample after the last turn finished
    yield srv, histories, responses
    srv.close()


def test_state_is_the_health_document_plus_the_banks_contents(chatted):
    srv, histories, _ = chatted
    s = state(srv)
    health = srv.health()
    assert set(s) == STATE_KEYS and s["schema"] == 1
    assert s["health"] == health  # one builder: every count on the page is /health's
    assert s["features"] == [f.doc() for f in features(health)]  # its status fields, classified
    bank = health["bank"]
    convs = s["conversations"]
    assert len(convs) == s["conversations_total"] == bank["entries"] == len(histories)
    bpr = s["memory"]["bytes_per_row"]
    assert set(s["memory"]) == MEMORY_KEYS and bpr == srv.engine.shape.bytes_per_row
    # each banked conversation is one history as the client will resend it
    want_rows = sorted(history_tokens(srv.engine, h) for h in histories)
    assert sorted(c["rows"] for c in convs) == want_rows
    holders: dict[int, int] = {}
    seg_bytes: dict[int, int] = {}
    for c in convs:
        assert set(c) == CONV_KEYS
        assert sum(g["rows"] for g in c["segments"]) == c["rows"]
        for g in c["segments"]:
            assert set(g) == SEG_KEYS and 0 < g["rows"] <= g["segment_rows"]
            assert g["bytes"] == g["segment_rows"] * bpr
            holders[g["id"]] = holders.get(g["id"], 0) + 1
            seg_bytes[g["id"]] = g["bytes"]
    for c in convs:
        for g in c["segments"]:
            assert g["shared"] == (holders[g["id"]] > 1)
        assert c["own_bytes"] == sum(g["bytes"] for g in c["segments"] if not g["shared"])
        assert not c["in_use"]
    # unique bytes of the bank == the segments listed, each once; logical == private copies
    assert sum(seg_bytes.values()) == bank["unique_bytes"]
    assert s["memory"]["logical_bytes"] == sum(c["rows"] for c in convs) * bpr
    assert s["memory"]["live_bytes"] == 0 and s["memory"]["segments"] == len(seg_bytes)
    shared = [i for i, n in holders.items() if n > 1]
    assert s["memory"]["shared_segments"] == len(shared) >= 1  # the system prompt, the fork
    assert s["memory"]["shared_bytes"] == sum(seg_bytes[i] for i in shared)
    assert s["memory"]["logical_bytes"] > bank["unique_bytes"]  # sharing saves memory
    assert {c["ns_hash"] for c in convs} == {hashlib.sha256(b"public").hexdigest()[:8]}


def test_request_counters_match_the_responses_and_metrics(chatted):
    srv, _, responses = chatted
    r = state(srv)["requests"]
    assert set(r) == REQUEST_KEYS
    assert r["running"] == 0 and r["waiting"] == 0 and r["live"] == []
    assert r["generated_tokens"] == sum(x.usage.completion_tokens for x in responses)
    assert r["generated_tokens"] == metric(srv, "turnkv_generated_tokens_total")
    assert r["prefilled_tokens"] == metric(srv, "turnkv_prefilled_tokens_total")
    assert r["answers"] == len(responses) == metric(srv, "turnkv_time_to_first_token_seconds_count")
    ttft_sum = metric(srv, "turnkv_time_to_first_token_seconds_sum")
    assert r["ttft_mean_s"] == pytest.approx(ttft_sum / len(responses), abs=1e-4)


def test_history_adds_up_to_the_counters(chatted):
    srv, _, _ = chatted
    s = state(srv)
    h = s["history"]
    assert set(h) == HISTORY_KEYS and len({len(v) for v in h.values()}) == 1
    assert len(h["t"]) >= 2 and h["t"] == sorted(h["t"])
    bank = s["health"]["bank"]
    # the first sample was taken at start-up, before any request: events per interval add up
    for k in ("hits", "misses", "evictions", "refusals"):
        assert sum(h[k]) == bank[k], k
    assert h["banked_bytes"][0] == 0 and h["banked_bytes"][-1] == bank["unique_bytes"]
    assert h["logical_bytes"][-1] == s["memory"]["logical_bytes"]
    t = h["t"]
    generated = sum(
        rate * (b - a) for rate, a, b in zip(h["generated_tok_s"][1:], t[:-1], t[1:], strict=True)
    )
    assert generated == pytest.approx(s["requests"]["generated_tokens"], abs=0.5)


def _strings(obj) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _strings(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _strings(v)]
    return []


def test_state_holds_no_text_no_token_ids(chatted):
    srv, histories, responses = chatted
    s = state(srv)
    # outside the /health document and its classification (both checked against /health above)
    # the only strings are hashes
    rest = {k: v for k, v in s.items() if k not in ("health", "features")}
    assert all(re.fullmatch(r"[0-9a-f]{8}", x) for x in _strings(rest)), _strings(rest)
    text = json.dumps(s)
    for w in ("Kestrel", "Meridian", "quartermaster", "lamp oil", "anchorage"):
        assert w.lower() not in text.lower(), w
    for r in responses:
        answer = r.choices[0].message.content.strip()
        assert len(answer) < 8 or answer not in text
    # no run of the prompt's token ids
    ids = srv.engine.tokenizer.apply_chat_template(histories[0])
    for sep in (", ", ","):
        assert sep.join(map(str, ids[5:9])) not in text
    assert "public" not in text  # the namespace is shown as a hash only


def test_page_and_assets_are_served_with_types_and_no_external_urls(chatted):
    srv, _, _ = chatted
    body = {}
    for path, (_, ctype) in ASSETS.items():
        r = httpx.get(srv.url + path, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == ctype, path
        assert r.headers["x-content-type-options"] == "nosniff"
        urls = set(re.findall(r"[a-z]+://[^\s\"'`)]+", r.text))
        # the SVG namespace name is an identifier the DOM needs, not something fetched
        assert urls <= {"http://www.w3.org/2000/svg"}, (path, urls)
        body[path] = r.text
    css, js = body["/dashboard/app.css"], body["/dashboard/app.js"] + body["/dashboard/draw.js"]
    assert "url(" not in css and "@import" not in css
    assert set(re.findall(r"fetch\(\s*([^,)]+)", js)) == {'"dashboard/state"'}
    page = httpx.get(srv.url + "/dashboard", timeout=30)
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp

    class Refs(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.found: list[str] = []

        def handle_starttag(self, tag, attrs):
            self.found += [v for k, v in attrs if k in ("src", "href") and v]

    p = Refs()
    p.feed(page.text)
    assert sorted(p.found) == ["dashboard/app.css", "dashboard/app.js", "dashboard/draw.js", "data:,"]
    assert "<script>" not in page.text and "<style" not in page.text  # nothing inline (the CSP)
    # the trailing-slash form redirects to the page, so its relative asset paths resolve
    r = httpx.get(srv.url + "/dashboard/", timeout=30)
    assert r.status_code in (307, 308) and r.headers["location"].endswith("/dashboard")


def test_api_key_guards_the_state_not_the_empty_page(loaded):
    srv = Live(loaded, api_key=[SECRET])
    try:
        assert httpx.get(srv.url + "/dashboard", timeout=30).status_code == 200  # no data in it
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": SECRET}):
            r = httpx.get(srv.url + "/dashboard/state", headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        chat(srv.client(SECRET), [{"role": "user", "content": "Hello."}], max_tokens=2)
        srv.idle()
        s = state(srv, SECRET)
        ns = "key:" + hashlib.sha256(SECRET.encode()).hexdigest()[:16]
        assert [c["ns_hash"] for c in s["conversations"]] == [hashlib.sha256(ns.encode()).hexdigest()[:8]]
        text = json.dumps(s)
        assert SECRET not in text and ns[4:] not in text
    finally:
        srv.close()

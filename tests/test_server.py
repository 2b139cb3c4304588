"""The OpenAI-compatible server with the real default model, driven by the ``openai`` client.

Servers run under uvicorn in a thread on a free port; they share one loaded model (each has its
own engine, bank and budget), so the model loads once for this file. Answers are short (greedy,
a few tokens) to keep the file fast.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest
import uvicorn

from turnkv.attention import cpu_native
from turnkv.bank.disk import DISK_KEYS
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.models.generation import DEFAULT_MAX_TOKENS
from turnkv.models.load import build_random_model
from turnkv.runtime import build
from turnkv.server.app import create_app
from turnkv.server.run import uvicorn_config

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
# what a request that sets no sampling field gets from the default model (its card) and turnkv
CARD_DEFAULTS = {
    "temperature": 0.2,
    "top_p": 0.9,
    "top_k": 0,
    "max_tokens": DEFAULT_MAX_TOKENS,
    "source": {"temperature": "model", "top_p": "model", "top_k": "built-in", "max_tokens": "built-in"},
}


class Live:
    """One app under uvicorn (turnkv's settings, ``run.uvicorn_config``) in a daemon thread;
    ``server`` is the app's state (bank, worker)."""

    def __init__(self, loaded, **cfg) -> None:
        self.cfg = replace(EngineConfig(device="cpu", bank_bytes="1G"), **cfg)
        self.engine = Engine(loaded, self.cfg)
        app = create_app(build(self.cfg, "serve", engine=self.engine))
        self.server = app.state.server
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn_config(app, self.cfg, host="127.0.0.1", port=self.port))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def post(self, path: str, body, **kw) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=120, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def idle(self) -> None:
        """Wait until the worker has finished (and banked) everything queued."""
        deadline = time.monotonic() + 60
        worker = self.server.worker
        while worker.waiting or worker.scheduler.snapshot["running"] or worker.scheduler.snapshot["waiting"]:
            assert time.monotonic() < deadline, "worker stuck"
            time.sleep(0.02)

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model


@pytest.fixture(scope="module")
def live(loaded):
    srv = Live(loaded)
    yield srv
    srv.close()


def chat(client: openai.OpenAI, messages: list[dict], max_tokens: int = 8, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def history_tokens(engine: Engine, messages: list[dict]) -> int:
    return len(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False))


# -- multi-turn reuse ----------------------------------------------------------------------------


def test_multi_turn_reuses_the_whole_history(live):
    c = live.client()
    msgs = [SYSTEM, {"role": "user", "content": "Name a colour of the sky."}]
    cached = []
    for follow_up in ("And of grass?", "And of snow?", "Thanks. Name a fruit."):
        r = chat(c, msgs)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prior = history_tokens(live.engine, msgs[:-1]) if len(msgs) > 2 else 0
        assert cached[-1] >= prior  # every earlier turn, as the template re-renders it
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}]
        msgs += [{"role": "user", "content": follow_up}]
    assert cached[1] > cached[0] and cached[2] > cached[1]
    r = chat(c, msgs)
    # the re-rendered history (including the last answer's end-of-turn tokens) is reused in full
    assert r.usage.prompt_tokens_details.cached_tokens == history_tokens(live.engine, msgs[:-1])


def test_fork_regenerate_and_edit_reuse_the_shared_prefix(live):
    c = live.client()
    msgs = [SYSTEM, {"role": "user", "content": "Count to three."}]
    first = chat(c, msgs)
    msgs.append({"role": "assistant", "content": first.choices[0].message.content})
    msgs.append({"role": "user", "content": "Now count backwards."})
    base = chat(c, msgs)
    prompt = base.usage.prompt_tokens

    again = chat(c, msgs)  # regenerate: the whole prompt is banked; only its last row is recomputed
    assert again.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert again.choices[0].message.content == base.choices[0].message.content

    fork = chat(c, [*msgs[:-1], {"role": "user", "content": "Now count to five."}])
    assert fork.usage.prompt_tokens_details.cached_tokens >= history_tokens(live.engine, msgs[:-1])

    edited = [SYSTEM, {"role": "user", "content": "Count to four."}, *msgs[2:]]
    e = chat(c, edited)
    shared = history_tokens(live.engine, [SYSTEM])
    assert shared <= e.usage.prompt_tokens_details.cached_tokens < history_tokens(live.engine, msgs[:-1])


def test_greedy_answers_equal_a_fresh_servers(live, loaded):
    c = live.client()
    msgs = [SYSTEM, {"role": "user", "content": "What is the capital of Italy?"}]
    for follow_up in ("And of Spain?", "And of Japan?"):
        r = chat(c, msgs, max_tokens=12)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}]
        msgs += [{"role": "user", "content": follow_up}]
    warm = chat(c, msgs, max_tokens=12)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    fresh = Live(loaded)
    try:
        cold = chat(fresh.client(), msgs, max_tokens=12)
    finally:
        fresh.close()
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_contiguous_layout_serves_the_same_answers(live, loaded):
    msgs = [SYSTEM, {"role": "user", "content": "Say hello in French."}]
    want = chat(live.client(), msgs).choices[0].message.content
    con = Live(loaded, kv_layout="contiguous")
    try:
        c = con.client()
        r1 = chat(c, msgs)
        assert r1.choices[0].message.content == want
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}]
        msgs += [{"role": "user", "content": "And in German?"}]
        r2 = chat(c, msgs)
        assert r2.usage.prompt_tokens_details.cached_tokens == history_tokens(con.engine, msgs[:-1])
        assert con.health()["kv_layout"] == "contiguous"
    finally:
        con.close()


# -- streaming -----------------------------------------------------------------------------------


def test_streaming_matches_non_streaming(live):
    c = live.client()
    msgs = [SYSTEM, {"role": "user", "content": "Give me two animals."}]
    plain = chat(c, msgs, max_tokens=10)
    stream = chat(c, msgs, max_tokens=10, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    assert len({ch.id for ch in chunks}) == 1


def test_sse_wire_format(live):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    r = live.post("/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert {o["object"] for o in objs} == {"chat.completion.chunk"}
    assert objs[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in o for o in objs)  # only with stream_options.include_usage


def test_completions_route(live):
    c = live.client()
    prompt = "The three primary colours are"
    a = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert a.object == "text_completion" and a.choices[0].text
    b = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - 1
    assert b.choices[0].text == a.choices[0].text
    s = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == a.choices[0].text
    ids = live.engine.tokenizer.prompt_text(prompt)
    t = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert t.choices[0].text == a.choices[0].text
    # the follow-up of a completion (prompt + its text) reuses the prompt and the completion
    longer = prompt + a.choices[0].text + " and"
    f = c.completions.create(model=MODEL, prompt=longer, max_tokens=2, temperature=0)
    assert f.usage.prompt_tokens_details.cached_tokens >= len(ids) + a.usage.completion_tokens - 2


def test_concurrent_clients_queue_and_all_succeed(live):
    c = live.client()
    questions = [f"Say the number {i}." for i in range(3)]
    want = [
        chat(c, [{"role": "user", "content": q}], max_tokens=6).choices[0].message.content for q in questions
    ]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            got[i] = (
                chat(c, [{"role": "user", "content": questions[i]}], max_tokens=6).choices[0].message.content
            )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [got[i] for i in range(3)] == want


# -- status routes -------------------------------------------------------------------------------


def test_models_health_and_metrics(live):
    c = live.client()
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["sampling_defaults"] == CARD_DEFAULTS
    assert c.models.retrieve(MODEL).model_extra["sampling_defaults"] == CARD_DEFAULTS
    h = live.health()
    assert h["sampling_defaults"] == CARD_DEFAULTS
    assert {
        "status",
        "model",
        "device",
        "kv_dtype",
        "kv_layout",
        "attention",
        "segments",
        "bank",
        "disk",
        "speculation",
        "deterministic",
    } <= set(h)
    # the CPU path is row-invariant whatever the flag (README, 'Determinism')
    assert h["deterministic"]["mode"] == "off" and h["deterministic"]["matmul"] == "cpu"
    assert h["status"] == "ok" and h["model"] == MODEL and h["kv_layout"] == "segmented"
    assert h["kv_dtype"] == "bfloat16"  # a CPU computing in fp32 stores bf16 rows (kv.cache.kv_dtype)
    assert set(h["attention"]) == {"route", "verdict", "reason", "selfcheck", "cpu_kernel"}
    assert h["attention"]["cpu_kernel"] == cpu_native.status()  # "ok" wherever a C compiler is found
    # the shared model is loaded dequantized (conftest); packed loads: tests/test_quant_default.py
    assert h["weights"] == {"held": "dequant", "note": "--weights dequant", "matmul": None}
    assert {"seals", "merges", "max_segments", "route_counts"} <= set(h["segments"])
    assert set(h["bank"]) == {
        "entries",
        "unique_bytes",
        "budget_bytes",
        "hits",
        "misses",
        "evictions",
        "refusals",
    }
    assert h["bank"]["budget_bytes"] == 1 << 30
    assert isinstance(h["disk"]["enabled"], bool)  # on by default; tests/test_disk_server.py
    assert set(h["disk"]) == {"enabled", "degraded", "restore_gbps", *DISK_KEYS}
    sp = h["speculation"]
    assert sp["mode"] == "auto" and {
        "drafted",
        "accepted",
        "windows",
        "tokens_per_forward",
        "dropped",
    } <= set(sp)
    assert set(sp["by_window"]) == {"<=2", "<=4", "<=8", "<=16", "<=32"}
    chat(c, [{"role": "user", "content": "One word please."}], max_tokens=2)
    live.idle()
    h2 = live.health()
    assert h2["segments"]["seals"] > h["segments"]["seals"]
    assert h2["bank"]["entries"] >= 1 and h2["bank"]["unique_bytes"] > 0
    m = httpx.get(live.url + "/metrics").text
    for name in (
        "turnkv_prefix_cache_hit_tokens_total",
        "turnkv_prefix_cache_query_tokens_total",
        "turnkv_kv_banked_bytes",
        "turnkv_kv_live_bytes",
        "turnkv_bank_evictions_total",
        "turnkv_kv_refusals_total",
        'turnkv_requests_total{route="/v1/chat/completions",status="200"}',
        "turnkv_time_to_first_token_seconds_bucket",
        "turnkv_time_per_output_token_seconds_bucket",
        "turnkv_attention_calls_total",
        "turnkv_speculation_drafted_tokens_total",
        "turnkv_speculation_accepted_tokens_total",
        "turnkv_speculation_windows_total",
        "turnkv_decode_forwards_total",
        "turnkv_speculation_dropped_windows_total",
        'turnkv_speculation_window_accepted_tokens_total{rows="<=32"}',
    ):
        assert name in m, name


# -- sampling defaults ---------------------------------------------------------------------------


def sampled(srv: Live, route: str = "/v1/chat/completions", **fields) -> dict:
    """One seeded answer of 16 tokens; ``fields`` add to (or, as None, null out) the body."""
    body = {"model": MODEL, "max_tokens": 16, "seed": 7, **fields}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Write one line about the sea."}]
    else:
        body["prompt"] = "A line about the sea:"
    r = srv.post(route, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice.get("text") or choice["message"]["content"], "usage": r.json()["usage"]}


def test_an_unset_temperature_takes_the_models_default_and_a_set_one_wins(live):
    for route in ("/v1/chat/completions", "/v1/completions"):
        unset = sampled(live, route)["text"]
        assert unset == sampled(live, route, temperature=0.2, top_p=0.9)["text"]  # the card's values
        assert unset == sampled(live, route, temperature=None, top_p=None)["text"]  # null is unset
        # OpenAI's defaults, what an unset field meant before: the same seed draws other tokens
        assert sampled(live, route, temperature=1.0, top_p=1.0)["text"] != unset
        assert (
            sampled(live, route, temperature=0)["text"] == sampled(live, route, temperature=0, seed=8)["text"]
        )


def test_serve_flags_override_the_models_defaults(loaded, live):
    srv = Live(loaded, temperature=0.0, max_tokens=3)
    try:
        card = srv.client().models.retrieve(MODEL).model_extra["sampling_defaults"]
        assert card["temperature"] == 0.0 and card["max_tokens"] == 3 and card["top_p"] == 0.9
        assert card["source"] == {
            "temperature": "flag",
            "top_p": "model",
            "top_k": "built-in",
            "max_tokens": "flag",
        }
        assert srv.health()["sampling_defaults"] == card
        greedy = sampled(live, temperature=0, max_tokens=3, ignore_eos=True)["text"]
        # unset: --temperature 0 and --max-tokens 3, whatever the seed; a request's own values win
        flagged = sampled(srv, max_tokens=None, seed=None, ignore_eos=True)
        assert flagged["text"] == greedy and flagged["usage"]["completion_tokens"] == 3
        assert sampled(srv, max_tokens=5, ignore_eos=True)["usage"]["completion_tokens"] == 5
        assert (
            sampled(srv, temperature=0.2, top_p=0.9, max_tokens=3)["text"]
            == sampled(live, max_tokens=3)["text"]
        )
    finally:
        srv.close()


def test_an_unset_max_tokens_is_the_documented_default_capped_by_the_context():
    lm = build_random_model("test", "cpu", "float32")  # small enough to decode 1024 tokens quickly
    srv = Live(lm)
    small = Live(lm, max_context=64)
    try:
        body = {"model": "random:test", "prompt": [5, 6, 7], "ignore_eos": True, "temperature": 0}
        r = srv.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS  # not 4096
        assert srv.health()["sampling_defaults"]["source"]["max_tokens"] == "built-in"
        assert srv.health()["sampling_defaults"]["temperature"] == 1.0  # no recommendation: OpenAI's
        r = small.post("/v1/completions", body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64 - 3, r.text
    finally:
        srv.close()
        small.close()


def test_turnkv_serve_process():
    """``python -m turnkv serve`` as a user starts it: flags, env twins, a request, the access log,
    and SIGTERM while a turn runs: it says what it waits for and exits within --shutdown-timeout."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TURNKV_BANK_BYTES": "64M", "TURNKV_SHUTDOWN_TIMEOUT": "2"}
    cmd = [sys.executable, "-m", "turnkv", "serve", "--port", str(port), "--device", "cpu", "--api-key", "k"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "turnkv serve did not come up"
            time.sleep(0.5)
        assert httpx.get(url + "/health").json()["bank"]["budget_bytes"] == 64 << 20
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        r = chat(c, [{"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.choices[0].message.content and r.usage.completion_tokens == 2
        # a long answer is streaming when SIGTERM comes
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "stream": True,
        }
        body |= {"max_tokens": 1000, "ignore_eos": True}
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer k"}, timeout=60
        ) as resp:
            lines = resp.iter_lines()
            while '"content":"' not in next(lines):
                pass
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            waited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    log = proc.stdout.read()
    assert f"turnkv: serving SmolLM2-135M-Instruct on http://127.0.0.1:{port}/v1" in log
    assert '"POST /v1/chat/completions" 200 prompt=' in log and "completion=2 finish=length" in log
    assert "turnkv: shutting down: waiting for 1 running turn (at most 2 s, --shutdown-timeout)" in log
    assert waited < 2 + 15, waited  # the bound plus the time to cancel the turn and exit
    assert "finish=cancelled" in log  # the stream ended at a token boundary, not by a killed task
    assert "Traceback" not in log, log

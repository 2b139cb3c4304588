"""Continuous batching through the real server (issue 9), on ``random:test`` weights (fast).

Pins: 8 conversations x 3 turns sent at once are all answered, reuse their history every turn, and
get the same greedy answers as the same conversations run one at a time (fp32 on the CPU: a
window's rows do not depend on the other windows of its step beyond fp32 matmul rounding, see
docs/SCHEDULER.md); a client that leaves mid-stream frees its slot and its rows are banked; a
turn that waits past --queue-timeout gets a 503 with Retry-After; /health.scheduler and the
batching series in /metrics are there.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from test_server import Live

from turnkv.models.load import build_random_model

pytestmark = pytest.mark.slow

MODEL = "random:test"
SYSTEM = {"role": "system", "content": "You are a random model."}


@pytest.fixture(scope="module")
def loaded():
    lm = build_random_model("test", "cpu", "float32")
    with torch.no_grad():  # weights larger than the default 0.02: clear maxima, stable greedy text
        lm.model.init_random(seed=3, std=0.2)
    return lm


def ask(client, messages: list[dict], max_tokens: int = 6):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def conversation(client, label: int, turns: int = 3) -> tuple[list[str], list[int]]:
    msgs = [SYSTEM]
    answers, cached = [], []
    for t in range(turns):
        msgs.append(
            {"role": "user", "content": f"conversation {label} turn {t}: " + "abcdef"[label % 6] * (5 + t)}
        )
        r = ask(client, msgs)
        answers.append(r.choices[0].message.content)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        msgs.append({"role": "assistant", "content": answers[-1]})
    return answers, cached


def at_once(live, n: int) -> dict[int, tuple]:
    """``conversation`` ``0..n-1``, each on its own client thread, all at once."""
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        results[i] = conversation(live.client(), i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def test_eight_conversations_at_once_match_the_same_conversations_one_at_a_time(loaded):
    serial = Live(loaded, max_running=1)
    try:
        alone = [conversation(serial.client(), i) for i in range(8)]
    finally:
        serial.close()
    batched = Live(loaded, max_running=8, max_batch_tokens="256")
    try:
        results = at_once(batched, 8)
        assert len(results) == 8
        h = batched.health()["scheduler"]
        assert h["steps"] > 0 and h["rows_per_step"] > 0
        assert h["threads"]["mode"] in ("auto", "fixed")
        m = httpx.get(batched.url + "/metrics").text
        for name in (
            "turnkv_queue_time_seconds_bucket",
            "turnkv_inter_token_latency_seconds_bucket",
            "turnkv_step_windows_bucket",
            "turnkv_step_tokens_bucket",
            "turnkv_time_to_first_token_seconds_bucket",
        ):
            assert name in m, name
        several = [line for line in m.splitlines() if line.startswith('turnkv_step_windows_bucket{le="1.0"}')]
        total = [line for line in m.splitlines() if line.startswith("turnkv_step_windows_count")]
        assert float(several[0].split()[-1]) < float(total[0].split()[-1])  # some steps held several turns
    finally:
        batched.close()
    for i in range(8):
        answers, cached = results[i]
        assert answers == alone[i][0], i
        assert cached[0] < cached[1] < cached[2]  # every follow-up restored its growing history


def test_the_server_running_ahead_answers_as_the_plain_step_loop(loaded):
    """--run-ahead on (on a CPU only the order of work changes): 8 conversations at once, greedy
    and seeded samples, streamed and not, get the answers of the plain loop; a stream the client
    leaves still frees its slot."""

    def serve(mode: str) -> tuple[dict, dict]:
        live = Live(loaded, max_running=8, max_batch_tokens="256", run_ahead=mode, speculate="off")
        try:
            results = at_once(live, 8)
            sampled = live.client().chat.completions.create(
                model=MODEL, messages=[SYSTEM, {"role": "user", "content": "sample"}], max_tokens=12,
                temperature=0.9, top_p=0.9, seed=11,
            )  # fmt: skip
            results[99] = (sampled.choices[0].message.content,)
            body = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": "go"}], "max_tokens": 500,
                    "stream": True, "temperature": 0}  # fmt: skip
            with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n > 6:
                        break  # the client leaves mid-answer
            live.idle()
            return results, live.health()["scheduler"]
        finally:
            live.close()

    plain, plain_health = serve("off")
    ahead, health = serve("on")
    assert health["run_ahead"]["enabled"] and health["run_ahead"]["steps"] > 0
    assert plain_health["run_ahead"] == {"enabled": False, "steps": 0}
    assert health["running"] == 0 and health["waiting"] == 0
    for i in (*range(8), 99):
        assert ahead[i][0] == plain[i][0], i


def test_a_client_leaving_mid_stream_frees_its_slot_and_its_rows_are_banked(loaded):
    live = Live(loaded, max_running=1)
    try:
        body = {
            "model": MODEL,
            "messages": [SYSTEM, {"role": "user", "content": "stream a long answer"}],
            "max_tokens": 2000,
            "stream": True,
            "temperature": 0,
        }
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data:")
                if lines >= 4:
                    break  # the client goes away with the answer unfinished
        # the one running slot is free again: a second request is answered
        r2 = ask(live.client(), [SYSTEM, {"role": "user", "content": "and now"}])
        assert r2.choices[0].finish_reason in ("stop", "length")
        live.idle()
        assert live.health()["bank"]["entries"] >= 2  # the cancelled turn's rows were banked too
    finally:
        live.close()


def test_a_turn_waiting_past_the_queue_timeout_gets_a_503_with_retry_after(loaded):
    per_row = 2 * 2 * 2 * 64 * 4  # random:test fp32: 2 layers x 2 KV heads x 64 dims, K and V
    # one turn fits; the timeout is short beside the first turn's 1400 tokens (0.55 s for 1000 on a
    # fast CI machine, so a 0.5 s timeout once let the second turn in)
    live = Live(loaded, max_running=8, bank_bytes=str(1600 * per_row), queue_timeout=0.1)
    try:
        long = {
            "model": MODEL,
            "messages": [SYSTEM, {"role": "user", "content": "x"}],
            "max_tokens": 1400,
            "temperature": 0,
            "ignore_eos": True,
        }
        first = threading.Thread(target=lambda: live.post("/v1/chat/completions", long))
        first.start()
        live_wait = 0
        while not live.health()["scheduler"]["running"] and live_wait < 200:
            live_wait += 1
            threading.Event().wait(0.02)
        r = live.post("/v1/chat/completions", long)  # fits once the first finishes: it waits, then 503
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"].isdigit()
        assert r.json()["error"]["code"] == "queue_timeout"
        first.join(timeout=120)
    finally:
        live.close()

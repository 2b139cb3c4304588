"""Faults in admission and in a step (issue 36, item 1), through the real server on ``random:test``.

A fault injected at each stage of a turn's life -- the context check, the bank's lookup, the
admission price, the new cache, the disk tier's ``has`` and ``get``, the step's stage, launch,
finalize and complete, a turn's window, sampler and detokenizer, the bank's finish -- ends that
request within a second: an internal fault with a 500 in the OpenAI error shape (a streaming
client: an error event, then ``[DONE]``), a disk tier that raised with the answer recomputed
(a miss; ``/health.disk`` says ``degraded`` and counts the fault). The next request is served
normally, no lease is left behind and ``/health``'s scheduler is back to nothing running or
waiting. A damaged ``index.sqlite`` under a running server is the same as a tier that raises.
Before the fix, a fault in admission (or in the disk tier's lookup) left its request without any
response: the turn had left the queue and never reached the running set.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field

import httpx
import pytest
from test_server import Live

import turnkv.engine.admission as admission
import turnkv.engine.chooser as chooser_mod
import turnkv.engine.turn as turn_mod
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.engine.stops import StopMatcher
from turnkv.models.load import build_random_model
from turnkv.tokenizer import StreamDecoder

pytestmark = pytest.mark.slow

MODEL = "random:test"
LIMIT_S = 1.0  # a faulty turn ends within this
WAIT_S = 5.0  # a request still unanswered after this hangs (the bug this file pins)
# a grammar that keeps a turn decoding for 20+ steps: the step after a constrained one is staged
# while the masks are filled (run-ahead), which is where ``Engine.stage`` runs
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "long",
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "string", "minLength": 20, "maxLength": 24}},
            "required": ["a"],
        },
    },
}


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 for i in range(n)]


LONG = 2 * B + 40  # two whole blocks: the disk tier is asked for them


def body(prompt: list[int], **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}


def post(srv: Live, payload: dict) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    try:
        r = httpx.post(srv.url + "/v1/completions", json=payload, timeout=WAIT_S)
    except httpx.TimeoutException:
        pytest.fail(f"no response within {WAIT_S:g} s: the turn hangs")
    return r, time.monotonic() - t0


def settled(srv: Live) -> dict:
    """``/health`` once the scheduler reports nothing running or waiting (within ``LIMIT_S``)."""
    deadline = time.monotonic() + LIMIT_S
    while True:
        h = srv.health()
        if h["scheduler"]["running"] == h["scheduler"]["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, f"the scheduler still reports {h['scheduler']}"
        time.sleep(0.02)


def events(r: httpx.Response) -> list[str]:
    return [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]


@dataclass
class Fault:
    """Where to inject (``where(server) -> (object, attribute)``), what it raises, the request."""

    name: str
    where: object
    request: dict = field(default_factory=dict)  # extra request fields
    tier: bool = False  # a disk tier fault: the answer is recomputed
    on_disk: bool = False  # the prompt's blocks are on disk, not in memory
    error: type[Exception] = RuntimeError
    leases: bool = True  # no lease may be left behind (not when the bank's own finish is the fault)


FAULTS = [
    Fault("context check", lambda s: (admission, "check_context")),
    Fault("bank lookup", lambda s: (s.server.bank, "lookup")),
    Fault("admission price", lambda s: (admission, "activation_bytes")),
    Fault("new cache", lambda s: (s.engine.layout, "new")),
    Fault(
        "disk lookup",
        lambda s: (s.server.bank.tier.disk.store, "run_length"),
        tier=True,
        error=sqlite3.DatabaseError,
    ),
    Fault(
        "disk get",
        lambda s: (s.server.bank.tier.disk.store, "get"),
        tier=True,
        on_disk=True,
        error=sqlite3.DatabaseError,
    ),
    Fault("window", lambda s: (turn_mod.Turn, "window")),
    Fault("stage", lambda s: (s.engine, "stage"), {"response_format": SCHEMA, "max_tokens": 40}),
    Fault("launch", lambda s: (s.engine, "run_step")),
    Fault(
        "finalize", lambda s: (s.server.worker.scheduler.pipeline.masks, "apply"), {"response_format": SCHEMA}
    ),
    Fault("complete", lambda s: (s.engine.speculation.cost, "observe")),
    # a sampled turn's rows are drawn on the device, in the step's finalize
    Fault("sampler", lambda s: (chooser_mod, "draw_rows"), {"temperature": 0.9, "seed": 5}),
    Fault("detokenizer", lambda s: (StreamDecoder, "push")),
    Fault("stop strings", lambda s: (StopMatcher, "push"), {"stop": ["zz"]}),
    Fault("bank finish", lambda s: (s.server.bank, "finish"), leases=False),
]


@pytest.fixture(scope="module")
def lm():
    return build_random_model("test", "cpu", "float32")


@pytest.fixture(scope="module")
def reference(lm):
    """Answers of a server without any cache and without run-ahead, by request."""
    srv = Live(lm, no_disk=True)
    memo: dict[str, dict] = {}

    def answer(payload: dict) -> dict:
        key = json.dumps(payload, sort_keys=True)
        if key not in memo:
            r, _ = post(srv, payload)
            assert r.status_code == 200, r.text
            memo[key] = r.json()
        return memo[key]

    yield answer
    srv.close()


# written to the disk tier by an earlier server: memory lacks them (one per variant of the test)
ON_DISK = {False: ids(LONG, 999), True: ids(LONG, 998)}


@pytest.fixture(scope="module")
def srv(lm, tmp_path_factory):
    """A server with run-ahead forced on (so ``Engine.stage`` runs) over a directory whose blocks
    an earlier server wrote."""
    disk = tmp_path_factory.mktemp("kv")
    first = Live(lm, disk_dir=str(disk))
    for prompt in ON_DISK.values():
        r, _ = post(first, body(prompt))
        assert r.status_code == 200, r.text
    first.idle()
    first.close()  # drains the write queue
    s = Live(lm, disk_dir=str(disk), run_ahead="on")
    yield s
    s.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_a_fault_at_any_stage_ends_the_turn_and_the_next_is_served(
    srv, reference, monkeypatch, fault, stream
):
    seed = 10 * FAULTS.index(fault) + stream
    prompt = ON_DISK[stream] if fault.on_disk else ids(LONG, seed)
    payload = body(prompt, **fault.request, stream=stream)
    bank = srv.server.bank
    faults = srv.health()["disk"].get("faults", 0)
    fired: list[str] = []

    def broken(*args, **kwargs):
        fired.append(fault.name)
        raise fault.error(f"injected fault: {fault.name}")

    with monkeypatch.context() as mp:
        mp.setattr(*fault.where(srv), broken)
        r, took = post(srv, payload)
    assert fired, "the fault was never reached: the test would prove nothing"
    assert took < LIMIT_S, f"the turn took {took:.2f} s to end"
    h = settled(srv)
    want = reference(body(prompt, **fault.request))
    if fault.tier:  # a miss: recomputed, the same answer
        assert r.status_code == 200, r.text
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events(r)[:-1]) if stream else None
        got = text if stream else r.json()["choices"][0]["text"]
        assert got == want["choices"][0]["text"]
        if not stream:
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert "DatabaseError" in h["disk"]["degraded"] and h["disk"]["faults"] > faults
    elif stream and r.headers["content-type"].startswith("text/event-stream"):
        lines = events(r)  # failed after the stream began: an error event, then the end
        assert lines[-1] == "[DONE]", r.text
        err = json.loads(lines[-2])["error"]
        assert err["code"] == "internal_error" and f"injected fault: {fault.name}" in err["message"]
    else:
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert {"message", "type", "code"} <= set(err) and err["type"] == "server_error"
        assert err["code"] == "internal_error" and f"injected fault: {fault.name}" in err["message"]
    assert h["status"] == "ok"
    if fault.leases:
        assert bank.unique_bytes(live=True) == bank.unique_bytes(live=False)  # no lease left behind
    # the next request is served normally (the same prompt: what a client retries)
    r, _ = post(srv, body(prompt, **fault.request))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    settled(srv)


def test_a_damaged_index_under_a_running_server_is_a_miss_and_the_prompt_is_recomputed(
    lm, reference, tmp_path
):
    """The attack of issue 36: ``index.sqlite`` overwritten with garbage while a server runs over a
    directory that holds blocks. Every long prompt is answered (recomputed), ``/health`` says the
    tier is degraded, and short prompts are unaffected."""
    stored = ids(LONG, 4242)
    first = Live(lm, disk_dir=str(tmp_path))
    assert post(first, body(stored))[0].status_code == 200
    first.idle()
    first.close()
    srv = Live(lm, disk_dir=str(tmp_path))
    try:
        index = tmp_path / "index.sqlite"
        with open(index, "r+b") as f:
            f.write(b"this is not a database!!" * 8)
        # SQLite's page cache hides the damage from an open connection until the WAL index
        # changes; zeroing its header makes the connection read the file again, as it will
        with open(tmp_path / "index.sqlite-shm", "r+b") as f:
            f.write(bytes(136))
        for prompt in (stored, ids(LONG, 4343), ids(LONG, 4242 + 1)):
            r, took = post(srv, body(prompt))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference(body(prompt))["choices"][0]["text"]
            assert took < LIMIT_S
        short = body(ids(20, 5))
        assert post(srv, short)[0].json()["choices"][0]["text"] == reference(short)["choices"][0]["text"]
        h = settled(srv)
        disk = h["disk"]
        assert h["status"] == "ok" and disk["enabled"] is True
        # the restore of the stored prompt read the broken index (a fault); the other lookups answer
        # from the keys in memory, and a miss there does not clear the reason
        assert "file is not a database" in disk["degraded"] and disk["faults"] >= 1
        assert disk["hits"] == 0 and disk["misses"] >= 3
    finally:
        srv.close()
    assert os.path.exists(index)  # the tier never deletes its index (rebuilding it is start-up's job)

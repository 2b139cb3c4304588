"""A fuzz of malformed and hostile requests through a real uvicorn server (issue 7, Tests).

At least 300 requests: invalid JSON, wrong types in every field, extreme numbers, huge strings and
headers, bad methods and paths, and clients that disconnect mid-body or send a malformed chunked
body. Every answer must be a 4xx in the OpenAI shape (or a 200 for the few valid ones), never a
5xx; no traceback may reach the log; and the server must still answer afterwards.
"""

from __future__ import annotations

import json
import random
import socket
import time

import httpx
import pytest
from test_server import MODEL, Live
from test_server_hardening import Records, statuses

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"content-type": "application/json"}  # the JSON routes answer 415 to any other body
BASE = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}

WRONG = ["x", "", 7, -1, 0, 2.5, True, None, [], [1], {}, {"a": 1}, 10**40, -(10**40), 1e308, "1" * 300]
FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "logit_bias",
    "ignore_eos",
    "presence_penalty",
    "cache_salt",
    "logprobs",
    "tools",
    "response_format",
]
EXTREME = {
    "max_tokens": [0, -1, 2**31, 2**63, 2**64 + 1, 10**100],
    "temperature": [5e-324, 1e-310, 1e-45, 2.0000001, -0.0, 1e308],
    "top_p": [5e-324, 1e-45, 1.0000001, -5e-324],
    "top_k": [-2, 2**63, 10**30],
    "seed": [2**64, -(2**63) - 1, 2**64 - 1, -(2**63)],
    "logit_bias": [{"0": 100}, {"0": -100}, {str(2**70): 1}, dict.fromkeys(map(str, range(2000)), 1.0)],
    "stop": [["a"] * 5, "x" * 100_000, [""], ["\u0000"]],
}


def bad_json(r: random.Random) -> list[bytes]:
    valid = json.dumps(BASE).encode()
    out = [valid[: r.randint(1, len(valid) - 1)] for _ in range(20)]  # truncated at random points
    out += [bytes(r.randrange(256) for _ in range(r.randint(1, 200))) for _ in range(15)]  # noise
    out += [
        b"",
        b" ",
        b"null",
        b"[]",
        b"1",
        b'"x"',
        b"\xef\xbb\xbf" + valid,  # a BOM
        valid + b"garbage",
        valid.replace(b'"Hi"', b'"\\ud800"'),  # a lone surrogate
        valid.replace(b"0}", b"NaN}"),
        valid.replace(b"0}", b"Infinity}"),
        valid.replace(b"0}", b"1e999999}"),
        b"[" * 100_000,
        b'{"a":' * 50_000,
        b'{"model": "x", "model": 5}',
        valid.replace(b"Hi", b"\xff\xfe"),  # not UTF-8
    ]
    return out


def wrong_types() -> list[tuple[str, dict]]:
    cases = [(CHAT, {**BASE, f: v}) for f in FIELDS for v in WRONG]
    cases += [(CHAT, {**BASE, "messages": [m]}) for m in [*WRONG, {"role": "user"}, {"content": "x"}]]
    cases += [
        (COMPLETIONS, {"model": MODEL, "prompt": p, "max_tokens": 1}) for p in [*WRONG, [[1, 2], [3]], [-5]]
    ]
    return cases


def extreme() -> list[tuple[str, dict]]:
    return [(CHAT, {**BASE, f: v}) for f, vs in EXTREME.items() for v in vs]


def huge() -> list[tuple[str, dict, dict]]:
    big = "lantern " * 40_000  # 320 KB: under the body limit, over the context
    return [
        (CHAT, {**BASE, "messages": [{"role": "user", "content": big}]}, {}),
        (COMPLETIONS, {"model": MODEL, "prompt": big, "max_tokens": 1}, {}),
        (COMPLETIONS, {"model": MODEL, "prompt": list(range(9000)), "max_tokens": 1}, {}),
        (CHAT, {**BASE, "model": "m" * 200_000}, {}),
        (CHAT, {**BASE, "messages": [{"role": "user", "content": "Hi"}] * 20_000}, {}),
        (CHAT, BASE, {"x-session-id": "s" * 8000}),
        (CHAT, BASE, {"authorization": "Bearer " + "k" * 8000}),
        (CHAT, BASE, {f"x-h{i}": "v" * 100 for i in range(100)}),
        (CHAT, BASE, {"content-type": "text/plain"}),
        (CHAT, BASE, {"content-encoding": "gzip"}),
    ]


def methods_and_paths() -> list[tuple[str, str]]:
    out = [(m, p) for m in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS") for p in (CHAT, COMPLETIONS)]
    out += [(m, p) for m in ("POST", "PUT", "DELETE") for p in ("/health", "/metrics", "/v1/models")]
    out += [
        ("GET", p)
        for p in ("/", "/v1", "/v1/", "//v1/models", "/v1/models/", "/v1/models/%00", "/v1/../etc/passwd")
    ]
    out += [
        ("GET", "/v1/models/" + "a" * 5000),
        ("GET", "/" + "x" * 7000),
        ("GET", "/health?x=" + "y" * 5000),
    ]
    out += [("GET", "/v1/models/\u00e9\u4e2d"), ("POST", "/v1/chat/completions/extra"), ("HEAD", "/health")]
    return out


def raw_requests() -> list[bytes]:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    body = json.dumps(BASE).encode()
    return [
        head + b"Content-Length: 1000\r\n\r\n" + body[:20],  # the client leaves mid-body
        head + b"Content-Length: 1000\r\n\r\n",
        head + b"Transfer-Encoding: chunked\r\n\r\n10\r\n" + body[:8],
        head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        head + b"Transfer-Encoding: chunked\r\n\r\n-5\r\nabc\r\n0\r\n\r\n",
        head + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\nabc\r\n",
        head + b"Content-Length: -1\r\n\r\n" + body,
        head + b"Content-Length: abc\r\n\r\n" + body,
        head + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n" + body,
        head + b"Content-Length: 99999999999999999999\r\n\r\n" + body,
        head + b"Content-Length: 4\r\n\r\n" + body,  # shorter than what follows
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/9.9\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(50),  # a TLS hello
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n",
    ]


def send_raw(port: int, data: bytes) -> bytes:
    """Send, then read what comes back within a moment, and close (leaving mid-body if it was)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            s.settimeout(0.5)
            return s.recv(4096)
        except OSError:
            return b""


@pytest.fixture(scope="module")
def srv(default_model):
    s = Live(default_model, max_context=512)
    yield s
    s.close()


def test_fuzz_no_5xx_and_no_traceback(srv):
    r = random.Random(7)
    answers: list[tuple[object, int]] = []
    with Records().attached() as records, httpx.Client(base_url=srv.url, headers=JSON, timeout=60) as client:
        for raw in bad_json(r):
            answers.append((raw[:60], client.post(CHAT, content=raw).status_code))
        for route, b in wrong_types() + extreme():
            answers.append((b, client.post(route, json=b).status_code))
        for route, b, headers in huge():
            answers.append((route, client.post(route, json=b, headers=headers).status_code))
        for method, path in methods_and_paths():
            answers.append((path[:60], client.request(method, path, json=BASE).status_code))
        for data in raw_requests():
            reply = send_raw(srv.port, data)
            status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
            answers.append((data[:60], status))
        srv.idle()
        time.sleep(0.3)
    assert len(answers) >= 300, len(answers)
    assert not [(what, status) for what, status in answers if status >= 500], "5xx answers"
    assert not [k for k in statuses(srv) if 'status="5' in k], statuses(srv)
    assert not records.tracebacks(), "\n".join(records.tracebacks()[:5])
    ok = httpx.post(srv.url + CHAT, json={**BASE, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and srv.health()["status"] == "ok"

"""Time to ready and the first request after it, cold and warm Triton cache, against no warm-up.

    python bench/startup_gpu.py [--shape llama3-8b] [--cases cold,warm,off] [--out DIR]

Each case is a fresh ``turnkv serve --model random:SHAPE --device cuda`` process over HTTP, with
its own ``XDG_CACHE_HOME`` (so the Triton cache, which defaults under it, starts empty for
``cold`` and ``off``; ``warm`` reuses ``cold``'s) and ``TRITON_CACHE_DIR`` unset:

- ``cold``: empty cache, warm-up on (the default); ``warm``: the cache ``cold`` filled;
- ``off``: empty cache, ``--warmup off`` (turnkv before issue 30: ready before anything compiled).

Per case: seconds to listening and to ``/health`` ok, the startup line's split (load, self-check,
warm-up), the TTFT of the first request after ready (a ~3.3K-token user message, one answer token) and of a
second one like it (the warm TTFT), then a mixed workload (``mixed``: 16 staggered
clients, two rounds each (answers of 16-48 tokens), documents of 200-3300 tokens or short
questions, 150-token follow-ups, greedy, sampled, grammar and logprob rows, then one client alone)
and ``/health``'s ``jit_after_ready`` (with ``jit_late``: what compiled) and ``graph_misses``
(steps run eagerly because the warm-up did not capture their graph) after it. Prints a table, writes JSON (and a PNG where matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


class ServeProcess:
    """``turnkv serve`` in a child process, with its start-up timed from the spawn."""

    def __init__(self, model: str, cache: str, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
        env |= {
            "XDG_CACHE_HOME": cache,
            "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        }
        cmd = [sys.executable, "-m", "turnkv", "serve", "--model", model, "--port", str(self.port), *flags]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.listening_s = self.ready_s = None
        self.statuses: list[str] = []  # /health's status while starting, in order, without repeats

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())

    def wait_ready(self, timeout: float = 240) -> float:
        while True:
            assert self.proc.poll() is None, "\n".join(self.lines[-40:])
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if self.listening_s is None:
                    self.listening_s = time.perf_counter() - self.t0
                status = r.json().get("status")
                if not self.statuses or self.statuses[-1] != status:
                    self.statuses.append(status)
                if r.status_code == 200:
                    self.ready_s = time.perf_counter() - self.t0
                    return self.ready_s
            except httpx.TransportError:
                pass
            assert time.perf_counter() - self.t0 < timeout, "not ready in time:\n" + "\n".join(
                self.lines[-40:]
            )
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def startup_line(self) -> str:
        return next((x for x in self.lines if "ready in" in x), "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def stream(url: str, messages: list[dict], max_tokens: int, **extra) -> tuple[float, str]:
    """(seconds, answer text) of one chat completion answered to its length; with ``max_tokens``
    1 the seconds are its time to first token. Not streamed: a random-weight model's tokens are
    mostly ids its byte-level tokenizer decodes to nothing, so a stream may carry no text at all.
    ``extra``: more fields of the body (sampling, ``response_format``)."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0, r.json()["choices"][0]["message"]["content"] or ""


def document(rng: random.Random, n: int) -> str:
    """About ``n`` tokens of text (the random-weight models' tokenizer is byte-level)."""
    return "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(n))


# the kinds of rows the mixed workload's clients ask for, in turn: greedy, sampled, a JSON grammar
# (masked rows), greedy with logprobs
KINDS = (
    {},
    {"temperature": 0.8, "top_p": 0.9, "seed": 3},
    {"response_format": {"type": "json_object"}},
    {"logprobs": True, "top_logprobs": 2},
)


def mixed(url: str, clients: int = 16, seed: int = 0) -> dict:
    """Staggered clients, two rounds each (answers of 16-48 tokens): a document (or a short
    question, every fifth client), then a follow-up on the same history; their rows greedy,
    sampled, grammar-masked or with logprobs (``KINDS``), so prefill chunks ride beside decode rows
    of every kind at many batch sizes. Then one client alone with a longer answer (decode and
    verify windows of a lone conversation: the solo graphs)."""
    errors: list[str] = []

    def client(i: int, delay: float, answers: tuple[int, ...]) -> None:
        rng = random.Random(seed * 1000 + i)
        time.sleep(delay)
        size = rng.randint(10, 60) if i % 5 == 4 else rng.randint(200, 3300)
        messages = [{"role": "user", "content": document(rng, size)}]
        try:
            for _ in range(2):
                _, text = stream(url, messages, rng.choice(answers), **KINDS[i % len(KINDS)])
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": document(rng, 150)},
                ]
        except Exception as exc:  # counted, reported
            errors.append(f"client {i} ({KINDS[i % len(KINDS)] or 'greedy'}): {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(i, i * 0.15, (16, 32, 48))) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client(clients, 0.0, (96,))  # alone
    return {"clients": clients + 1, "seconds": round(time.perf_counter() - t0, 2), "errors": errors}


def run_case(name: str, model: str, cache: str, flags: list[str]) -> dict:
    srv = ServeProcess(model, cache, "--device", "cuda", "--no-disk", *flags)
    try:
        return measure(name, srv)
    finally:
        srv.stop()


def measure(name: str, srv: ServeProcess) -> dict:
    """Ready, then the first and second ~3.3K-token requests' TTFT, then ``mixed``."""
    ready = srv.wait_ready()
    rng = random.Random(7)
    first, _ = stream(srv.url, [{"role": "user", "content": document(rng, 3300)}], 1)
    second, _ = stream(srv.url, [{"role": "user", "content": document(rng, 3300)}], 1)
    work = mixed(srv.url)
    sched = srv.health()["scheduler"]
    return {
        "case": name,
        "listening_s": round(srv.listening_s, 2),
        "ready_s": round(ready, 2),
        "statuses": srv.statuses,
        "startup_line": srv.startup_line(),
        "first_ttft_s": round(first, 3),
        "warm_ttft_s": round(second, 3),
        "ratio": round(first / second, 2),
        "mixed": work,
        "jit_after_ready": sched.get("jit_after_ready"),
        "jit_late": sched.get("jit_late"),
        "graph_misses": sched.get("graph_misses"),
        "graphs": sched.get("graphs"),
        "warmup": sched.get("warmup"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--cases", default="cold,warm,off")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--warm-cache", help="a cache home an earlier start filled (default: cold's)")
    args = ap.parse_args()
    model = f"random:{args.shape}"
    results = []
    with tempfile.TemporaryDirectory() as base:
        warm = args.warm_cache or tempfile.mkdtemp(dir=base)  # cold fills it, warm reuses it
        for case in args.cases.split(","):
            cache = warm if case in ("cold", "warm") else tempfile.mkdtemp(dir=base)
            flags = ["--warmup", "off"] if case == "off" else []
            results.append(run_case(case, model, cache, flags))
            print(json.dumps(results[-1]), flush=True)
            Path(args.out, "startup_gpu.json").write_text(
                json.dumps({"model": model, "results": results}, indent=1)
            )
    print(
        "| case | listening | ready | first TTFT | warm TTFT | ratio | jit after ready | graph misses | startup line |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in results:
        line = r["startup_line"].split("ready in ")[-1]
        misses = (r.get("graph_misses") or {}).get("steps")
        print(
            f"| {r['case']} | {r['listening_s']} s | {r['ready_s']} s | {r['first_ttft_s']} s | {r['warm_ttft_s']} s "
            f"| {r['ratio']}x | {r['jit_after_ready']} | {misses} of {(r.get('graphs') or {}).get('replays')} replays "
            f"| {line} |"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    names = [r["case"] for r in results]
    ax.bar(names, [r["ready_s"] for r in results], label="time to ready (s)")
    ax.bar(
        names,
        [r["first_ttft_s"] for r in results],
        bottom=[r["ready_s"] for r in results],
        label="first TTFT (s)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(args.out, "startup_gpu.png"))


if __name__ == "__main__":
    main()

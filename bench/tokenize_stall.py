"""Does tokenizing a large prompt stall other work? (issue 7, item 4)

The server renders and tokenizes prompts in the HTTP handler's thread pool, so the event loop and
the engine thread go on. That only helps if the tokenizer releases the GIL while it works. Two
variants in one process: ``encode`` (the HF tokenizer's call, which holds the GIL) and
``encode_batch`` (what turnkv ships). Two measurements:

1. threads: how many times a Python thread gets to run (a counting loop) while the tokenizer
   encodes ``--text-kb`` of text, against the same wall time idle;
2. server: on one live server (uvicorn in a thread, the default model), "Hi" (max_tokens 1)
   alone, then while a ``--body-kb`` chat body is being handled (over the context: it is
   tokenized in full, then refused with a 400).

    python bench/tokenize_stall.py --text-kb 2048 --body-kb 640 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from report import save

from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.runtime import build, load_engine
from turnkv.server.app import create_app

HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}


def serve(engine: Engine, cfg: EngineConfig) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(build(cfg, "serve", engine=engine)), port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}/v1/chat/completions"


def hi_latency(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url, json=HI, timeout=300)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def measure(url: str, big: bytes, repeats: int) -> dict:
    alone = [hi_latency(url) for _ in range(repeats)]
    during, big_s = [], []
    for _ in range(repeats):
        done = threading.Event()

        def send_big(done: threading.Event = done) -> None:
            t0 = time.perf_counter()
            httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=300)
            big_s.append(time.perf_counter() - t0)
            done.set()

        threading.Thread(target=send_big).start()
        time.sleep(0.15)  # the big body has arrived and is being tokenized
        during.append(hi_latency(url))
        done.wait()
    return {
        "hi_alone_s": statistics.median(alone),
        "hi_during_big_s": statistics.median(during),
        "hi_during_big_max_s": max(during),
        "big_s": statistics.median(big_s),
    }


def thread_share(encode, text: str) -> tuple[float, float]:
    """(seconds the encode took, iterations another thread ran then / iterations it runs idle)."""
    spins = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            spins[0] += 1
            time.sleep(0)

    t = threading.Thread(target=spin)
    t.start()
    t0 = time.perf_counter()
    encode(text)
    took = time.perf_counter() - t0
    during = spins[0]
    spins[0] = 0
    time.sleep(took)
    idle = spins[0]
    stop.set()
    t.join()
    return took, during / max(idle, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text-kb", type=int, default=2048)
    ap.add_argument("--body-kb", type=int, default=640)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    cfg = EngineConfig(device="cpu", bank_bytes="1G", access_log=False)
    engine = load_engine(cfg, progress=False)
    backend = engine.tokenizer.backend
    text = "river stone lantern copper meadow " * (args.text_kb * 1024 // 34)
    threads = {
        "encode": thread_share(lambda t: backend.encode(t, add_special_tokens=False), text),
        "encode_batch": thread_share(lambda t: backend.encode_batch([t], add_special_tokens=False), text),
    }
    server, url = serve(engine, cfg)
    words = "river stone lantern copper "
    big = json.dumps({"messages": [{"role": "user", "content": words * (args.body_kb * 1024 // len(words))}]})
    tok, rows = engine.tokenizer, {}
    ship = tok.backend.encode_batch
    for variant in ("encode", "encode_batch"):

        def one(texts, add_special_tokens=False, _v=variant):
            return (
                [tok.backend.encode(texts[0], add_special_tokens=add_special_tokens)]
                if _v == "encode"
                else ship(texts, add_special_tokens=add_special_tokens)
            )

        tok.backend = _Backend(tok.backend, one)
        rows[variant] = measure(url, big.encode(), args.repeats)
        tok.backend = tok.backend.inner
    server.should_exit = True
    print(
        f"# {engine.model_name}: {len(text) // 1024} KB of text; a {len(big) // 1024} KB chat body, {args.repeats} repeats (medians)"
    )
    print(
        f"{'variant':>12} | encode | other thread ran | Hi alone | Hi during the big body | worst | big body"
    )
    for name, r in rows.items():
        took, share = threads[name]
        r.update(encode_s=took, other_thread_share=share)
        print(
            f"{name:>12} | {took:5.2f}s | {share:15.1%} | {r['hi_alone_s']:7.3f}s | {r['hi_during_big_s']:21.3f}s"
            f" | {r['hi_during_big_max_s']:.3f}s | {r['big_s']:.3f}s"
        )
    save(
        {"text_bytes": len(text), "body_bytes": len(big), "repeats": args.repeats, "rows": rows},
        "tokenize_stall",
        _plot,
    )


class _Backend:
    """The tokenizer backend with ``encode_batch`` replaced (everything else passes through)."""

    def __init__(self, inner, encode_batch) -> None:
        self.inner = inner
        self.encode_batch = encode_batch

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _plot(results: dict, plt, path: Path) -> None:
    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(rows)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [rows[n]["hi_alone_s"] for n in names], 0.4, label="Hi alone")
    ax.bar(
        [i + 0.2 for i in x], [rows[n]["hi_during_big_s"] for n in names], 0.4, label="Hi during a big body"
    )
    ax.set_xticks(list(x), names)
    ax.set_ylabel("seconds (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()

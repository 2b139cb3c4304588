"""The same multi-turn HTTP workload through 1 replica, N with affinity and N round-robin, one run.

``--conversations`` conversations of ``--turns`` turns each, sent by ``--clients`` concurrent
clients (a client takes the next conversation's next turn), each turn streaming with usage; every
conversation starts with its own system prompt of about ``--system-words`` words and resends its
whole history, as OpenAI clients do. Variants, on one local Ray instance (each deployed and torn
down in turn, a fresh shared block store each):

- ``1 replica``: one turnkv server behind the Ray Serve front (the reference);
- ``N affinity``: N replicas, ``serve_router.AffinityRouter`` (longest chain prefix);
- ``N round-robin``: N replicas, the same router cycling through them (what a router that knows
  nothing of conversations does), over the shared store (a follow-up restores from it);
- ``N rr, no store``: round-robin with each replica's bank alone (``--no-disk``).

Per variant: output tok/s (completion tokens over wall time), TTFT p50/p99 at the client, the
cached fraction of follow-ups (cached / prompt tokens, turns after the first), and the router's
overhead per request: the front's route computation (``route_of``) and the router's decision
(``AffinityRouter.choose_replicas``), p50/p99 from ``/health.router``. For the N-affinity variant
also the whole endpoint's cost per request over calling a replica directly (``--probe`` rounds):
each conversation's last request, made invalid (``max_tokens: 0``, a 400 from the replica's
validation, so the model does not hide the routing) is sent through the endpoint (HTTP proxy,
front, route, router, replica) and straight to a replica's ``forward`` through a Serve handle
from this process (no front, no affinity decision), interleaved; p50/p99 of each and their
difference.

    python bench/replicas.py                        # default model on the CPU, 2 replicas
    python bench/replicas.py --replicas 2 --device cuda --model random:llama3-8b

Prints a table, writes ``bench/out/replicas.json`` and ``bench/out/replicas.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

import httpx
import ray
from ray import serve
from report import save

from turnkv.config import EngineConfig
from turnkv.serve_ray import app


def workload(base: str, conversations: int, turns: int, clients: int, words: int, answer: int) -> dict:
    convs = [
        [
            {
                "role": "system",
                "content": f"Assistant {i}. " + " ".join(f"fact {i}.{j}" for j in range(words // 2)),
            }
        ]
        for i in range(conversations)
    ]
    todo = [(t, c) for t in range(turns) for c in range(conversations)]  # interleaved turns
    lock = threading.Lock()
    rows: list[dict] = []
    busy: set[int] = set()

    def client() -> None:
        with httpx.Client(base_url=base, timeout=600) as http:
            while True:
                with lock:
                    job = next(((t, c) for t, c in todo if c not in busy), None)
                    if job is None:
                        if not todo:
                            return
                    else:
                        todo.remove(job)
                        busy.add(job[1])
                if job is None:
                    time.sleep(0.01)
                    continue
                t, c = job
                msgs = convs[c]
                msgs.append({"role": "user", "content": f"Question {t} about {c}?"})
                body = {"model": "default", "messages": msgs, "max_tokens": answer, "temperature": 0}
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                t0 = time.perf_counter()
                ttft, text, usage = None, [], None
                with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if ev.get("usage"):
                            usage = ev["usage"]
                        for ch in ev.get("choices", ()):
                            if ch["delta"].get("content"):
                                ttft = ttft or time.perf_counter() - t0
                                text.append(ch["delta"]["content"])
                msgs.append({"role": "assistant", "content": "".join(text)})
                with lock:
                    busy.discard(c)
                    rows.append({"turn": t, "ttft": ttft or time.perf_counter() - t0, "usage": usage})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    follow = [r for r in rows if r["turn"] > 0]
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in follow)
    prompt = sum(r["usage"]["prompt_tokens"] for r in follow)
    ttfts = sorted(r["ttft"] for r in rows)
    out = sum(r["usage"]["completion_tokens"] for r in rows)
    return convs, {
        "requests": len(rows),
        "out_tok_s": out / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "cached_fraction": cached / max(prompt, 1),
        "wall_s": wall,
    }


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def probe(base: str, convs: list[list[dict]], rounds: int) -> dict:
    """ms per request through the endpoint and straight to a replica (see the module docstring)."""
    handle = serve.get_deployment_handle("turnkv-replica", app_name="turnkv").options(stream=True)
    bodies = [json.dumps({"model": "default", "messages": c, "max_tokens": 0}).encode() for c in convs]
    headers = [("host", "127.0.0.1"), ("content-type", "application/json")]
    via, direct = [], []
    with httpx.Client(base_url=base, timeout=60) as http:
        for i in range(rounds * len(bodies)):
            body = bodies[i % len(bodies)]
            t0 = time.perf_counter()
            r = http.post("/v1/chat/completions", content=body, headers=dict(headers))
            via.append(time.perf_counter() - t0)
            assert r.status_code == 400, r.text
            req = {"method": "POST", "path": "/v1/chat/completions", "query": "", "headers": headers}
            t0 = time.perf_counter()
            head, *_ = list(handle.forward.remote(req | {"body": body}, {"nth": i}))
            direct.append(time.perf_counter() - t0)
            assert head["status"] == 400, head
    row = {"requests": len(via)}
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        row |= {
            f"endpoint_{name}_ms": 1000 * quantile(via, q),
            f"direct_{name}_ms": 1000 * quantile(direct, q),
        }
        row[f"extra_{name}_ms"] = row[f"endpoint_{name}_ms"] - row[f"direct_{name}_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=5)  # odd: round-robin alternates replicas
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--probe", type=int, default=40, help="rounds over the conversations (0: no probe)")
    a = ap.parse_args()
    gpus = 1 if a.device.startswith("cuda") else 0
    ray.init(include_dashboard=False, logging_level="error")
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    results = {"args": vars(a), "variants": {}}
    for name, n, policy in [
        ("1 replica", 1, "affinity"),
        (f"{a.replicas} affinity", a.replicas, "affinity"),
        (f"{a.replicas} round-robin", a.replicas, "round_robin"),
        (f"{a.replicas} rr, no store", a.replicas, "round_robin"),
    ]:
        store = tempfile.mkdtemp(prefix="turnkv-bench-store-")
        threads = 1 if gpus == 0 else 0
        cfg = EngineConfig(model=a.model, device=a.device, threads=threads, disk_store=f"dir:{store}")
        if "no store" in name:  # each replica its bank only: what round-robin costs without sharing
            cfg = EngineConfig(model=a.model, device=a.device, threads=threads, no_disk=True)
        serve.run(app(cfg, n, gpus, policy), name="turnkv", route_prefix="/")
        base = f"http://127.0.0.1:{a.port}"
        convs, row = workload(base, a.conversations, a.turns, a.clients, a.system_words, a.answer_tokens)
        if name.endswith("affinity") and a.probe:
            row["probe"] = probe(base, convs, a.probe)
        row["router"] = httpx.get(base + "/health", timeout=60).json()["router"]
        results["variants"][name] = row
        serve.delete("turnkv")
        print(f"{name}: {row}", flush=True)
    serve.shutdown()
    ray.shutdown()
    one = results["variants"]["1 replica"]
    print(
        f"\n{'variant':<18}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'cached':>8}"
        f"{'route p50/p99':>16}{'decide p50/p99':>16}"
    )
    for name, r in results["variants"].items():
        rt = r["router"]
        print(
            f"{name:<18}{r['out_tok_s']:>10.1f}{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p99_ms']:>8.0f}ms"
            f"{r['cached_fraction']:>8.3f}{rt['route_p50_ms'] or 0:>8.3f}/{rt['route_p99_ms'] or 0:.3f}ms"
            f"{rt['decide_p50_ms'] or 0:>8.3f}/{rt['decide_p99_ms'] or 0:.3f}ms"
            f"   x{r['out_tok_s'] / one['out_tok_s']:.2f} tok/s ({rt['decisions']} decisions)"
        )
    for name, r in results["variants"].items():
        if pr := r.get("probe"):
            print(
                f"\n{name}, {pr['requests']} invalid requests (400): endpoint p50 {pr['endpoint_p50_ms']:.2f} ms,"
                f" p99 {pr['endpoint_p99_ms']:.2f} ms; straight to a replica p50 {pr['direct_p50_ms']:.2f} ms,"
                f" p99 {pr['direct_p99_ms']:.2f} ms; the endpoint's extra p50 {pr['extra_p50_ms']:.2f} ms,"
                f" p99 {pr['extra_p99_ms']:.2f} ms"
            )
    save(results, "replicas", plot)


def plot(results: dict, plt, path) -> None:
    names = list(results["variants"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in zip(
        axes,
        ("out_tok_s", "ttft_p50_ms", "cached_fraction"),
        ("out tok/s", "TTFT p50 (ms)", "cached fraction"),
        strict=False,
    ):
        ax.bar(names, [results["variants"][n][key] for n in names])
        ax.set_title(label)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()

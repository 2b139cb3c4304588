"""Conversations under load through a real ``turnkv serve``: the prompt budget's trade between
first turns, follow-ups and inter-token latency (issue 30).

Per variant (``--variants``: ``auto`` or a row count, each a ``--max-batch-tokens``), a fresh
``turnkv serve`` process (``startup_gpu.ServeProcess``: its time to ready measured from the
spawn; the Triton cache is shared by the variants, the KV disk tier is each one's own) is driven
over HTTP by ``--clients`` concurrent streaming ``openai`` clients, closed loop: each client holds
one conversation of ``--rounds`` rounds -- a shared system prompt of ``--system-tokens``, a first
user message of ``--doc-tokens`` (a document), follow-ups of ``--user-tokens``, answers of
``--answer-tokens`` (``ignore_eos``) -- and sends its next round when the answer is in; with
``--stagger S`` client ``i`` starts ``i * S`` seconds late, so first turns keep arriving beside
the others' follow-ups (issue 31: follow-ups behind first turns).

Reports out tok/s, TTFT of first and follow-up turns (p50/p99), ITL p50/p99 (the gaps between a
stream's chunks: one token each), kernels compiled or graphs captured during the measured pass
(``jit_during``: ``/health``'s ``jit_after_ready``; ``--warm-passes`` runs the load first over
other documents, so that what the warm-up missed is compiled before), prefill tok/s under load (prompt rows computed, i.e. not
cached, over the run), host ms per step with prompt rows and per decode step, graph replays (and
those of steps with prompt rows), the cached fraction of prompt tokens, time to ready and the
budget ``/health`` shows. A random-weight model's tokens mostly decode to no text (its tokenizer
is byte-level), so its clients set a logit bias on the letters a-z: every token is one letter and
one chunk (the rows are drawn on the device, as any biased row is).

    python bench/serve_load.py                                   # default model on a CPU
    python bench/serve_load.py --model random:llama3-8b --device cuda --clients 32 --rounds 5 \\
        --doc-tokens 3300 --user-tokens 150 --answer-tokens 128 --variants auto,512,8192

Prints a table, writes ``bench/out/<tag>.json`` and ``.png`` (``--out``: elsewhere).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx
from capacity import LETTERS, document, model_facts, pct
from report import save
from startup_gpu import ServeProcess

BRIEF = ("out_tok_s", "ttft_first_p50", "ttft_follow_p99", "itl_p99_ms", "jit_during", "host_ms")
GOALS_H200 = {  # issue 30, 32 x 5 with D~3.3K, U=150, A=128 on the H200
    "out_tok_s": (">=", 1500),
    "ttft_first_p50": ("<=", 1.0),
    "ttft_first_p99": ("<=", 2.0),
    "ttft_follow_p50": ("<=", 0.15),
    "ttft_follow_p99": ("<=", 0.5),
    "itl_p99_ms": ("<=", 60),
}


def one_turn(client, model: str, messages: list[dict], args, bias: dict | None) -> dict:
    """One streamed chat completion: TTFT, the chunk gaps, usage."""
    t0 = time.perf_counter()
    stamps, text, usage = [], [], None
    extra = {"ignore_eos": True}
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=args.answer_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        logit_bias=bias,
        extra_body=extra,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "ttft_s": (stamps[0] if stamps else end) - t0,
        "gaps_s": [b - a for a, b in itertools.pairwise(stamps)],
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached": (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0,
        "text": "".join(text),
        "start": t0,
        "end": end,
    }


def drive(url: str, args, seed: int = 0) -> tuple[list[dict], list[str], float]:
    """``--clients`` closed-loop conversations (documents drawn from ``seed``); (turn rows,
    errors, wall seconds)."""
    from openai import OpenAI

    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    bias = LETTERS if args.model.startswith("random:") else None
    words = lambda n: max(1, int(n / args.tokens_per_word))  # noqa: E731
    system = document(random.Random(-1), words(args.system_tokens))  # one for every client
    rows: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        oai = OpenAI(base_url=f"{url}/v1", api_key="x", timeout=args.timeout, max_retries=0)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": document(rng, words(args.doc_tokens)) + "\nSummarize it."},
        ]
        time.sleep(i * args.stagger)  # --stagger: first turns keep arriving beside follow-ups
        for rnd in range(1, args.rounds + 1):
            try:
                row = one_turn(oai, model, messages, args, bias)
            except Exception as exc:  # counted and reported: the goal is that none happens
                with lock:
                    errors.append(f"client {i} round {rnd}: {type(exc).__name__}: {exc}"[:300])
                return
            messages += [
                {"role": "assistant", "content": row.pop("text")},
                {"role": "user", "content": document(rng, words(args.user_tokens))},
            ]
            with lock:
                rows.append({"client": i, "round": rnd, **row})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows, errors, time.perf_counter() - t0


def summarize(rows: list[dict], errors: list[str], wall: float, before: dict, after: dict) -> dict:
    first = [r["ttft_s"] for r in rows if r["round"] == 1]
    follow = [r["ttft_s"] for r in rows if r["round"] > 1]
    gaps = [g for r in rows for g in r["gaps_s"]]
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    s0, s1 = before.get("scheduler", {}), after.get("scheduler", {})
    g0, g1 = s0.get("graphs", {}), s1.get("graphs", {})
    r3 = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return {
        "turns": len(rows),
        "errors": errors,
        "wall_s": round(wall, 2),
        "out_tok_s": round(sum(r["completion_tokens"] for r in rows) / wall, 1),
        "ttft_first_p50": r3(pct(first, 50)),
        "ttft_first_p99": r3(pct(first, 99)),
        "ttft_follow_p50": r3(pct(follow, 50)),
        "ttft_follow_p99": r3(pct(follow, 99)),
        "itl_p50_ms": r3(pct(gaps, 50) * 1e3) if gaps else None,
        "itl_p99_ms": r3(pct(gaps, 99) * 1e3) if gaps else None,
        "prefill_tok_s": round((prompt - cached) / wall, 1),
        "cached_fraction": round(cached / max(1, prompt), 4),
        "steps": s1.get("steps", 0) - s0.get("steps", 0),
        "replays": g1.get("replays", 0) - g0.get("replays", 0),
        "mixed_replays": g1.get("mixed_replays", 0) - g0.get("mixed_replays", 0),
        "host_ms": s1.get("host_ms"),
        **_per_step(s0, s1),
        "budget": s1.get("budget"),
        "jit_after_ready": s1.get("jit_after_ready"),
        "jit_during": (s1.get("jit_after_ready") or 0) - (s0.get("jit_after_ready") or 0),
        "jit_late": s1.get("jit_late"),  # the variants compiled after ready, in words
        "graph_misses": s1.get("graph_misses"),  # steps run eagerly: their keys were not captured
        "turn_ttfts": [[r["client"], r["round"], r3(r["ttft_s"])] for r in rows],  # client, round, s
    }


def run_variant(variant: str, args, cache: str, base: str) -> dict:
    flags = ["--device", args.device, "--max-batch-tokens", variant, *args.serve_arg]
    flags += ["--disk-dir", tempfile.mkdtemp(prefix=f"kv-{variant}-", dir=base)]
    srv = ServeProcess(args.model, cache, *flags)
    try:
        ready = srv.wait_ready(args.ready_timeout)
        warm = None
        for p in range(args.warm_passes):  # the same load over other documents, not measured
            h0 = srv.health()
            warm = summarize(*drive(srv.url, args, seed=p + 1), h0, srv.health())
            print(f"# {variant}: warm pass {p + 1}: {json.dumps({k: warm[k] for k in BRIEF})}", flush=True)
        before = srv.health()
        rows, errors, wall = drive(srv.url, args)
        after = srv.health()
    finally:
        srv.stop()
    out = {"variant": variant, "ready_s": round(ready, 2), "startup_line": srv.startup_line()}
    out |= summarize(rows, errors, wall, before, after)
    out["warm_pass"] = warm
    out["tiers"] = {k: after.get(k) for k in ("ram", "disk")}  # writes done/dropped, restores
    noted = ("warn", "error", "compiled", "failed")  # what the server logged: late compiles, faults
    out["server_log"] = [x for x in srv.lines if any(w in x.lower() for w in noted)][:40]
    if errors:
        out["server_tail"] = srv.lines[-20:]
    return out


def table(results: list[dict]) -> None:
    cols = [
        ("variant", "budget"),
        ("out_tok_s", "out tok/s"),
        ("ttft_first_p50", "TTFT1 p50 s"),
        ("ttft_first_p99", "TTFT1 p99 s"),
        ("ttft_follow_p50", "TTFTn p50 s"),
        ("ttft_follow_p99", "TTFTn p99 s"),
        ("itl_p50_ms", "ITL p50 ms"),
        ("itl_p99_ms", "ITL p99 ms"),
        ("prefill_tok_s", "prefill tok/s"),
        ("cached_fraction", "cached"),
        ("mixed_replays", "mixed replays"),
        ("steps", "steps"),
        ("ready_s", "ready s"),
    ]
    print(
        "| "
        + " | ".join(h for _, h in cols)
        + " | host ms mixed/decode (pass mean) | wait ms/step | errors |"
    )
    print("|" + " --- |" * (len(cols) + 3))
    for r in results:
        cells = [str(r.get(k)) for k, _ in cols]
        host = f"{r.get('host_ms_mixed')}/{r.get('host_ms_decode')}"
        print(f"| {' | '.join(cells)} | {host} | {r.get('wait_ms_step')} | {len(r['errors'])} |")
    for r in results:
        b = r.get("budget") or {}
        print(
            f"# {r['variant']}: budget {json.dumps({k: b.get(k) for k in ('mode', 'max_batch_tokens', 'itl_target_ms', 'floor', 'curve')})}"
        )


def _per_step(s0: dict, s1: dict) -> dict:
    """Mean host ms per step of each kind over the pass (``/health``'s summed ``host_s``), and the
    mean wait for the device's results per step (on a CPU the forward is host work: ~0)."""
    d = lambda k, kind: (s1.get(k) or {}).get(kind, 0) - (s0.get(k) or {}).get(kind, 0)  # noqa: E731
    out = {}
    for kind in ("mixed", "decode"):
        n = d("kind_steps", kind)
        out[f"host_ms_{kind}"] = round(d("host_s", kind) * 1e3 / n, 3) if n else None
    steps = sum(d("kind_steps", k) for k in ("mixed", "decode"))
    wait = (s1.get("wait_s") or 0) - (s0.get("wait_s") or 0)
    out["wait_ms_step"] = round(wait * 1e3 / steps, 3) if steps else None
    return out


def _plot(res: dict, plt, path: Path) -> None:
    results = res["results"]
    names = [r["variant"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    x = range(len(names))
    for j, (k, label) in enumerate([("ttft_first", "first turn"), ("ttft_follow", "follow-up")]):
        axes[0].bar(
            [i + 0.4 * j for i in x], [r[f"{k}_p50"] or 0 for r in results], 0.4, label=f"{label} p50"
        )
        axes[0].scatter([i + 0.4 * j for i in x], [r[f"{k}_p99"] or 0 for r in results], marker="_", s=300,
                        color="k")  # fmt: skip
    axes[0].set_xticks([i + 0.2 for i in x], names)
    axes[0].set_title("TTFT (s): bars p50, ticks p99")
    axes[0].legend()
    axes[1].bar(names, [r["itl_p99_ms"] or 0 for r in results], label="p99")
    axes[1].bar(names, [r["itl_p50_ms"] or 0 for r in results], label="p50")
    axes[1].set_title("inter-token latency (ms)")
    axes[1].legend()
    axes[2].bar(names, [r["out_tok_s"] for r in results])
    axes[2].set_title("output tok/s")
    fig.suptitle(res["shape"])
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=200, help="the shared system prompt")
    ap.add_argument("--doc-tokens", type=int, default=400, help="the first user message (a document)")
    ap.add_argument("--user-tokens", type=int, default=40, help="each follow-up's user message")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument(
        "--stagger", type=float, default=0.0, help="client i starts i x this many seconds after the first"
    )
    ap.add_argument(
        "--warm-passes",
        type=int,
        default=0,
        help="run the whole load this many times over other documents first (not measured): "
        "what still compiles after ready (jit_after_ready) then stays out of the measured pass",
    )
    ap.add_argument("--variants", default="auto,512", help="--max-batch-tokens values, comma-separated")
    ap.add_argument("--serve-arg", action="append", default=[], help="more `turnkv serve` arguments")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--cache", help="the servers' XDG_CACHE_HOME (Triton cache; default: a temp folder)")
    ap.add_argument("--out", help="where the JSON and PNG go (default: bench/out)")
    ap.add_argument("--tag", default="serve_load")
    args = ap.parse_args()
    if args.out:
        import report

        report.OUT = Path(args.out)
    args.tokens_per_word = model_facts(args.model, "cpu" if args.device == "auto" else args.device, 0)[1]
    shape = (
        f"{args.model} on {args.device}: {args.clients} clients x {args.rounds} rounds, system "
        f"{args.system_tokens}, D {args.doc_tokens}, U {args.user_tokens}, A {args.answer_tokens}"
    )
    print("# " + shape, flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="serve-load-") as base:
        cache = args.cache or tempfile.mkdtemp(prefix="cache-", dir=base)
        for variant in args.variants.split(","):
            results.append(run_variant(variant, args, cache, base))
            b = results[-1].get("budget") or {}
            brief = {
                k: b.get(k) for k in ("mode", "max_batch_tokens", "itl_target_ms", "curve", "residual_ms")
            }
            print(json.dumps({**results[-1], "budget": brief}), flush=True)
    table(results)
    if args.model.startswith("random:llama3-8b") and args.device == "cuda":
        for r in results:
            missed = [k for k, (op, goal) in GOALS_H200.items()
                      if r.get(k) is None or (r[k] < goal if op == ">=" else r[k] > goal)]  # fmt: skip
            print(f"# goals {r['variant']}: {'all met' if not missed else 'missed ' + ', '.join(missed)}")
    save({"shape": shape, "args": vars(args), "results": results}, args.tag, _plot)


if __name__ == "__main__":
    main()

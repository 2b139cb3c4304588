"""More long conversations than the GPU bank holds, through a real ``turnkv serve`` over HTTP.

``--convs`` conversations of ``--rounds`` rounds: round 1 sends a document of about
``--doc-tokens`` tokens and a question, each later round the whole history (as OpenAI clients do)
and a short question. ``--clients`` closed-loop streaming clients (the ``openai`` SDK) take the
conversations of a round from one queue, round after round, so by the time a conversation comes
back the bank has served the others: the bank is sized (``--bank-bytes``, default: the KV of
``convs / --ratio`` finished conversations) so that it cannot hold them all. The server runs as a
subprocess with a RAM tier (``--ram-bytes``; on a CPU it is off unless given, so the default here
gives it room for every conversation) and a disk tier in a temp folder.

Per run: turns completed and failed; each follow-up's history rows by where they came from, from
``/health`` before and after (``ram.hit_tokens``, ``disk.hit_tokens``; the GPU bank's rows are the
cached rows of every response, ``usage.prompt_tokens_details.cached_tokens``, less those) and the
recomputed rest; TTFT p50/p99 of follow-ups by how they were served (a response's source is
``cached`` when no more than its history's last partial block (fewer than 256 rows, which only
the GPU bank keeps) was recomputed, else ``recomputed``: concurrent turns
share the counters, so a response's own tier is not known); out tok/s; disk writes done and
dropped, RAM drops, corrupt; restore GB/s per tier; and the disk's own fsync'd write rate
(``bench/disk_write.py``'s ``dd`` measurement, in the same folder, at the end of the run) against
the writer's (bytes written over the run's time, a lower bound: the writer idles between turns).
Per round, where the mean TTFT went (``/metrics`` deltas between round ends): the engine's TTFT
(from the scheduler's submit) and its queue time (submit to admission); the client's TTFT less
the engine's is the HTTP handler's (rendering and tokenizing the history); and the round's steps,
their mean wall time and the host's time per step (``/health.scheduler``).

    python bench/capacity.py                                     # default model on a CPU
    python bench/capacity.py --model random:llama3-8b --device cuda --convs 64 --rounds 3 \\
        --doc-tokens 12000 --clients 16

Prints a table, writes ``bench/out/<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from disk_write import dd_rate
from report import OUT, save
from serve_procs import free_port

from turnkv.bank.disk_blocks import BLOCK_TOKENS
from turnkv.bank.ram_budget import max_ram_bytes

STARTED = time.perf_counter()
TIER_ROWS = re.compile(
    r"\b(ram|disk) (\d+)"
)  # usage.cache_break.detail: "... lower tier: ram 11776, disk 256"
# random weights over the byte-level tokenizer answer bytes that often never form UTF-8, which a
# stream withholds (as vLLM's and HF's incremental detokenizers do) until its end, so a client
# would see no text before the last chunk: steer them to a-z (one byte a token), as a model answers
LETTERS = {str(i): 100 for i in range(97, 123)}
WORDS = "alpha beta gamma delta river stone cloud paper engine window garden silver orbit lamp".split()


def get_health(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/health", timeout=30) as r:
        return json.loads(r.read())


ENGINE_TIMES = {  # /metrics histograms summed per round: where a turn's TTFT went
    "turnkv_queue_time_seconds": "queue_s",  # submit to admission (a running slot, KV memory)
    "turnkv_time_to_first_token_seconds": "engine_ttft_s",  # submit to the first token
}


def engine_times(base: str) -> dict[str, float]:
    """The sums and counts of ``ENGINE_TIMES`` now (``/metrics``; the turns finished so far), and
    the scheduler's step count and host seconds (``/health.scheduler``) at this moment."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    sched = get_health(base).get("scheduler", {})
    got: dict[str, float] = {
        "t": time.perf_counter(),
        "steps": sched.get("steps", 0),
        "host_s": sum((sched.get("host_s") or {}).values()),
    }
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for metric, key in ENGINE_TIMES.items():
            if name in (f"{metric}_sum", f"{metric}_count"):
                got[f"{key}_{name.rsplit('_', 1)[1]}"] = float(value)
    return got


def round_times(rows: list[dict], marks: list[dict]) -> list[dict]:
    """Per round, the mean client TTFT and, from the ``/metrics`` deltas between round ends, the
    engine's (from the scheduler's submit) and the queue's share of it: client minus engine is the
    HTTP handler's time (rendering, tokenizing the history), engine minus queue the steps'."""
    out = []
    for rnd, (m0, m1) in enumerate(itertools.pairwise(marks), 1):
        ttfts = [r["ttft_s"] for r in rows if r["round"] == rnd]
        row = {"round": rnd, "turns": len(ttfts), "client_ttft_s": sum(ttfts) / max(1, len(ttfts))}
        steps = m1["steps"] - m0["steps"]
        row |= {
            "steps": steps,  # the round's steps, their mean wall time and the host's share of it
            "step_ms": (m1["t"] - m0["t"]) / steps * 1e3 if steps else None,
            "host_ms_step": (m1["host_s"] - m0["host_s"]) / steps * 1e3 if steps else None,
        }
        for key in ENGINE_TIMES.values():
            n = m1.get(f"{key}_count", 0) - m0.get(f"{key}_count", 0)
            row[key] = (m1.get(f"{key}_sum", 0) - m0.get(f"{key}_sum", 0)) / n if n else None
        out.append(row)
    return out


def model_facts(model: str, device: str, history: int) -> tuple[int, float, int]:
    """(KV bytes of one row, tokens per word of ``document``, a turn's transient bytes, which
    admission reserves beside its KV) of ``model``: random shapes from their table (bf16, the
    byte tokenizer; the activation bound x4 for fp32 and attention scratch), else the loaded engine's."""
    from turnkv.config import EngineConfig

    if model.startswith("random:"):
        from turnkv.models.load import SHAPES
        from turnkv.tokenizer import byte_level

        c = SHAPES[model.split(":", 1)[1]]
        row, tok = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2, byte_level()  # k and v, bf16
        act = 4 * (
            EngineConfig.prefill_chunk * (6 * c.hidden_size + 3 * c.intermediate_size) * 2 + c.vocab_size * 4
        )
    else:
        from turnkv.engine.admission import activation_bytes
        from turnkv.runtime import load_engine

        engine = load_engine(EngineConfig(model=model, device=device), progress=False)
        row, tok = engine.shape.bytes_per_row, engine.tokenizer
        act = activation_bytes(engine.footprint, engine.prefill_chunk, history)
    sample = document(random.Random(0), 2000)
    return row, len(tok.encode(sample)) / 2000, act


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


class Conversation:
    def __init__(self, i: int, args) -> None:
        rng = random.Random(i)
        words = max(1, int(args.doc_tokens / args.tokens_per_word))
        self.i = i
        self.messages = [
            {"role": "system", "content": f"You are assistant number {i}. Answer briefly."},
            {"role": "user", "content": document(rng, words) + "\nSummarize the text above."},
        ]
        self.history = 0  # prompt + answer tokens of the previous turn (the rows a tier can hold)
        self.rng = rng


def one_turn(client, conv: Conversation, args, rnd: int) -> dict:
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    stream = client.chat.completions.create(
        model=args.served_model,
        messages=conv.messages,
        max_tokens=args.answer_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        logit_bias=LETTERS if args.model.startswith("random:") else None,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    brk = getattr(usage, "cache_break", None) or {}
    detail = (brk.get("detail") if isinstance(brk, dict) else getattr(brk, "detail", None)) or ""
    note = detail.partition("rows restored from a lower tier:")[2]
    tiers = {name: int(n) for name, n in TIER_ROWS.findall(note)}
    row = {
        "conv": conv.i,
        "round": rnd,
        "ttft_s": ttft if ttft is not None else total,
        "text_seen": ttft is not None,  # else the TTFT is the whole turn's (no text came)
        "total_s": total,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached": cached,
        "history": conv.history,
        "ram_rows": tiers.get("ram", 0),
        "disk_rows": tiers.get("disk", 0),
    }
    conv.history = usage.prompt_tokens + usage.completion_tokens
    conv.messages += [
        {"role": "assistant", "content": "".join(text)},
        {"role": "user", "content": f"And what about point {conv.rng.randint(1, 99)}?"},
    ]
    return row


def drive(base: str, args) -> tuple[list[dict], list[str], float, list[dict]]:
    """(turn rows, errors, wall seconds, ``engine_times`` at the start and after each round)."""
    from openai import OpenAI

    convs = [Conversation(i, args) for i in range(args.convs)]
    rows: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    marks = [engine_times(base)]
    t0 = time.perf_counter()
    for rnd in range(1, args.rounds + 1):
        todo: queue.Queue = queue.Queue()
        for c in convs:
            todo.put(c)

        def worker(todo: queue.Queue = todo, rnd: int = rnd) -> None:
            client = OpenAI(base_url=f"{base}/v1", api_key="x", timeout=args.timeout, max_retries=0)
            while True:
                if args.deadline_s and time.perf_counter() - STARTED > args.deadline_s:
                    return  # past --deadline-s: no new turn starts (the summary says how many ran)
                try:
                    conv = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    row = one_turn(client, conv, args, rnd)
                    with lock:
                        rows.append(row)
                except Exception as exc:  # counted: the goal is that none happens
                    with lock:
                        errors.append(f"conv {conv.i} round {rnd}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=worker) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        marks.append(engine_times(base))
        print(
            f"# round {rnd} done at {time.perf_counter() - t0:.1f} s ({len(rows)} turns, {len(errors)} failed)"
        )
    return rows, errors, time.perf_counter() - t0, marks


def served(r: dict) -> bool:
    """Whether a follow-up's history came from a tier (all but a last partial block)."""
    return r["history"] - r["cached"] < BLOCK_TOKENS


def source(r: dict) -> str:
    """Where a follow-up's history came from: ``recomputed`` (more than its last partial block),
    else the slowest tier that restored rows of it (``usage.cache_break.detail``), else ``gpu``."""
    if not served(r):
        return "recomputed"
    return "disk" if r.get("disk_rows") else "ram" if r.get("ram_rows") else "gpu"


def summarize(rows: list[dict], before: dict, after: dict, wall: float, errors: list[str], args) -> dict:
    follow = [r for r in rows if r["round"] > 1]
    d = {
        k: {n: after[k][n] - before[k][n] for n in after[k] if isinstance(after[k][n], int | float)}
        for k in ("bank", "ram", "disk")
    }
    history = sum(r["history"] for r in follow)
    cached = sum(min(r["cached"], r["history"]) for r in follow)
    ram_rows, disk_rows = d["ram"].get("hit_tokens", 0), d["disk"].get("hit_tokens", 0)
    sources = {
        "gpu": max(0, cached - ram_rows - disk_rows),
        "ram": ram_rows,
        "disk": disk_rows,
        "recomputed": history - cached,
    }
    by: dict[str, list[float]] = {"cached": [], "gpu": [], "ram": [], "disk": [], "recomputed": []}
    for r in follow:
        by[source(r)].append(r["ttft_s"])
        if served(r):
            by["cached"].append(r["ttft_s"])
    writer_bytes = d["disk"].get("writes", 0) * BLOCK_TOKENS * args.bytes_per_row
    return {
        "turns": len(rows),
        "turns_expected": args.convs * args.rounds,
        "failed": len(errors),
        "errors": errors[:10],
        "follow_up_history_tokens": history,
        "rows_by_source": sources,
        "from_a_tier": cached / history if history else None,
        "ttft": {k: {"n": len(v), "p50": pct(v, 50), "p99": pct(v, 99)} for k, v in by.items()},
        "no_text_turns": sum(not r.get("text_seen", True) for r in rows),
        "ttft_first_round": {"p50": pct([r["ttft_s"] for r in rows if r["round"] == 1], 50)},
        "out_tok_s": sum(r["completion_tokens"] for r in rows) / wall,
        "wall_s": wall,
        "bank": d["bank"],
        "ram": d["ram"] | {"restore_gbps": after["ram"]["restore_gbps"], "enabled": after["ram"]["enabled"]},
        "disk": d["disk"] | {"restore_gbps": after["disk"].get("restore_gbps", 0.0)},
        "writer_gb_s_lower_bound": writer_bytes / wall / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--convs", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=1500, help="tokens of each conversation's document")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=1.3, help="conversations per conversation the bank holds")
    ap.add_argument("--bank-bytes", help="the GPU bank's budget (default: from --ratio)")
    ap.add_argument("--ram-bytes", help="the RAM tier's budget (default: room for every conversation)")
    ap.add_argument("--disk-dir", help="where the disk tier goes (default: a temp folder in bench/out)")
    ap.add_argument(
        "--disk-bytes", help="the disk tier's budget (default: 80 %% of what the disk tier's folder has free)"
    )
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--deadline-s", type=float, help="start no turn this many seconds after the bench started"
    )
    ap.add_argument("--serve-arg", action="append", default=[], help="more `turnkv serve` arguments")
    ap.add_argument("--tag", default="capacity")
    args = ap.parse_args()

    args.bytes_per_row, args.tokens_per_word, act = model_facts(
        args.model,
        "cpu" if args.device == "auto" and not args.model.startswith("random:") else args.device,
        2 * args.doc_tokens,
    )
    question = int(20 * args.tokens_per_word)  # a follow-up's question and the template's rows, about
    conv_rows = args.doc_tokens + args.rounds * (args.answer_tokens + question)  # a finished conversation
    kv = int(args.convs / args.ratio * conv_rows * args.bytes_per_row)  # conversations the bank holds
    bank = args.bank_bytes or str(kv + act)  # and a turn's transient memory
    # room for every conversation, at most what this machine allows (serve refuses more)
    # (5 % below the machine's bound: the server's own start takes some of the memory it measures)
    most = int(0.95 * max_ram_bytes())
    ram = args.ram_bytes or str(min(int(1.5 * args.convs * conv_rows * args.bytes_per_row), most))
    OUT.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="capacity-", dir=args.disk_dir or OUT))
    # a budget past the free space filled a 64 GiB disk and lost the run's results
    disk = args.disk_bytes or str(int(0.8 * shutil.disk_usage(root).free))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "turnkv",
        "serve",
        "--model",
        args.model,
        "--device",
        args.device,
        "--port",
        str(port),
        "--bank-bytes",
        bank,
        "--ram-bytes",
        ram,
        "--disk-dir",
        str(root / "kv"),
        "--disk-bytes",
        disk,
        *args.serve_arg,
    ]
    print("# " + " ".join(cmd))
    log = open(root / "server.log", "w")
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                before = get_health(base)
                break
            except OSError as exc:
                if srv.poll() is not None:
                    raise SystemExit(
                        f"turnkv serve exited: {(root / 'server.log').read_text()[-2000:]}"
                    ) from exc
                time.sleep(1)
        else:
            raise SystemExit("turnkv serve did not answer /health in 600 s")
        args.served_model = before["model"]
        rows, errors, wall, marks = drive(base, args)
        time.sleep(2)  # the writers finish behind the last answers
        after = get_health(base)
    finally:
        srv.terminate()
        srv.wait(60)
        log.close()
    disk_rate = dd_rate(root, BLOCK_TOKENS * args.bytes_per_row, 64)
    server_log = (root / "server.log").read_text()
    shutil.rmtree(root, ignore_errors=True)
    s = summarize(rows, before, after, wall, errors, args)
    s |= {
        "rounds": round_times(rows, marks),
        "disk_dd_gb_s": disk_rate,
        "model": args.model,
        "device": after.get("device"),
        "bank_bytes": int(bank),
        "ram_bytes": int(ram),
        "args": {k: v for k, v in vars(args).items()},
        "rows": rows,
        "server_warnings": [ln for ln in server_log.splitlines() if "WARNING" in ln][:20],
    }
    src = s["rows_by_source"]
    tot = max(1, sum(src.values()))
    print(
        f"model {args.model} on {s['device']}: {args.convs} conversations x {args.rounds} rounds, "
        f"{args.clients} clients, bank {int(bank) / 2**30:.2f} GiB, RAM {int(ram) / 2**30:.2f} GiB"
    )
    print(
        f"turns {s['turns']}/{s['turns_expected']} ({s['failed']} failed), out {s['out_tok_s']:.1f} tok/s, "
        f"wall {wall:.1f} s, bank evictions {s['bank'].get('evictions', 0)}; "
        f"{s['no_text_turns']} turns streamed no text (their TTFT is the whole turn's)"
    )
    print(
        "follow-up history rows: "
        + ", ".join(f"{k} {v} ({v / tot:.1%})" for k, v in src.items())
        + f"; from a tier {s['from_a_tier'] or 0:.1%}"
    )
    for k, t in s["ttft"].items():
        if t["n"]:
            print(f"TTFT {k:>10}: n {t['n']:>4} p50 {t['p50']:.3f} s p99 {t['p99']:.3f} s")
    for r in s["rounds"]:
        f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(
            f"round {r['round']}: TTFT mean {f(r['client_ttft_s'])} s, of it the engine's "
            f"{f(r['engine_ttft_s'])} s, of that queued for admission {f(r['queue_s'])} s; "
            f"{r['steps']} steps of {f(r['step_ms'])} ms ({f(r['host_ms_step'])} ms host)"
        )
    dk, rm = s["disk"], s["ram"]
    print(
        f"disk writes {dk.get('writes', 0)} dropped {dk.get('dropped_writes', 0)} corrupt {dk.get('corrupt', 0)} "
        f"vanished {dk.get('vanished', 0)}; RAM dropped {rm.get('dropped', 0)} evictions {rm.get('evictions', 0)} "
        f"restore {rm['restore_gbps']:.2f} GB/s; disk restore {dk['restore_gbps']:.2f} GB/s"
    )
    print(
        f"disk dd conv=fsync {disk_rate:.3f} GB/s; writer >= {s['writer_gb_s_lower_bound']:.3f} GB/s over the run"
    )
    save(s, args.tag, _plot)


def _plot(s: dict, plt, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    src = s["rows_by_source"]
    axes[0].bar(list(src), list(src.values()), color=["C2", "C0", "C1", "C3"])
    axes[0].set(ylabel="follow-up history rows", title="where follow-ups' rows came from")
    for k in s["ttft"]:
        xs = sorted(
            r["ttft_s"]
            for r in s["rows"]
            if r["round"] > 1 and (source(r) == k or (k == "cached" and served(r)))
        )
        if xs:
            axes[1].plot(xs, [i / len(xs) for i in range(len(xs))], label=k)
    axes[1].set(xlabel="follow-up TTFT s", ylabel="fraction", title="TTFT by source")
    axes[1].legend()
    fig.suptitle(f"{s['model']} on {s['device']}: {s['turns']}/{s['turns_expected']} turns")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

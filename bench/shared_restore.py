"""A follow-up after its replica died, restored from the shared block store, against recompute (issue 34).

No Ray: plain ``turnkv serve`` processes P0, P1, ... share one ``--disk-store`` (``dir:`` a
temporary directory, or ``redis://`` on a ``redis-server`` this script starts: ``--store redis``).
They start together (``--processes``, default one more than the sizes, so none starts mid-run).
History size i (tokens of a document, ``--history``) has P(i) write and P(i+1) restore, so every
restore is its process's first and the writer of a size is the last size's restorer:

1. the restorer R serves a warm-up turn of another document of that size (its prefill path warm
   as any serving replica's; nothing of it is in the measured conversation);
2. the writer W answers the conversation's first turn (the document and a question), then the
   script waits until W's ``/health.disk`` says those blocks are durable (``durable``: nothing
   queued and the turn's blocks settled: written, or already in the store), and **SIGKILLs W**;
3. R gets the follow-up (the whole history, as OpenAI clients send it, and a short question):
   ``max_tokens`` 1, not streamed, so the request's wall time is the client's time to first token
   (a random-weight model's tokens mostly decode to no text, so a stream may carry none); its
   ``cached_tokens`` (the restored history) and R's ``/health.disk`` (``hit_tokens``, and the
   restore's time from the cumulative ``restore_gbps``: ``restore_time``);
4. the recompute baseline: the same follow-up on R under a fresh ``cache_salt`` (same tokens,
   nothing cached: a full prefill);
5. the greedy answers (``--answer-tokens``, with logprobs: each token's bytes) of the restored and
   the recomputed follow-up (each now a hit of the rows of 3 or 4 in R's bank): equal or not.

The writer has just written the blocks, so on one host the restore reads them from the page
cache; ``--drop-page-cache`` (``dir:`` stores) drops them first, as a replica on another host
would find them (``posix_fadvise``; the files are clean, fsynced by the writer).

Server-side TTFT (the engine's, from ``/metrics``' ``turnkv_time_to_first_token_seconds`` sum)
is reported beside the client's. Prints a table; writes ``bench/out/<tag>.json`` and ``.png``.

    python bench/shared_restore.py                                   # default model, CPU
    python bench/shared_restore.py --model random:llama3-8b --device cuda --history 8000,32000 \\
        --serve-arg=--bank-bytes=16G --serve-arg=--ram-bytes=4G --serve-arg=--disk-bytes=40G \\
        --tag shared_restore_h200                                    # three servers on one H200
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from report import cpu_name, save
from serve_procs import Replica, drop_page_cache, gpu_name, settle, stop_all, store

from turnkv.bank.disk_blocks import BLOCK_TOKENS

WORDS = (
    "river stone lantern orbit copper meadow signal harbor violet engine whisper canyon ledger "
    "marble tide falcon cedar prism quartz ember glacier thicket beacon saddle anchor velvet"
).split()


# -- the disk tier's /health facts ----------------------------------------------------------------
SETTLED = ("writes", "dedupe_hits", "write_failures", "dropped_writes")  # where a queued block ends


def settled(disk: dict) -> int:
    """Blocks whose write ended (written, found in the store, failed or dropped): ``/health.disk``."""
    return sum(int(disk[k]) for k in SETTLED)


def durable(before: dict, now: dict, blocks: int) -> bool:
    """Whether ``blocks`` more blocks than at ``before`` (two ``/health.disk`` documents) ended
    their write and nothing is queued: the turn's blocks are in the store or lost (``lost``)."""
    return int(now["queued"]) == 0 and settled(now) - settled(before) >= blocks


def lost(before: dict, now: dict) -> int:
    """Blocks of the writes since ``before`` that did not reach the store (failed, dropped)."""
    return sum(int(now[k]) - int(before[k]) for k in ("write_failures", "dropped_writes"))


def wait_durable(replica: Replica, before: dict, blocks: int, timeout: float = 300) -> float:
    t0 = time.perf_counter()
    while not durable(before, disk := replica.health()["disk"], blocks):
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"{replica.name}: {blocks} blocks not durable in {timeout} s: {disk}")
        time.sleep(0.02)
    if lost(before, disk):
        raise RuntimeError(f"{replica.name} lost {lost(before, disk)} block write(s): {disk}")
    return time.perf_counter() - t0


def quiet(replica: Replica, timeout: float = 300) -> None:
    """Wait until ``replica`` writes nothing (a turn's blocks are queued before its answer is
    sent), so that a measured request does not share the cores with a write."""
    t0 = time.perf_counter()
    while int(replica.health()["disk"]["queued"]):
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"{replica.name}: still writing after {timeout} s")
        time.sleep(0.02)


def restore_time(before: dict, now: dict, block_bytes: float) -> tuple[int, float]:
    """(rows, seconds) of the restores between two ``/health.disk`` documents of one process: the
    rows from ``hit_tokens``, the time from the cumulative rate (``restore_gbps``: restored bytes
    over restore time) and the bytes of a block (its file's: the rows and a header of a few KiB)."""
    rows = int(now["hit_tokens"]) - int(before["hit_tokens"])

    def seconds(d: dict) -> float:
        return (
            int(d["hit_tokens"]) / BLOCK_TOKENS * block_bytes / (d["restore_gbps"] * 1e9)
            if d["restore_gbps"]
            else 0
        )

    return rows, seconds(now) - seconds(before)


# -- requests -------------------------------------------------------------------------------------
def document(url: str, tokens: int, seed: int) -> str:
    """A text of ``tokens`` tokens of the server's tokenizer (sentences of random words, cut)."""
    rng = random.Random(seed)
    text = " ".join(
        " ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "." for _ in range(tokens // 8)
    )
    ids = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60).json()
    assert len(ids["tokens"]) >= tokens, f"{len(ids['tokens'])} tokens of {len(text)} characters"
    return httpx.post(url + "/detokenize", json={"tokens": ids["tokens"][:tokens]}, timeout=60).json()[
        "prompt"
    ]


def chat(url: str, model: str, messages: list[dict], max_tokens: int, **extra) -> tuple[float, dict]:
    """(client seconds, body) of one greedy chat completion, not streamed."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    took = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:500]}")
    return took, r.json()


def timed(replica: Replica, model: str, messages: list[dict], **extra) -> dict:
    """The follow-up's first token on ``replica``: client and engine TTFT, cached tokens."""
    s0, n0 = replica.ttft_sum()
    took, body = chat(replica.url, model, messages, 1, **extra)
    s1, n1 = replica.ttft_sum()
    assert n1 == n0 + 1, f"{n1 - n0} turns counted for one request"
    usage = body["usage"]
    return {
        "ttft_s": round(took, 4),
        "engine_ttft_s": round(s1 - s0, 4),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }


def answer(replica: Replica, model: str, messages: list[dict], n: int, **extra) -> list:
    """The greedy answer: each token's bytes, its text, and each token's logprob (a random-weight
    model's greedy answer may be one token repeated: the logprobs still tell rows apart)."""
    _, body = chat(replica.url, model, messages, n, logprobs=True, **extra)
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    return [
        [e["bytes"] for e in content],
        choice["message"]["content"] or "",
        [e["logprob"] for e in content],
    ]


# -- one history size ------------------------------------------------------------------------------
def run_size(w: Replica, r: Replica, model: str, size: int, args, seed: int, spec: str) -> dict:
    extra = {"ignore_eos": True} if args.model.startswith("random:") else {}
    question = "What is the document about? Answer briefly."
    # R's warm-up: a turn of another document of this size (its prefill path as a serving replica's)
    chat(
        r.url,
        model,
        [{"role": "user", "content": document(r.url, size, seed + 1) + "\n\n" + question}],
        1,
        **extra,
    )
    quiet(r)

    first = [{"role": "user", "content": document(w.url, size, seed) + "\n\n" + question}]
    before = w.health()["disk"]
    t1, body = chat(w.url, model, first, args.answer_tokens, **extra)
    usage = body["usage"]
    blocks = usage["prompt_tokens"] // BLOCK_TOKENS  # the prompt's whole blocks at least (one job)
    wait_s = wait_durable(w, before, blocks)
    wdisk = w.health()["disk"]
    block_bytes = wdisk["bytes"] / max(1, wdisk["blocks"])  # every block of one model is one size
    w.kill()
    if args.drop_page_cache and spec.startswith("dir:"):
        drop_page_cache(Path(spec[4:]))

    follow = [
        *first,
        {"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""},
        {"role": "user", "content": "And in one sentence?"},
    ]
    d0 = r.health()["disk"]
    restored = timed(r, model, follow, **extra)
    rows, seconds = restore_time(d0, r.health()["disk"], block_bytes)
    quiet(r)
    cold = timed(r, model, follow, cache_salt=f"cold-{seed}", **extra)
    ans_restored = answer(r, model, follow, args.answer_tokens, **extra)
    ans_cold = answer(r, model, follow, args.answer_tokens, cache_salt=f"cold-{seed}", **extra)
    same = sum(1 for _ in _common(ans_restored[0], ans_cold[0]))
    return {
        "history_tokens": size,
        "first_turn": {"seconds": round(t1, 3), **usage},
        "durable_wait_s": round(wait_s, 3),
        "writer_disk": {k: wdisk[k] for k in ("blocks", "bytes", "writes", "dedupe_hits", "queued")},
        "restore": restored,
        "restore_rows": rows,
        "restore_bytes": int(rows / BLOCK_TOKENS * block_bytes),
        "restore_s": round(seconds, 4),
        "restore_gbps": round(rows / BLOCK_TOKENS * block_bytes / seconds / 1e9, 2) if seconds > 0 else None,
        "recompute": cold,
        "ratio": round(cold["ttft_s"] / restored["ttft_s"], 2),
        "engine_ratio": round(cold["engine_ttft_s"] / restored["engine_ttft_s"], 2),
        "answer_tokens": len(ans_restored[0]),
        "same_tokens": same,
        "same_answer": ans_restored[:2] == ans_cold[:2],
        # the answers' logprobs, restored against recomputed, over the tokens they share
        "max_logprob_diff": max(
            (abs(a - b) for a, b, _ in zip(ans_restored[2], ans_cold[2], range(same), strict=False)),
            default=None,
        ),
        "answer_restored": ans_restored[1],
        "answer_recomputed": ans_cold[1],
    }


def _common(a: list, b: list) -> Iterator[None]:
    """One item per leading token the two answers share."""
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield None


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--history", default="1000,3000", help="history sizes in tokens, comma-separated")
    ap.add_argument("--store", choices=("dir", "redis"), default="dir")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="a flag for both servers (repeat; e.g. --serve-arg=--bank-bytes=20G)",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=0,
        help="servers started at once (default: one more than the sizes, so none starts mid-run)",
    )
    ap.add_argument(
        "--drop-page-cache",
        action="store_true",
        help="dir: store: drop the block files from the page cache before the restore (posix_fadvise)",
    )
    ap.add_argument("--tag", default="shared_restore")
    args = ap.parse_args()
    sizes = [int(x) for x in args.history.split(",")]
    t_all = time.perf_counter()
    rows, starts = [], []
    with store(args.store) as spec:

        def start(n: int) -> list[Replica]:
            new = [
                Replica(f"P{len(reps) + i}", args.model, args.device, spec, args.serve_arg) for i in range(n)
            ]
            starts.extend(rep.wait_ready() for rep in new)  # started together, waited for in turn
            return new

        reps: list[Replica] = []
        try:
            reps += start(max(2, min(args.processes or len(sizes) + 1, len(sizes) + 1)))
            settled_s = settle(reps)
            model = httpx.get(reps[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
            for i, size in enumerate(sizes):
                if len(reps) < i + 2:  # no spare left: a fresh process restores this size
                    reps += start(1)
                    settled_s += settle(reps)
                w, r = reps[i], reps[i + 1]  # the last size's restorer writes this one
                row = run_size(w, r, model, size, args, seed=1000 * (i + 1), spec=spec)
                row |= {"writer": w.name, "restorer": r.name}
                rows.append(row)
                print(_line(row), flush=True)
        finally:
            stop_all(reps)
    results = {
        "model": args.model,
        "device": args.device,
        "gpu": gpu_name(args.device),
        "store": args.store,
        "serve_args": args.serve_arg,
        "page_cache": "dropped (posix_fadvise)" if args.drop_page_cache else "warm (the writer just wrote)",
        "answer_tokens": args.answer_tokens,
        "ready_s": [round(s, 2) for s in starts],
        "settle_s": round(settled_s, 1),
        "seconds": round(time.perf_counter() - t_all, 1),
        "rows": rows,
    }
    _table(results)
    save(results, args.tag, _plot)


def _line(row: dict) -> str:
    return (
        f"history {row['history_tokens']}: restore TTFT {row['restore']['ttft_s']} s "
        f"(cached {row['restore']['cached_tokens']}/{row['restore']['prompt_tokens']}), "
        f"recompute {row['recompute']['ttft_s']} s, x{row['ratio']}, same answer {row['same_answer']}"
    )


def _table(res: dict) -> None:
    print(
        f"\n{res['model']} on {res['device']} ({res['gpu'] or cpu_name()}), store {res['store']}, "
        f"page cache {res['page_cache']}, {res['seconds']} s"
    )
    print(
        "| history | prompt | cached | restore TTFT (engine) | recompute TTFT (engine) | x | restore | GB/s | "
        "durable after | same answer |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in res["rows"]:
        a, c = r["restore"], r["recompute"]
        print(
            f"| {r['history_tokens']} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['ttft_s']} s "
            f"({a['engine_ttft_s']}) | {c['ttft_s']} s ({c['engine_ttft_s']}) | **{r['ratio']}** | "
            f"{r['restore_s']} s | {r['restore_gbps']} | {r['durable_wait_s']} s | "
            f"{r['same_answer']} ({r['same_tokens']}/{r['answer_tokens']} tokens, logprobs within "
            f"{r['max_logprob_diff']}) |"
        )


def _plot(res: dict, plt, path: Path) -> None:
    rows = res["rows"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(
        [i - 0.2 for i in x],
        [r["restore"]["ttft_s"] for r in rows],
        0.4,
        label="restored from the shared store",
    )
    ax.bar([i + 0.2 for i in x], [r["recompute"]["ttft_s"] for r in rows], 0.4, label="recomputed")
    for i, r in enumerate(rows):
        ax.text(i, r["recompute"]["ttft_s"], f"x{r['ratio']}", ha="center", va="bottom")
    ax.set_xticks(list(x), [f"{r['history_tokens']} tokens" for r in rows])
    ax.set_ylabel("follow-up TTFT at the client (s)")
    ax.set_title(
        f"a follow-up after its replica's SIGKILL, {res['store']} store: {res['model']}\non {res['gpu'] or res['cpu']}",
        fontsize=9,
    )
    ax.margins(y=0.12)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()

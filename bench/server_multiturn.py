"""Interleaved multi-turn conversations through the server: segmented against contiguous, one run.

N conversations take turns (A1 B1 A2 B2 ... for N = 2), each turn a user message of about
``--user-tokens`` tokens plus a greedy answer of at most ``--answer-tokens`` tokens (with random
weights every answer runs to that length: ``ignore_eos``), and every request resends the whole
history as OpenAI clients do.
Each variant gets a fresh engine (the same weights), bank and budget:

- ``segmented``: the bank restores a conversation's segments by reference;
- ``contiguous``: the honest baseline, whose bank snapshots and restores are copies (and priced);
- ``recompute``: segmented, but every request in its own cache namespace (a fresh ``cache_salt``),
  so nothing is reused -- what a server without a prefix cache (or with one slot) pays on
  interleaved turns.

Per variant: 507 count, cached-token ratio (cached / history tokens, where the history is the
previous turns as the chat template re-renders them), prompt rows prefilled per turn, TTFT p50 and
p99, and the peak unique KV bytes the bank measured (bank + live request + new snapshot).

Modes: ``--mode http`` (default) serves the app with uvicorn on a free port in this process and
drives it with the ``openai`` client, streaming (TTFT is measured at the client). ``--mode
in-process`` drives the same ``TurnService`` (admission, restore, generate, seal, bank) without
HTTP, for machines without fastapi (the GPU box); TTFT is then measured at the service.

    python bench/server_multiturn.py                      # default model, CPU, HTTP
    python bench/server_multiturn.py --shape llama3-8b --device cuda --mode in-process \\
        --user-tokens 4000 --turns 8 --bank-bytes 6G      # random weights: speed and memory only

``--clients N`` switches to concurrent clients (``bench/clients.py``: batched, serial and recompute
variants of N clients x ``--rounds`` rounds through one scheduler, in process):

    python bench/server_multiturn.py --clients 8 --rounds 3 --user-tokens 128 --answer-tokens 32
    python bench/server_multiturn.py --shape llama3-8b --device cuda --clients 64 --rounds 5 \\
        --user-tokens 512 --answer-tokens 64

Prints a table, writes ``bench/out/<tag>.json`` and ``bench/out/<tag>.png``.
"""

from __future__ import annotations

from turnkv.threads import prepare_env

prepare_env()  # OpenMP spins briefly (as the CLI sets it), before torch loads

import argparse
import random
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from report import save

from turnkv.bank.session_bank import SessionBank
from turnkv.config import EngineConfig, parse_size
from turnkv.engine.admission import activation_bytes
from turnkv.engine.engine import Engine
from turnkv.engine.events import Admitted, Failed, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.runtime import build, load_engine, new_bank

WORDS = (
    "river stone lantern orbit copper meadow signal harbor violet engine whisper canyon ledger "
    "marble tide falcon cedar prism quartz ember glacier thicket beacon saddle anchor velvet "
    "compass tundra cobalt mosaic parcel summit willow cipher furnace atlas pylon gravel"
).split()


def user_message(tokenizer, target: int, rng: random.Random, label: str) -> str:
    """Plain sentences of about ``target`` tokens (fixed seed, so every variant sends the same)."""
    parts: list[str] = [f"Conversation {label}. Please summarise the following notes."]
    while len(tokenizer.encode(" ".join(parts))) < target:
        parts.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return " ".join(parts)


class InProcess:
    """Runs each turn through the engine's turn path directly; TTFT from the call to the first token."""

    def __init__(self, engine: Engine, bank: SessionBank, ignore_eos: bool) -> None:
        self.engine = engine
        self.bank = bank
        self.rt = build(engine.cfg, "bench", engine=engine)
        self.ignore_eos = ignore_eos

    def ask(self, messages: list[dict], max_tokens: int, salt: str) -> dict:
        tok = self.engine.tokenizer
        turn = TurnRequest(
            tok.apply_chat_template(messages),
            SamplingParams(temperature=0.0, ignore_eos=self.ignore_eos),
            max_tokens=max_tokens,
            namespace="bench|" + salt,
            render_history=lambda a: tok.apply_chat_template(
                [*messages, {"role": "assistant", "content": a}], add_generation_prompt=False
            ),
        )
        events: list[object] = []
        t0 = time.perf_counter()
        first: list[float] = []

        def emit(ev: object) -> None:
            if isinstance(ev, GenEvent) and ev.token_id is not None and not first:
                first.append(time.perf_counter() - t0)
            events.append(ev)

        for ev in self.rt.run_turn(turn, self.bank):
            emit(ev)
        failed = next((e for e in events if isinstance(e, Failed)), None)
        if failed is not None:
            return {"status": 507 if failed.code == "kv_memory_exhausted" else 400, "text": ""}
        adm = next(e for e in events if isinstance(e, Admitted))
        gen = [e for e in events if isinstance(e, GenEvent)]
        return {
            "status": 200,
            "text": "".join(e.text for e in gen),
            "prompt_tokens": adm.prompt_tokens,
            "cached_tokens": gen[-1].stats.cached_tokens,
            "ttft_s": first[0] if first else float("nan"),
        }

    def close(self) -> None:
        pass


class Http:
    """A live server (uvicorn in a thread, a free port) driven by the ``openai`` client, streaming."""

    def __init__(self, engine: Engine, bank: SessionBank, ignore_eos: bool) -> None:
        import socket

        import openai
        import uvicorn

        from turnkv.server.app import create_app

        app = create_app(build(engine.cfg, "serve", engine=engine), bank)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0)
        self.openai = openai
        self.model = engine.info.model_name
        self.ignore_eos = ignore_eos

    def ask(self, messages: list[dict], max_tokens: int, salt: str) -> dict:
        t0 = time.perf_counter()
        ttft = None
        text, usage = [], None
        try:
            stream = self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": self.ignore_eos, "cache_salt": salt},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
        except self.openai.APIStatusError as e:
            return {"status": e.status_code, "text": ""}
        return {
            "status": 200,
            "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "ttft_s": ttft if ttft is not None else float("nan"),
        }

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def run_variant(engine: Engine, variant: str, args: argparse.Namespace, budget: int) -> dict:
    bank = new_bank(engine, budget)
    # random weights hit EOS at random: run every answer to its length there; a real model's
    # answers end where the model ends them (greedy, so every variant gets the same answers)
    driver = (Http if args.mode == "http" else InProcess)(engine, bank, ignore_eos=bool(args.shape))
    tok = engine.tokenizer
    rng = random.Random(args.seed)
    labels = [chr(ord("A") + i) for i in range(args.conversations)]
    convs: dict[str, list[dict]] = {c: [] for c in labels}
    if engine.shape.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rows = []
    try:
        for t in range(1, args.turns + 1):
            for c in labels:
                msgs = convs[c]
                history = len(tok.apply_chat_template(msgs, add_generation_prompt=False)) if msgs else 0
                msgs.append({"role": "user", "content": user_message(tok, args.user_tokens, rng, f"{c}{t}")})
                salt = f"{c}{t}" if variant == "recompute" else c
                r = driver.ask(msgs, args.answer_tokens, salt)
                refused = r["status"] != 200
                # a refused turn gets a stand-in answer so the conversation goes on as a user's would
                msgs.append({"role": "assistant", "content": r["text"] if not refused else "(no answer)"})
                row = {"conv": c, "turn": t, "status": r["status"], "history_tokens": history}
                if not refused:
                    row.update(
                        prompt_tokens=r["prompt_tokens"],
                        cached_tokens=r["cached_tokens"],
                        prefilled=r["prompt_tokens"] - r["cached_tokens"],
                        ttft_s=r["ttft_s"],
                    )
                rows.append(row)
                print(f"  {variant:10} {c}{t}: {row}", flush=True)
    finally:
        driver.close()
    ok = [r for r in rows if r["status"] == 200]
    follow = [r for r in ok if r["history_tokens"]]
    ttfts = sorted(r["ttft_s"] for r in ok)
    out = {
        "variant": variant,
        "budget_bytes": budget,
        "turns": rows,
        "refusals_507": sum(r["status"] == 507 for r in rows),
        "cached_ratio": (
            sum(min(r["cached_tokens"], r["history_tokens"]) for r in follow)
            / max(1, sum(r["history_tokens"] for r in follow))
        ),
        "prefilled_mean": statistics.mean(r["prefilled"] for r in ok) if ok else 0,
        "prefilled_total": sum(r["prefilled"] for r in ok),
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p99_s": _pct(ttfts, 99),
        "peak_kv_bytes": bank.stats.peak_bytes,
        "bank": {
            "entries": len(bank),
            "unique_bytes": bank.unique_bytes(),
            "evictions": bank.stats.evictions,
            "refusals": bank.stats.refusals,
        },
    }
    if engine.shape.device.type == "cuda":
        torch.cuda.synchronize()
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def _pct(xs: list[float], p: int) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--shape", help="random weights of a named shape (llama3-8b, qwen3-8b, ...)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--mode", choices=["http", "in-process"], default="http")
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--user-tokens", dest="user_tokens", type=int, default=400)
    ap.add_argument("--answer-tokens", dest="answer_tokens", type=int, default=48)
    ap.add_argument(
        "--bank-bytes",
        dest="bank_bytes",
        default="",
        help="budget per variant; default: 1.2x the unique KV of all conversations at the end + activations",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="default: segmented,contiguous,recompute (batched,serial,recompute with --clients; "
        "also plain: batched without run-ahead)",
    )
    ap.add_argument("--clients", type=int, default=0, help="concurrent clients (bench/clients.py)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--ignore-eos",
        dest="ignore_eos",
        action="store_true",
        help="(--clients) every answer runs to its length",
    )
    ap.add_argument(
        "--warmup-rounds",
        dest="warmup_rounds",
        type=int,
        default=None,
        help="(--clients) rounds of an untimed batched run first, so no variant pays kernel compiles "
        "(default: --rounds; 0: none)",
    )
    ap.add_argument("--max-running", dest="max_running", type=int, default=64)
    ap.add_argument("--max-batch-tokens", dest="max_batch_tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculate", choices=["auto", "off"], default="auto", help="(--clients) the engine's")
    ap.add_argument("--tag", default="server_multiturn")
    args = ap.parse_args()
    from turnkv.threads import set_threads

    set_threads(0)  # torch threads = the cores available, as the CLI does
    if args.clients:
        return run_clients(args)

    model = f"random:{args.shape}" if args.shape else args.model
    base = EngineConfig(model=model, device=args.device, dtype=args.dtype)
    first = load_engine(replace(base, kv_layout="segmented"), progress=False)
    per_turn = args.user_tokens + args.answer_tokens + 16  # + template tokens
    final_rows = args.conversations * args.turns * per_turn
    # default: the unique KV of every conversation at the end, 20 % slack, and one prefill
    # chunk's activations at that length -- enough for segments, tight for copies
    budget = (
        parse_size(args.bank_bytes)
        if args.bank_bytes
        else int(1.2 * final_rows * first.shape.bytes_per_row)
        + activation_bytes(first.footprint, first.prefill_chunk, final_rows)
    )
    note = " (random weights: speed and memory only)" if args.shape else ""
    print(
        f"# {first.info.model_name}{note} on {first.shape.device} {first.shape.dtype}, "
        f"attention={first.info.verdict.route}, mode={args.mode}, budget {budget / 2**20:.0f} MiB"
    )
    results = {
        "model": first.info.model_name,
        "random_weights": bool(args.shape),
        "device": str(first.shape.device),
        "dtype": str(first.shape.dtype),
        "attention": first.info.verdict.route,
        "mode": args.mode,
        "args": vars(args),
        "variants": [],
    }
    for variant in (args.variants or "segmented,contiguous,recompute").split(","):
        layout = "contiguous" if variant == "contiguous" else "segmented"
        engine = Engine(first.loaded, replace(base, kv_layout=layout))  # same weights, fresh state
        results["variants"].append(run_variant(engine, variant, args, budget))

    print(
        f"\n{'variant':>10} | {'507s':>4} | {'cached':>6} | {'prefilled/turn':>14} | "
        f"{'TTFT p50':>8} | {'TTFT p99':>8} | {'peak KV MiB':>11} | {'evictions':>9}"
    )
    for v in results["variants"]:
        print(
            f"{v['variant']:>10} | {v['refusals_507']:>4} | {v['cached_ratio']:>6.1%} | "
            f"{v['prefilled_mean']:>14.0f} | {v['ttft_p50_s']:>7.2f}s | {v['ttft_p99_s']:>7.2f}s | "
            f"{v['peak_kv_bytes'] / 2**20:>11.1f} | {v['bank']['evictions']:>9}"
        )
    save(results, args.tag, _plot)


def run_clients(args: argparse.Namespace) -> None:
    """``--clients N``: concurrent clients, variants batched / serial / recompute (bench/clients.py)."""
    import clients

    model = f"random:{args.shape}" if args.shape else args.model
    cfg = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        prefill_chunk=args.max_batch_tokens,
        speculate=args.speculate,
    )
    engine = load_engine(cfg, progress=False)
    # random weights end answers at random: run each to its length; --ignore-eos does it for a real
    # model too (every answer A tokens: no client's longer answers leave it decoding alone at the end)
    args.ignore_eos = bool(args.shape) or args.ignore_eos
    per_client = args.rounds * (args.user_tokens + args.answer_tokens + 32)
    budget = (
        parse_size(args.bank_bytes)
        if args.bank_bytes
        else int(1.3 * args.clients * per_client * engine.shape.bytes_per_row)
        + 2 * activation_bytes(engine.footprint, args.max_batch_tokens, per_client)
    )
    info = engine.info
    print(
        f"# {info.model_name} on {info.device} {info.dtype}, attention {info.verdict.route}, graphs "
        f"{info.graphs}, speculation {args.speculate}: {args.clients} clients x {args.rounds} rounds x {args.user_tokens}-token user "
        f"turns, {args.answer_tokens}-token answers, budget {budget / 2**30:.2f} GiB",
        flush=True,
    )
    warmup = None
    rounds = args.rounds if args.warmup_rounds is None else args.warmup_rounds
    if rounds:
        # Every kernel specialization a batched step needs is compiled here, not inside a variant
        # timed: Triton compiles per block configuration, and contexts that grow round after round
        # meet new ones, so the warm-up runs the whole workload once (H200, 64 clients x 5 rounds:
        # batched 1353 tok/s after a one-round warm-up, 1674-1691 after a full one).
        t0 = time.perf_counter()
        clients.run(engine, "batched", argparse.Namespace(**{**vars(args), "rounds": rounds}), budget)
        warmup = {"rounds": rounds, "wall_s": round(time.perf_counter() - t0, 2)}
        print(f"  warm-up (batched, {rounds} round(s), not counted): {warmup['wall_s']} s", flush=True)
    runs = []
    for variant in (args.variants or "batched,serial,recompute").split(","):
        runs.append(clients.run(engine, variant, args, budget))
        print(f"  {variant}: {runs[-1]}", flush=True)
    clients.table(runs)
    results = {
        "model": info.model_name,
        "device": info.device,
        "dtype": info.dtype,
        "args": vars(args),
        "warmup": warmup,
        "runs": runs,
    }
    save(results, args.tag, _plot_clients)


def _plot_clients(results: dict, plt, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    runs = results["runs"]
    names = [r["variant"] for r in runs]
    axes[0].bar(names, [r["output_tok_s"] for r in runs])
    axes[0].set(ylabel="output tokens/s", title="throughput")
    for i, p in enumerate(("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")):
        axes[1].bar([x + 0.27 * i for x in range(len(runs))], [r[p] for r in runs], width=0.27, label=p)
    axes[1].set_xticks(range(len(runs)), names)
    axes[1].set(ylabel="seconds", title="time to first token")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{results['model']} on {results['device']}: concurrent clients")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot(results: dict, plt, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for v in results["variants"]:
        ok = [r for r in v["turns"] if r["status"] == 200]
        xs = [f"{r['conv']}{r['turn']}" for r in ok]
        axes[0].plot(xs, [r["prefilled"] for r in ok], "-o", label=v["variant"])
        axes[1].plot(xs, [r["ttft_s"] for r in ok], "-o", label=v["variant"])
        bad = [f"{r['conv']}{r['turn']}" for r in v["turns"] if r["status"] != 200]
        if bad:
            axes[1].plot(bad, [0] * len(bad), "x", color="red", label=f"{v['variant']}: 507")
    axes[0].set(xlabel="request", ylabel="prompt rows prefilled", title="rows computed per turn")
    axes[1].set(xlabel="request", ylabel="TTFT (s)", title="time to first token")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    fig.suptitle(f"{results['model']} on {results['device']}: interleaved conversations")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

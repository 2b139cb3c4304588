"""Follow-up turns at growing context: segmented against contiguous, in one process.

Each layout runs the same conversation: a first turn of ``--history`` prompt tokens, then
``--turns`` follow-up turns of ``--new`` prompt tokens and ``--gen`` generated tokens each, through
the server's turn path (``engine.turn``: admission, restore from the bank, steps, seal, bank):
the next turn restores from the banked snapshot (zero-copy for segments, a copy for the
contiguous layout). Per turn it reports prompt tokens prefilled, TTFT, decode tok/s and peak
memory above the turn's start: on CUDA ``torch.cuda.max_memory_allocated`` (all allocations: KV,
activations, restore copies); on CPU the most unique KV bytes the bank measured at the turn's end
(banked snapshots, the live cache and the new snapshot).

    python bench/multiturn.py                                     # default model, CPU
    python bench/multiturn.py --shape llama3-8b --device cuda --history 8192,32768,65536

Prints a table, writes ``bench/out/multiturn.json`` and ``bench/out/multiturn.png``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch
from report import save

from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import Banked, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.runtime import build, load_engine


def _mem_now(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def run_layout(engine: Engine, history: int, args: argparse.Namespace, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.loaded.config.vocab_size
    special = set(engine.tokenizer.eos_token_ids)

    def tokens(n: int) -> list[int]:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        return [t if t not in special else (t + 1) % vocab for t in ids]

    params = SamplingParams(ignore_eos=True)
    cuda = engine.shape.device.type == "cuda"
    rt = build(engine.cfg, "bench", engine=engine)
    bank = rt.new_bank()
    prompt: list[int] = []
    rows = []
    for turn in range(args.turns + 1):
        prompt = prompt + tokens(history if turn == 0 else args.new)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start_mem = _mem_now(engine.shape.device)
        start_kv = bank.unique_bytes()
        bank.stats.peak_bytes = start_kv
        t0 = time.perf_counter()
        stats, generated, banked = None, [], None
        for ev in rt.run_turn(TurnRequest(prompt, params, max_tokens=args.gen), bank):
            if isinstance(ev, GenEvent):
                if ev.token_id is not None:
                    generated.append(ev.token_id)
                stats = ev.stats or stats
            elif isinstance(ev, Banked):
                banked = ev
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start_mem
        else:
            peak = bank.stats.peak_bytes - start_kv
        wall = time.perf_counter() - t0
        entry = next(e for e in bank.entries() if e.id == banked.entry_id)
        prompt = prompt + generated[:-1]  # what the client resends: history + the answer
        rows.append(
            {
                "turn": turn,
                "context": stats.prompt_tokens,
                "cached": stats.cached_tokens,
                "prefilled": stats.prefilled_tokens,
                "ttft_s": stats.ttft_s,
                "decode_tok_s": stats.decode_tok_s,
                "peak_above_start_bytes": peak,
                "kv_banked_bytes": bank.unique_bytes(live=False),
                "turn_s": wall,
                "segments": len(entry.snapshot.segments()),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument(
        "--shape", help="random weights of llama3-8b | qwen3-8b | qwen3-32b (speed and memory only)"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--history", default="1024,2048", help="comma-separated first-turn sizes")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--tag", default="multiturn")
    args = ap.parse_args()

    model = f"random:{args.shape}" if args.shape else args.model
    base = EngineConfig(model=model, device=args.device, dtype=args.dtype, attention=args.attention)
    seg = load_engine(replace(base, kv_layout="segmented"), progress=False)
    # the same weights behind both layouts: one model, two engines
    con = Engine(seg.loaded, replace(base, kv_layout="contiguous"))
    info = seg.info
    results = {
        "model": info.model_name,
        "random_weights": bool(args.shape),
        "device": info.device,
        "dtype": info.dtype,
        "attention": info.verdict.route,
        "runs": [],
    }
    print(
        f"# {info.model_name}{' (random weights: speed and memory only)' if args.shape else ''} "
        f"on {info.device} {info.dtype}, attention={info.verdict.route}"
    )
    for history in [int(h) for h in args.history.split(",")]:
        for name, engine in (("segmented", seg), ("contiguous", con)):
            rows = run_layout(engine, history, args, seed=history)
            results["runs"].append({"layout": name, "history": history, "turns": rows})

    hdr = (
        f"{'hist':>6} {'turn':>4} {'ctx':>7} | {'prefilled':>9} {'ttft s':>7} {'tok/s':>6} {'peak MiB':>9} | "
        f"{'prefilled':>9} {'ttft s':>7} {'tok/s':>6} {'peak MiB':>9} | {'peak ratio':>10}"
    )
    print(f"{'':20} | {'segmented':^35} | {'contiguous':^35} |")
    print(hdr)
    by = {(r["layout"], r["history"]): r["turns"] for r in results["runs"]}
    for history in sorted({r["history"] for r in results["runs"]}):
        for s, c in zip(by[("segmented", history)], by[("contiguous", history)], strict=True):
            ratio = c["peak_above_start_bytes"] / max(1, s["peak_above_start_bytes"])
            print(
                f"{history:>6} {s['turn']:>4} {s['context']:>7} | {s['prefilled']:>9} {s['ttft_s']:>7.3f} "
                f"{s['decode_tok_s']:>6.1f} {s['peak_above_start_bytes'] / 2**20:>9.1f} | {c['prefilled']:>9} "
                f"{c['ttft_s']:>7.3f} {c['decode_tok_s']:>6.1f} {c['peak_above_start_bytes'] / 2**20:>9.1f} | "
                f"{ratio:>9.2f}x"
            )
    results["counters"] = seg.counters()
    save(results, args.tag, _plot)


def _plot(results: dict, plt, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in results["runs"]:
        ctx = [r["context"] for r in run["turns"][1:]]
        style = "-o" if run["layout"] == "segmented" else "--s"
        label = f"{run['layout']} h={run['history']}"
        axes[0].plot(ctx, [r["peak_above_start_bytes"] / 2**20 for r in run["turns"][1:]], style, label=label)
        axes[1].plot(ctx, [r["ttft_s"] for r in run["turns"][1:]], style, label=label)
    axes[0].set(
        xlabel="context tokens", ylabel="peak above turn start (MiB)", title="follow-up turns: memory"
    )
    axes[1].set(xlabel="context tokens", ylabel="TTFT (s)", title="follow-up turns: time to first token")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{results['model']} on {results['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

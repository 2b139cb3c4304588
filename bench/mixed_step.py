"""Host and device time of a step that mixes a prompt chunk with decode rows: eager against a
captured graph (engine/graphs.py), one process, one model.

Each step holds ``--decode`` one-row windows (conversations at ``--context`` keys, four views
each) and one prompt chunk that fills the step to ``rows`` (after ``--prefix`` rows of its own
prompt). The same staged windows run through the engine with its graphs (``graphed``) and with
them swapped for ``NoGraphs`` (``eager``, the path steps with prompt rows took before). Per step:

- ``host_ms``: the engine's host time to stage and launch it (``Engine.run_step`` returning);
  the GPU is held busy by a sleep kernel meanwhile, so the host never waits on it;
- ``device_ms``: CUDA-event time of the step's kernels, queued behind that sleep (pure device);
- ``step_ms`` and ``tok_s``: steps back to back (rows per second), the host and device overlapping
  as they can.

    python bench/mixed_step.py --shape llama3-8b --rows 64,256,1024,4096 --decode 32 --json

Prints a table, then (``--json``) one JSON object as its last line; writes bench/out/mixed_step.json/.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from decode import synthetic_history
from report import save

from turnkv.config import EngineConfig
from turnkv.engine.graphs import NoGraphs
from turnkv.engine.step import Window
from turnkv.runtime import load_engine

SLEEP_CYCLES = 400_000_000  # ~0.2 s on an H200: longer than any step's host work


def windows_for(engine, rows: int, args, seed: int) -> list[Window]:
    """``args.decode`` decode windows and one prompt chunk of ``rows - args.decode`` rows."""
    out = []
    for i in range(args.decode):
        cache = engine.restore(synthetic_history(engine, args.context, seed + i))
        cache.presize(args.context + 8)
        out.append(Window(cache, [17 + i], 1))
    prompt = engine.restore(synthetic_history(engine, args.prefix, seed + 999))
    chunk = rows - args.decode
    prompt.presize(args.prefix + chunk)
    out.append(Window(prompt, [(5 + 3 * j) % 1000 for j in range(chunk)], 1))
    return out


def measure(engine, windows: list[Window], repeats: int) -> dict:
    for _ in range(3):  # capture (graphed), compile (both)
        engine.run_step(windows)
    torch.cuda.synchronize()
    host, device = [], []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        e0.record()
        t0 = time.perf_counter()
        engine.run_step(windows)
        host.append((time.perf_counter() - t0) * 1e3)
        e1.record()
        e1.synchronize()
        device.append(e0.elapsed_time(e1))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        res = engine.run_step(windows)
        res.logits.argmax(-1)  # (what a step's finalize starts with)
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / repeats
    rows = sum(len(w.tokens) for w in windows)
    return {
        "host_ms": statistics.median(host),
        "device_ms": statistics.median(device),
        "step_ms": step_ms,
        "tok_s": rows / step_ms * 1e3,
    }


def plot(results: dict, plt, path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, style in (("eager", "o--"), ("graphed", "o-")):
        pts = [r for r in results["runs"] if r["mode"] == mode]
        ax.plot([r["rows"] for r in pts], [r["host_ms"] for r in pts], style, label=f"{mode} host")
        ax.plot(
            [r["rows"] for r in pts], [r["device_ms"] for r in pts], style, alpha=0.5, label=f"{mode} device"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"rows per step ({results['decode']} decode rows + one prompt chunk)")
    ax.set_ylabel("ms per step")
    ax.legend()
    ax.set_title(f"mixed step, {results['shape']} on {results['gpu']}")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", help="random weights: llama3-8b | qwen3-8b | test")
    ap.add_argument("--rows", default="64,256,1024,4096")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048, help="keys of each decode row")
    ap.add_argument("--prefix", type=int, default=1024, help="prompt rows before the chunk")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = EngineConfig(model=f"random:{args.shape}", device="cuda", dtype="bfloat16", speculate="off")
    engine = load_engine(cfg)
    graphs, eager = engine.graphs, NoGraphs("off: eager baseline")
    runs = []
    for rows in (int(r) for r in args.rows.split(",")):
        windows = windows_for(engine, rows, args, seed=rows)
        for mode, g in (("eager", eager), ("graphed", graphs)):
            engine.graphs = g
            runs.append({"mode": mode, "rows": rows, **measure(engine, windows, args.repeats)})
        engine.graphs = graphs
        del windows
        torch.cuda.empty_cache()
    results = {"shape": args.shape, "decode": args.decode, "context": args.context, "prefix": args.prefix,
               "gpu": torch.cuda.get_device_name(), "captures": graphs.captures, "runs": runs}  # fmt: skip
    print(f"{'rows':>6} {'mode':>8} {'host ms':>8} {'device ms':>9} {'step ms':>8} {'tok/s':>9}")
    for r in runs:
        print(f"{r['rows']:>6} {r['mode']:>8} {r['host_ms']:>8.2f} {r['device_ms']:>9.2f} "
              f"{r['step_ms']:>8.2f} {r['tok_s']:>9.0f}")  # fmt: skip
    by = {(r["mode"], r["rows"]): r for r in runs}
    for rows in sorted({r["rows"] for r in runs}):
        e, g = by[("eager", rows)], by[("graphed", rows)]
        print(f"{rows:>6} rows: host {e['host_ms'] / g['host_ms']:.1f}x less, "
              f"step {e['step_ms'] / g['step_ms']:.2f}x faster")  # fmt: skip
    save(results, "mixed_step", plot)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()

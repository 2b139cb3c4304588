"""``bench/decode.py --tensor-parallel N``: the same decode runs on 1 GPU and on a group of N.

Each group size runs in fresh processes (``turnkv.parallel.spmd.run_group``: one per GPU, NCCL
between them; gloo on a CPU), every rank running ``decode.measure`` alike (the turns are greedy
and their inputs seeded, so the ranks stay in step with no control messages); rank 0's figures
come back. Printed per batch: tokens/s on each size and the ratio to one GPU; and the KV
capacity: the tokens ``--bank-bytes auto`` holds on each size (each rank's budget over its share
of a row), with its ratio. This process never touches the GPUs itself.

    # 8B: one GPU against two, batch 1 and 32 at 8K (the lent 2 x H200)
    python bench/decode.py --shape llama3-8b --device cuda --tensor-parallel 2 --batch 1,32 \\
        --context 8192 --gen 128 --layouts segmented --tag tp_8b --json
    # 70B does not fit one H200 (141 GB of bf16 weights): two only
    python bench/decode.py --shape llama3-70b --device cuda --tensor-parallel 2 --sizes 2 \\
        --batch 1,32 --context 8192 --gen 96 --layouts segmented --tag tp_70b --json
    # the all-reduce A/B: a size written N:nccl keeps every all-reduce on NCCL (one_shot.py)
    python bench/decode.py --shape llama3-8b --device cuda --tensor-parallel 2 --sizes 1,2,2:nccl ...
"""

from __future__ import annotations

import json
import os

from report import save

from turnkv.parallel.one_shot import ENV as ALL_REDUCE_ENV
from turnkv.parallel.spmd import run_group


def compare(args, rank_fn, plot_one) -> dict:
    n = args.tensor_parallel
    labels = [x for x in (args.sizes or f"1,{n}").split(",") if x]  # N, or N:nccl (all-reduce A/B)
    sizes = [int(x.split(":")[0]) for x in labels]
    if args.layouts == "segmented,contiguous":  # the A/B of layouts is decode.py's plain run
        args.layouts = "segmented"
    cpu = args.device == "cpu" or (args.device == "auto" and not _has_cuda())
    by_size: dict[str, dict] = {}
    for label, size in zip(labels, sizes, strict=True):
        argv = {**vars(args), "tensor_parallel": size}
        # on a CPU every size gets the same threads per rank (what the largest group can give)
        threads = max(1, (os.cpu_count() or 1) // max(sizes)) if cpu else 0
        print(f"## {label} {'process' if size == 1 else 'processes'}", flush=True)
        os.environ[ALL_REDUCE_ENV] = label.partition(":")[2] or "auto"  # the spawned ranks read it
        by_size[label] = run_group(size, args.device, rank_fn, argv, threads=threads, timeout_s=3600)[0]
    os.environ.pop(ALL_REDUCE_ENV, None)
    results = {"tensor_parallel": n, "sizes": labels, "by_size": by_size}
    results["speedup"] = _speedups(by_size)
    _print_table(by_size, results["speedup"])
    save(results, args.tag, lambda res, plt, path: _plot(res, plt, path, plot_one))
    if args.json:
        print(json.dumps(results))
    return results


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _speedups(by_size: dict[str, dict]) -> list[dict]:
    """Per size and batch: tok/s and the ratio to one process; KV capacity and its ratio."""
    base = by_size.get("1")
    out = []
    for size, res in by_size.items():
        for run in res["runs"]:
            if "tok_s" not in run:
                continue
            ref = (
                next((r for r in base["runs"] if r["batch"] == run["batch"] and "tok_s" in r), None)
                if base
                else None
            )
            out.append({
                "gpus": size, "batch": run["batch"], "context": run["context"], "tok_s": run["tok_s"],
                "step_ms": run["step_ms"], "x_one": ref and round(run["tok_s"] / ref["tok_s"], 3),
                "kv_tokens": res["kv_capacity"]["tokens"],
                "kv_x_one": base and round(res["kv_capacity"]["tokens"] / base["kv_capacity"]["tokens"], 3),
            })  # fmt: skip
    return out


def _print_table(by_size: dict[str, dict], rows: list[dict]) -> None:
    model = next(iter(by_size.values()))["model"]
    print(f"\n{model}: decode tok/s and KV capacity by group size (x one = ratio to one process)")
    print(f"{'gpus':>7} {'batch':>6} {'context':>8} {'tok/s':>10} {'step ms':>9} {'x one':>7} "
          f"{'KV tokens':>12} {'x one':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['gpus']:>7} {r['batch']:>6} {r['context']:>8} {r['tok_s']:>10.1f} {r['step_ms']:>9.3f} "
              f"{r['x_one'] or '-':>7} {r['kv_tokens']:>12} {r['kv_x_one'] or '-':>7}")  # fmt: skip


def _plot(results: dict, plt, path, plot_one) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for size in results["sizes"]:
        rs = [r for r in results["speedup"] if r["gpus"] == size]
        ax.plot([r["batch"] for r in rs], [r["tok_s"] for r in rs], "-o", label=f"{size} GPU(s)")
    model = next(iter(results["by_size"].values()))["model"]
    ax.set(xscale="log", yscale="log", xlabel="conversations per step", ylabel="decode tokens/s",
           title=f"{model}: tensor parallel")  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

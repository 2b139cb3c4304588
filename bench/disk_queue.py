"""What queueing a finished turn's blocks for the disk tier costs the engine thread, in one process.

At every turn's end the bank hands the turn's snapshot to ``DiskTier.write_behind``, on the
engine thread, between two steps: whatever it waits for, every running turn waits for. Three
ways, each over ``--turns`` fresh snapshots of ``--tokens`` tokens (random rows, whole blocks
queued) of one rank's KV shape:

- ``writer``: one process's tier: the queue keeps the snapshot; the writer thread copies the rows
  to the host later, on a stream of its own;
- ``rank``: a tier of one rank under tensor parallelism (``agree`` set): the rows leave the
  snapshot when queued (the bank must count alike on every rank), copied on a stream of their
  own after the kernels that made them, the engine thread only launching the copies;
- ``rank-sync`` (the baseline, what the rank's queue did before): the same rows copied to pinned
  host memory on the engine thread's stream and waited for.

Per way: the engine thread's time in the call (median, p90, max) and, for the two that queue, the
time until every block is on disk (``flush``). Before each call the device is given ``--busy``
matmuls (~10 ms on an H200), as a turn ends while the next step is in flight (run-ahead): a copy
on the engine thread's stream waits for them.

    python bench/disk_queue.py --shape llama3-8b --tp 2 --device cuda

Prints a table, writes ``bench/out/<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from report import OUT, save

from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef
from turnkv.models.load import SHAPES

WAYS = ("writer", "rank", "rank-sync")


def busy(device: torch.device, matmuls: int) -> None:
    """Keep the device busy (the step in flight when a turn ends: with run-ahead there is always
    one): ``matmuls`` bf16 4096x4096 products, ~0.2 ms each on an H200."""
    if device.type != "cuda":
        return
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(matmuls):
        x = torch.tanh(x @ x)


def snapshot(shape: KVShape, tokens: list[int], seed: int) -> SegmentedSnapshot:
    """Two segments (the history and this turn), rows made on the device."""
    g = torch.Generator(device=shape.device).manual_seed(seed)
    cut = len(tokens) // 3
    refs = []
    for lo, hi in ((0, cut), (cut, len(tokens))):
        dims = (shape.num_layers, shape.num_kv_heads, hi - lo, shape.head_dim)
        k = torch.randn(dims, generator=g, device=shape.device).to(shape.dtype)
        refs.append(SegmentRef(Segment(k, -k, tuple(tokens[lo:hi])), hi - lo))
    return SegmentedSnapshot(refs)


def copy_sync(snap: SegmentedSnapshot, blocks: int) -> None:
    """The baseline: every whole block's rows into pinned host memory, waited for."""
    for d in range(blocks):
        k, v = snap.read_rows(d * BLOCK_TOKENS, (d + 1) * BLOCK_TOKENS)
        hk = torch.empty(k.shape, dtype=k.dtype, pin_memory=k.is_cuda)
        hv = torch.empty(v.shape, dtype=v.dtype, pin_memory=v.is_cuda)
        hk.copy_(k)
        hv.copy_(v)


def run_way(way: str, shape: KVShape, args, root: Path) -> dict:
    where = root / way
    agree = (lambda n: n) if way != "writer" else None  # one rank's tier: no other rank to ask
    tier = DiskTier.open(where, "bench", shape, 1 << 40, agree=agree)
    calls = []
    flushes = []
    blocks = args.tokens // BLOCK_TOKENS
    for t in range(args.warmup + args.turns):
        tokens = [(t * 7919 + i) % 32000 for i in range(args.tokens)]
        snap = snapshot(shape, tokens, seed=t)
        busy(shape.device, args.busy)
        t0 = time.perf_counter()
        if way == "rank-sync":
            copy_sync(snap, blocks)
        else:
            tier.write_behind(f"c{t}", snap)
        t1 = time.perf_counter()
        del snap
        if way != "rank-sync":
            tier.flush(120)
        t2 = time.perf_counter()
        if t >= args.warmup:
            calls.append(1e3 * (t1 - t0))
            flushes.append(1e3 * (t2 - t0))
    tier.close()
    calls.sort()
    return {
        "way": way,
        "blocks_per_turn": blocks,
        "call_ms_median": statistics.median(calls),
        "call_ms_p90": calls[int(0.9 * (len(calls) - 1))],
        "call_ms_max": calls[-1],
        "on_disk_ms_median": statistics.median(flushes) if way != "rank-sync" else None,
        "call_ms": calls,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", help=f"KV geometry of: {', '.join(sorted(SHAPES))}")
    ap.add_argument("--tp", type=int, default=2, help="ranks: each holds num_kv_heads / tp heads")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=600, help="tokens per finished turn")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--busy", type=int, default=50, help="matmuls in flight when each turn ends")
    ap.add_argument("--dir", help="where the blocks go (default: a temp folder in bench/out)")
    ap.add_argument("--tag", default="disk_queue")
    args = ap.parse_args()

    cfg = SHAPES[args.shape]
    heads = cfg.num_kv_heads // args.tp
    shape = KVShape(cfg.num_layers, heads, cfg.head_dim, torch.bfloat16, torch.device(args.device))
    block_mib = shape.bytes_per_row * BLOCK_TOKENS / 2**20
    OUT.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="disk-queue-", dir=args.dir or OUT))
    print(
        f"# {args.shape} KV of one rank of {args.tp} ({heads} KV heads, {shape.dtype}) on {shape.device}: "
        f"{args.tokens}-token turns, {args.tokens // BLOCK_TOKENS} whole blocks of {block_mib:.1f} MiB each"
    )
    results = {"shape": args.shape, "tp": args.tp, "device": args.device, "args": vars(args), "ways": []}
    for way in WAYS:
        results["ways"].append(run_way(way, shape, args, root))
    shutil.rmtree(root, ignore_errors=True)
    base = next(r for r in results["ways"] if r["way"] == "rank-sync")["call_ms_median"]
    print(
        f"{'way':>10} | {'engine thread ms: median':>24} {'p90':>7} {'max':>7} | {'on disk ms':>10} | vs rank-sync"
    )
    for r in results["ways"]:
        disk = f"{r['on_disk_ms_median']:>10.1f}" if r["on_disk_ms_median"] is not None else f"{'-':>10}"
        print(
            f"{r['way']:>10} | {r['call_ms_median']:>24.3f} {r['call_ms_p90']:>7.3f} {r['call_ms_max']:>7.3f} | "
            f"{disk} | {base / max(r['call_ms_median'], 1e-9):.1f}x less"
        )
    save(results, args.tag, _plot)


def _plot(results: dict, plt, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results["ways"]:
        ax.plot(r["call_ms"], "o-", label=r["way"], markersize=3)
    ax.set_yscale("log")
    ax.set_xlabel("finished turn (sorted)")
    ax.set_ylabel("engine thread ms in the call")
    ax.set_title(f"queueing a turn's blocks: {results['shape']} KV, one rank of {results['tp']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

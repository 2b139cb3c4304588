"""The disk tier's writer against the disk's own fsync'd write rate, in one process and one run.

*Disk* is what the device writes with fsync, as ``dd bs=<block> count=<n> conv=fsync`` measures
it: ``--blocks`` blocks' worth of bytes written to one file in block-sized writes, then one fsync.
The tier's writers are then fed the same number of blocks from host memory, as the RAM tier feeds
them (``DiskTier.write_host``: no device copy), ``--per-turn`` blocks per finished turn, and timed
from the first queued turn until every block is durable and indexed (``flush``). Ways:

- ``one-per-fsync`` (the baseline: the old writer): one thread, one block per batch, so one file
  fsync, one directory fsync and one index commit per block;
- ``batch-1``: one thread, batches of ``BATCH_BYTES`` (several files per round of fsyncs, one
  commit per batch);
- ``batch-N``: the default writer: ``WRITERS`` threads writing batches;
- ``batch-4``: four threads (where the default is fewer).

The disk is measured before and after the ways (its rate drifts on shared machines); the ratio
is against their mean.

    python bench/disk_write.py                                # the default model's block size
    python bench/disk_write.py --shape llama3-8b --blocks 96  # 32 MiB blocks

Prints a table, writes ``bench/out/<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from report import OUT, save

from turnkv.bank.disk import WRITERS, DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS
from turnkv.kv.cache import KVShape
from turnkv.models.load import SHAPES

DEFAULT_SHAPE = KVShape(30, 3, 64, torch.bfloat16, torch.device("cpu"))  # SmolLM2-135M's KV


def dd_rate(root: Path, block_bytes: int, blocks: int) -> float:
    """GB/s of ``dd bs=block_bytes count=blocks conv=fsync`` (written from one buffer, as dd)."""
    buf = os.urandom(block_bytes)
    path = root / "dd.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(blocks):
            f.write(buf)
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return block_bytes * blocks / dt / 1e9


def tier_rate(
    root: Path, shape: KVShape, blocks: int, per_turn: int, writers: int, batch: int | None
) -> dict:
    """GB/s of a fresh tier writing ``blocks`` blocks fed from host rows, until all are durable."""
    folder = Path(tempfile.mkdtemp(dir=root))
    tier = DiskTier.open(folder, "bench", shape, 1 << 50, writers=writers, batch_blocks=batch)
    dims = (shape.num_layers, shape.num_kv_heads, BLOCK_TOKENS, shape.head_dim)
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(dims, generator=g).to(shape.dtype), torch.randn(dims, generator=g).to(shape.dtype))]
    rows.append(rows[0])  # the bytes need not differ: every block has its own key and checksum
    turns = [
        (t, list(range(t * 10**6, t * 10**6 + per_turn * BLOCK_TOKENS))) for t in range(blocks // per_turn)
    ]
    t0 = time.perf_counter()
    for t, tokens in turns:
        tier.write_host(f"c{t}", tuple(tokens), {d: rows[d % 2] for d in range(per_turn)})
    tier.flush()
    dt = time.perf_counter() - t0
    h = tier.health()
    tier.close()
    shutil.rmtree(folder, ignore_errors=True)
    nbytes = h["bytes"]
    return {
        "seconds": dt,
        "bytes": nbytes,
        "gb_s": nbytes / dt / 1e9,
        "writes": h["writes"],
        "dropped": h["dropped_writes"],
        "failures": h["write_failures"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", help=f"KV geometry of: {', '.join(sorted(SHAPES))} (default: SmolLM2-135M)")
    ap.add_argument("--blocks", type=int, default=256, help="blocks each way writes")
    ap.add_argument("--per-turn", type=int, default=8, help="blocks per finished turn")
    ap.add_argument("--dir", help="where the files go (default: a temp folder in bench/out)")
    ap.add_argument("--tag", default="disk_write")
    args = ap.parse_args()
    if args.shape:
        c = SHAPES[args.shape]
        shape = KVShape(c.num_layers, c.num_kv_heads, c.head_dim, torch.bfloat16, torch.device("cpu"))
    else:
        shape = DEFAULT_SHAPE
    block = BLOCK_TOKENS * shape.bytes_per_row
    OUT.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="disk-write-", dir=args.dir or OUT))
    ways = [("one-per-fsync", 1, 1), ("batch-1", 1, None), (f"batch-{WRITERS}", WRITERS, None)]
    if WRITERS != 4:
        ways.append(("batch-4", 4, None))
    print(
        f"# blocks of {block / 2**20:.1f} MiB ({args.shape or 'SmolLM2-135M'} KV), {args.blocks} per way, "
        f"{args.per_turn} per turn, in {root}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    disk = [dd_rate(root, block, args.blocks)]
    rows = [
        {"way": w, "writers": n, "batch_blocks": b} | tier_rate(root, shape, args.blocks, args.per_turn, n, b)
        for w, n, b in ways
    ]
    disk.append(dd_rate(root, block, args.blocks))
    shutil.rmtree(root, ignore_errors=True)
    ref = sum(disk) / len(disk)
    base = rows[0]["gb_s"]
    print(f"disk (dd conv=fsync, bs={block >> 10}K): {disk[0]:.3f} then {disk[1]:.3f} GB/s, mean {ref:.3f}")
    print(f"{'way':>14} {'writers':>7} {'GB/s':>7} {'of disk':>8} {'vs old':>7} {'dropped':>7}")
    for r in rows:
        r["of_disk"] = r["gb_s"] / ref
        print(
            f"{r['way']:>14} {r['writers']:>7} {r['gb_s']:>7.3f} {r['of_disk']:>7.0%} "
            f"{r['gb_s'] / base:>6.2f}x {r['dropped']:>7}"
        )
    results = {
        "shape": args.shape or "smollm2-135m",
        "block_bytes": block,
        "args": vars(args),
        "disk_gb_s": disk,
        "disk_mean_gb_s": ref,
        "ways": rows,
        "cpus": os.cpu_count(),
    }
    save(results, args.tag, _plot)


def _plot(results: dict, plt, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    names = ["disk (dd)"] + [r["way"] for r in results["ways"]]
    vals = [results["disk_mean_gb_s"]] + [r["gb_s"] for r in results["ways"]]
    ax.bar(names, vals, color=["gray"] + ["C0"] * len(results["ways"]))
    ax.axhline(0.7 * results["disk_mean_gb_s"], ls="--", color="C3", label="70 % of the disk")
    ax.set(ylabel="GB/s, fsync'd", title=f"disk writer, {results['block_bytes'] / 2**20:.1f} MiB blocks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

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

``--repeat`` rounds run every way once each (in a rotated order) with a ``dd`` before each round
and one after the last; each way's figure is the median of its rounds and the ratio is against
the median ``dd``. Each round also records the process's CPU share (CPU seconds over wall time)
and the load average: on a machine whose cores are shared, the writer (SHA-256 and encoding are
CPU work) waits for a core, which is what made single runs vary (docs/DISK.md, "The writer").

    python bench/disk_write.py                                # the default model's block size
    python bench/disk_write.py --shape llama3-8b --blocks 96  # 32 MiB blocks

Prints a table, writes ``bench/out/<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from report import OUT, save

from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS
from turnkv.bank.disk_writer import WRITERS
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
    """GB/s of a fresh tier writing ``blocks`` blocks fed from host rows, until all are durable;
    ``cpu_share``: this process's CPU seconds over the wall time (hashing and encoding are CPU
    work: on a loaded machine the writer waits for a core, not for the disk)."""
    folder = Path(tempfile.mkdtemp(dir=root))
    tier = DiskTier.open(folder, "bench", shape, 1 << 50, writers=writers, batch_blocks=batch)
    dims = (shape.num_layers, shape.num_kv_heads, BLOCK_TOKENS, shape.head_dim)
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(dims, generator=g).to(shape.dtype), torch.randn(dims, generator=g).to(shape.dtype))]
    rows.append(rows[0])  # the bytes need not differ: every block has its own key and checksum
    turns = [
        (t, list(range(t * 10**6, t * 10**6 + per_turn * BLOCK_TOKENS))) for t in range(blocks // per_turn)
    ]
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    for t, tokens in turns:
        tier.write_host(f"c{t}", tuple(tokens), {d: rows[d % 2] for d in range(per_turn)})
    tier.flush()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    h = tier.health()
    tier.close()
    shutil.rmtree(folder, ignore_errors=True)
    nbytes = h["bytes"]
    return {
        "seconds": dt,
        "bytes": nbytes,
        "gb_s": nbytes / dt / 1e9,
        "cpu_share": cpu / dt,
        "load": load,
        "writes": h["writes"],
        "dropped": h["dropped_writes"],
        "failures": h["write_failures"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", help=f"KV geometry of: {', '.join(sorted(SHAPES))} (default: SmolLM2-135M)")
    ap.add_argument("--blocks", type=int, default=256, help="blocks each way writes")
    ap.add_argument("--per-turn", type=int, default=8, help="blocks per finished turn")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of (dd, every way); medians are reported")
    ap.add_argument("--ways", help="a comma list of the ways to run (default: all)")
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
    ways = [
        ("one-per-fsync", 1, 1),
        ("batch-1", 1, None),
        (f"batch-{WRITERS}", WRITERS, None),
        ("batch-4", 4, None),
    ]
    ways = list({w[0]: w for w in ways}.values())  # batch-WRITERS may be batch-1 or batch-4
    if args.ways:
        keep = args.ways.split(",")
        ways = [w for w in ways if w[0] in keep]
    print(
        f"# blocks of {block / 2**20:.1f} MiB ({args.shape or 'SmolLM2-135M'} KV), {args.blocks} per way, "
        f"{args.per_turn} per turn, {args.repeat} rounds, in {root}; {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    disk: list[float] = []
    runs: dict[str, list[dict]] = {w: [] for w, _, _ in ways}
    for rep in range(args.repeat):  # dd beside every round: the disk's rate drifts between rounds
        disk.append(dd_rate(root, block, args.blocks))
        order = ways[rep % len(ways) :] + ways[: rep % len(ways)]  # no way always runs first
        for w, n, b in order:
            runs[w].append(tier_rate(root, shape, args.blocks, args.per_turn, n, b))
        print(
            f"# round {rep + 1}: dd {disk[-1]:.3f} GB/s; "
            + ", ".join(
                f"{w} {runs[w][-1]['gb_s']:.3f} (cpu {runs[w][-1]['cpu_share']:.2f})" for w, _, _ in ways
            )
        )
    disk.append(dd_rate(root, block, args.blocks))
    shutil.rmtree(root, ignore_errors=True)
    ref = statistics.median(disk)
    rows = []
    for w, n, b in ways:
        rates = [r["gb_s"] for r in runs[w]]
        mid = sorted(runs[w], key=lambda r: r["gb_s"])[len(rates) // 2]
        rows.append(
            {"way": w, "writers": n, "batch_blocks": b, "gb_s": statistics.median(rates)}
            | {k: mid[k] for k in ("cpu_share", "dropped", "failures", "writes")}
            | {"gb_s_min": min(rates), "gb_s_max": max(rates), "rounds": runs[w]}
        )
    base = rows[0]["gb_s"]
    print(
        f"disk (dd conv=fsync, bs={block >> 10}K): median {ref:.3f} GB/s of "
        + ", ".join(f"{d:.3f}" for d in disk)
    )
    print(f"{'way':>14} {'writers':>7} {'GB/s':>7} {'min-max':>13} {'of disk':>8} {'vs first':>8} {'cpu':>5}")
    for r in rows:
        r["of_disk"] = r["gb_s"] / ref
        print(
            f"{r['way']:>14} {r['writers']:>7} {r['gb_s']:>7.3f} {r['gb_s_min']:>6.3f}-{r['gb_s_max']:<6.3f} "
            f"{r['of_disk']:>7.0%} {r['gb_s'] / base:>7.2f}x {r['cpu_share']:>5.2f}"
        )
    results = {
        "shape": args.shape or "smollm2-135m",
        "block_bytes": block,
        "args": vars(args),
        "disk_gb_s": disk,
        "disk_mean_gb_s": ref,  # the median (the key kept for older readers)
        "disk_median_gb_s": ref,
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

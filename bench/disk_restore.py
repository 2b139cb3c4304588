"""Restoring a conversation's history from the RAM and disk tiers against recomputing it, in one process.

For each history size N (a multiple of 256 tokens): the history is prefilled once (the recompute
baseline, timed), sealed, and written to a fresh disk tier as N/256 blocks (timed). Then a fresh
session bank (memory empty, as after a restart) admits the follow-up prompt, history + ``--new``
tokens: the tier loads the N stored rows into one segment (each block read and checksummed),
and the engine prefills the ``--new`` rows. *Restore* is that whole path, admission to the
logits of the last prompt row; *recompute* is the prefill of all N + ``--new`` rows. Both end in
the same logits (the table shows the largest difference). The restore runs with the page cache
warm (the blocks were just written) and cold (every block file dropped from the page cache with
``POSIX_FADV_DONTNEED``; ``--drop-caches`` also drops the whole machine's page cache, root only).
The *RAM* column restores the same rows from the host-RAM tier (``bank.ram``: pinned host memory
and one H2D copy on a side stream on CUDA; a plain copy on a CPU), again admission to logits.

Dedupe: ``--convs`` conversations share a ``--shared``-token prefix and add ``--own`` tokens each;
their snapshots are written to one namespace (shared blocks stored once) and, for comparison, each
to its own namespace (no sharing); the table shows the bytes on disk of both.

    python bench/disk_restore.py                                       # default model, CPU
    python bench/disk_restore.py --shape llama3-8b --device cuda --tokens 4096,8192,32768

Imports nothing of the server (runs where fastapi is missing). Blocks go under ``--dir`` (default:
a temp folder in ``bench/out``, i.e. this checkout's disk; the filesystem type is reported).
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
from turnkv.bank.ram import RamTier
from turnkv.bank.records import Reservation
from turnkv.bank.session_bank import SessionBank
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.kv.segments import unique_bytes
from turnkv.runtime import load_engine

NO_LIMIT = 1 << 50


def sync(engine: Engine) -> None:
    if engine.shape.device.type == "cuda":
        torch.cuda.synchronize(engine.shape.device)


def random_ids(engine: Engine, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.loaded.config.vocab_size
    special = set(engine.tokenizer.eos_token_ids) | {engine.loaded.config.bos_token_id}
    return [
        t if t not in special else (t + 1) % vocab
        for t in torch.randint(0, vocab, (n,), generator=g).tolist()
    ]


def filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts; 'unknown' elsewhere)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _dev, mount, fs = line.split()[:3]
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fs
    except OSError:
        pass
    return kind


def drop_page_cache(root: Path, everything: bool) -> str:
    """Evict the block files from the page cache; returns how."""
    for f in root.rglob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if everything:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            return "fadvise+drop_caches"
        except OSError:
            pass
    return "fadvise"


def prefill_timed(engine: Engine, cache, ids: list[int]) -> tuple[torch.Tensor, float]:
    sync(engine)
    t0 = time.perf_counter()
    cache.presize(len(ids))
    logits = engine.prefill(cache, ids)
    sync(engine)
    return logits, time.perf_counter() - t0


def restore_timed(engine: Engine, tier: DiskTier | RamTier, ids: list[int]) -> dict:
    """Admission (tier lookup + load) then the prefill of the rest, as a server after a restart."""
    bank = SessionBank(NO_LIMIT, engine.shape.bytes_per_row, lambda held: unique_bytes(*held), tier=tier)
    sync(engine)
    t0 = time.perf_counter()
    lease = bank.admit("bench", ids, Reservation(1))
    sync(engine)
    t_load = time.perf_counter() - t0
    cache = engine.restore(lease.snapshot) if lease.snapshot is not None else engine.new_cache()
    logits, t_rest = prefill_timed(engine, cache, ids[lease.cached :])
    bank.finish(lease, None)
    return {
        "cached": lease.cached,
        "load_s": t_load,
        "rest_s": t_rest,
        "total_s": t_load + t_rest,
        "logits": logits,
    }


def run_size(engine: Engine, n: int, args, root: Path) -> dict:
    ids = random_ids(engine, n + args.new, seed=n)
    recompute = [prefill_timed(engine, engine.new_cache(), ids) for _ in range(args.recompute_repeat)]
    ref, t_re = recompute[-1][0], statistics.median(t for _, t in recompute)
    cache = engine.new_cache()
    engine.prefill(cache, ids[:n])
    cache.seal()
    snap = cache.snapshot()
    del cache
    folder = Path(tempfile.mkdtemp(prefix=f"disk{n}-", dir=root))
    tier = DiskTier.open(folder, engine.info.fingerprint, engine.shape, NO_LIMIT)
    t0 = time.perf_counter()
    tier.write_behind("bench", snap)
    tier.flush()
    t_write = time.perf_counter() - t0
    nbytes = tier.store.nbytes
    row = {"tokens": n, "new": args.new, "recompute_s": t_re, "write_s": t_write, "bytes_on_disk": nbytes}
    ram = RamTier(engine.info.fingerprint, engine.shape, n // BLOCK_TOKENS)
    ram.write_behind("bench", snap)
    ram.flush()
    del snap
    row["ram"] = _measured(
        restore_timed_runs(engine, ram, ids, args.repeat, n), ref, t_re, n * engine.shape.bytes_per_row
    )
    row["ram"]["page_cache"] = "n/a"
    row["ram_restore_gb_s"] = ram.health()["restore_gbps"]  # the copy alone, by the tier's own clock
    if args.profile and engine.shape.device.type == "cuda":
        row["ram_overlap"] = profile_overlap(engine, ram, ids, OUT / f"{args.tag}_trace_{n}.json")
    del ram
    for mode in ("warm", "cold"):
        runs = []
        for _ in range(args.repeat):
            how = drop_page_cache(folder, args.drop_caches) if mode == "cold" else "warm"
            runs.append(restore_timed(engine, tier, ids))
        assert all(r["cached"] == n for r in runs), [r["cached"] for r in runs]
        row[mode] = _measured(runs, ref, t_re, nbytes) | {"page_cache": how}
    row["corrupt"] = tier.stats.corrupt
    tier.close()
    shutil.rmtree(folder, ignore_errors=True)
    return row


def profile_overlap(engine: Engine, ram: RamTier, ids: list[int], trace: Path) -> dict:
    """One RAM restore and the prefill of the new rows under the CUDA profiler: the H2D copies'
    window on the GPU and how much kernel time ran inside it (0: the new rows' prefill starts only
    once the whole copy is done). The Chrome trace goes to ``trace``."""
    import json

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        restore_timed(engine, ram, ids)
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    h2d = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not h2d:
        return {"h2d_copies": 0}
    lo, hi = min(e["ts"] for e in h2d), max(e["ts"] + e["dur"] for e in h2d)  # microseconds
    inside = sum(max(0.0, min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"])) for e in kernels)
    after = [e for e in kernels if e["ts"] >= lo]
    return {
        "h2d_copies": len(h2d),
        "h2d_window_ms": (hi - lo) / 1e3,
        "h2d_busy_ms": sum(e["dur"] for e in h2d) / 1e3,
        "kernel_ms_inside_h2d_window": inside / 1e3,
        "kernels_after_h2d_start": len(after),
        "first_kernel_after_h2d_start_ms": (min(e["ts"] for e in after) - lo) / 1e3 if after else None,
        "prefill_kernel_ms": sum(e["dur"] for e in after) / 1e3,
        "trace": trace.name,
    }


def restore_timed_runs(engine: Engine, tier, ids: list[int], repeat: int, n: int) -> list[dict]:
    runs = [restore_timed(engine, tier, ids) for _ in range(repeat)]
    assert all(r["cached"] == n for r in runs), [r["cached"] for r in runs]
    return runs


def _measured(runs: list[dict], ref: torch.Tensor, t_re: float, nbytes: int) -> dict:
    """The median restore of ``runs`` against the recompute (``ref`` logits, ``t_re`` seconds)."""
    best = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]
    return {k: best[k] for k in ("load_s", "rest_s", "total_s")} | {
        "load_gb_s": nbytes / best["load_s"] / 1e9,
        "speedup": t_re / best["total_s"],
        "max_abs_logit_diff": (best["logits"] - ref).abs().max().item(),
        "same_argmax": bool(best["logits"].argmax() == ref.argmax()),
    }


def run_dedupe(engine: Engine, args, root: Path) -> dict:
    """Bytes on disk of ``--convs`` conversations sharing a prefix: one namespace vs one each."""
    shared = engine.new_cache()
    engine.prefill(shared, random_ids(engine, args.shared, seed=1))
    shared.seal()
    base = shared.snapshot()
    snaps = []
    for c in range(args.convs):
        cache = engine.restore(base)
        engine.prefill(cache, random_ids(engine, args.own, seed=100 + c))
        cache.seal()
        snaps.append(cache.snapshot())
    out = {"convs": args.convs, "shared_tokens": args.shared, "own_tokens": args.own}
    for name, namespace in (("dedupe", lambda c: "bench"), ("no_dedupe", lambda c: f"conversation-{c}")):
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
        tier = DiskTier.open(folder, engine.info.fingerprint, engine.shape, NO_LIMIT, queue_blocks=1 << 20)
        for c, snap in enumerate(snaps):
            tier.write_behind(namespace(c), snap)
        tier.flush()
        out[name] = {
            "bytes": tier.store.nbytes,
            "blocks": tier.store.count,
            "dedupe_hits": tier.stats.dedupe_hits,
        }
        tier.close()
        shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--shape", help="random weights of llama3-8b | qwen3-8b | qwen3-32b (speed only)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk)
    ap.add_argument("--tokens", default="4096,8192,32768", help="history sizes (multiples of 256)")
    ap.add_argument("--new", type=int, default=1, help="prompt tokens after the history")
    ap.add_argument("--repeat", type=int, default=3, help="restores per measurement (the median is kept)")
    ap.add_argument("--recompute-repeat", type=int, default=1, help="full recomputes per size (median)")
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--shared", type=int, default=4096)
    ap.add_argument("--own", type=int, default=1024)
    ap.add_argument("--dir", help="where the blocks go (default: a temp folder in bench/out)")
    ap.add_argument("--drop-caches", action="store_true", help="cold runs also drop the page cache (root)")
    ap.add_argument("--profile", action="store_true", help="CUDA: profile one RAM restore (overlap)")
    ap.add_argument("--tag", default="disk_restore")
    args = ap.parse_args()

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model = f"random:{args.shape}" if args.shape else args.model
    cfg = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        attention=args.attention,
        prefill_chunk=args.prefill_chunk,
    )
    engine = load_engine(cfg, progress=False)
    OUT.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="disk-bench-", dir=args.dir or OUT))
    sizes = [int(t) for t in args.tokens.split(",")]
    if any(n % BLOCK_TOKENS for n in sizes):
        raise SystemExit(f"history sizes must be multiples of {BLOCK_TOKENS}")
    limit = engine.max_context
    if limit:  # a history the context cannot hold shrinks to the largest that fits (by whole blocks)
        fit = (limit - args.new) // BLOCK_TOKENS * BLOCK_TOKENS
        clipped = {n: fit for n in sizes if n > fit}
        sizes = sorted({min(n, fit) for n in sizes})
    else:
        clipped = {}
    print(
        f"# {engine.info.model_name}{' (random weights)' if args.shape else ''} on {engine.shape.device} "
        f"{engine.shape.dtype}, attention={engine.info.verdict.route}, prefill chunk {engine.prefill_chunk}, "
        f"blocks in {root} ({filesystem(root)}), {engine.shape.bytes_per_row} bytes per row, "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    for n, fit in clipped.items():
        print(f"# {n} tokens run as {fit}: the model's context is {limit} tokens ({args.new} more follow)")
    prefill_timed(
        engine, engine.new_cache(), random_ids(engine, 2 * engine.prefill_chunk + 3, seed=7)
    )  # warm-up
    results = {
        "model": engine.info.model_name,
        "random_weights": bool(args.shape),
        "device": str(engine.shape.device),
        "dtype": str(engine.shape.dtype),
        "attention": engine.info.verdict.route,
        "prefill_chunk": engine.prefill_chunk,
        "filesystem": filesystem(root),
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "bytes_per_row": engine.shape.bytes_per_row,
        "clipped": clipped,
        "sizes": [],
    }
    print(
        f"{'tokens':>7} {'recompute s':>11} | {'RAM load':>8} {'GB/s':>5} {'total s':>7} {'x':>6} | "
        f"{'load s':>7} {'GB/s':>5} {'total s':>7} {'x':>6} | "
        f"{'cold load':>9} {'GB/s':>5} {'total s':>7} {'x':>6} | {'|dlogit|':>8} {'MiB':>7} {'write s':>7}"
    )
    for n in sizes:
        r = run_size(engine, n, args, root)
        results["sizes"].append(r)
        w, c, m = r["warm"], r["cold"], r["ram"]
        print(
            f"{n:>7} {r['recompute_s']:>11.3f} | {m['load_s']:>8.3f} {m['load_gb_s']:>5.1f} {m['total_s']:>7.3f} "
            f"{m['speedup']:>5.1f}x | {w['load_s']:>7.3f} {w['load_gb_s']:>5.2f} {w['total_s']:>7.3f} "
            f"{w['speedup']:>5.1f}x | {c['load_s']:>9.3f} {c['load_gb_s']:>5.2f} {c['total_s']:>7.3f} "
            f"{c['speedup']:>5.1f}x | {max(w['max_abs_logit_diff'], m['max_abs_logit_diff']):>8.1e} {r['bytes_on_disk'] / 2**20:>7.1f} "
            f"{r['write_s']:>7.2f}"
        )
        if "ram_overlap" in r:
            print(f"# {n} tokens, RAM restore under the profiler: {r['ram_overlap']}")
    if args.convs == 0:  # --convs 0: no dedupe run
        shutil.rmtree(root, ignore_errors=True)
        save(results, args.tag, _plot)
        return
    d = results["dedupe"] = run_dedupe(engine, args, root)
    print(
        f"dedupe: {d['convs']} conversations of {d['shared_tokens']} shared + {d['own_tokens']} own tokens: "
        f"{d['dedupe']['bytes'] / 2**20:.1f} MiB ({d['dedupe']['blocks']} blocks) with dedupe, "
        f"{d['no_dedupe']['bytes'] / 2**20:.1f} MiB ({d['no_dedupe']['blocks']} blocks) without: "
        f"{d['no_dedupe']['bytes'] / max(1, d['dedupe']['bytes']):.2f}x"
    )
    shutil.rmtree(root, ignore_errors=True)
    save(results, args.tag, _plot)


def _plot(results: dict, plt, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sizes = results["sizes"]
    x = range(len(sizes))
    width = 0.2
    for i, (label, get) in enumerate(
        (
            ("recompute", lambda r: r["recompute_s"]),
            ("restore (RAM)", lambda r: r["ram"]["total_s"]),
            ("restore (warm)", lambda r: r["warm"]["total_s"]),
            ("restore (cold)", lambda r: r["cold"]["total_s"]),
        )
    ):
        axes[0].bar([j + (i - 1.5) * width for j in x], [get(r) for r in sizes], width, label=label)
    axes[0].set_xticks(list(x), [str(r["tokens"]) for r in sizes])
    axes[0].set(
        xlabel="history tokens",
        ylabel="seconds to the first logits",
        yscale="log",
        title="restore vs recompute",
    )
    d = results.get("dedupe") or {
        "dedupe": {"bytes": 0},
        "no_dedupe": {"bytes": 0},
        "convs": 0,
        "shared_tokens": 0,
    }
    axes[1].bar(["with dedupe", "without"], [d["dedupe"]["bytes"] / 2**20, d["no_dedupe"]["bytes"] / 2**20])
    axes[1].set(ylabel="MiB on disk", title=f"{d['convs']} conversations sharing {d['shared_tokens']} tokens")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{results['model']} on {results['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

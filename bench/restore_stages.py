"""Where a restore from a block store spends its time, stage by stage (issue 34's restore path).

Writes ``--blocks`` blocks of one KV geometry (``--shape llama3-8b``: 32 layers, 8 KV heads, head
dim 128, bf16: 32 MiB a block, 128 KiB a token) to a fresh store (``--store dir``: a
``SharedDirStore``; ``local``: a ``LocalDirStore``; ``redis``: a ``redis-server`` on ``--redis``),
then, with the page cache warm (the blocks were just written), times each stage over every block
with ``--threads`` threads, ``--repeat`` times, and reports the median wall time's GB/s and the CPU
seconds per GB (``time.process_time``: less disturbed by other jobs on a shared machine):

- ``read``: the block files' bytes read into one buffer per thread (``os.preadv``): the page
  cache's copy, the floor of any file store's read (``dir``/``local`` only);
- ``checksum``: the block checksum in use (``disk_blocks.CHECKSUM``, XXH3-128) of a block already
  in memory, as the writer computes it (``disk_blocks.metadata``): its own cost; and ``sha256``:
  SHA-256 of the same bytes (the checksum before format 2);
- ``pin_per_block`` (CUDA): page-locked allocations of ``2 x --threads`` blocks, the first in
  the process: what the reader paid per block before its pinned ring (``disk_staging``);
- ``get``: ``store.get`` of every block into one destination per thread: read, parse, verify;
- ``restore``: the disk tier's whole restore, ``DiskTier.extend`` of the blocks' tokens on
  ``--device`` (lookup, reads, checks, assembly into one segment, on CUDA the host->device
  copies, synchronized), on a tier opened for each run: ``restore_first`` is a fresh tier's first
  restore (what a replica that never saw the conversation pays), ``restore`` the next one;
  ``restore_written`` (one run) a fresh tier's restore right after the write, before any other
  read: what a replica on the writer's host pays after the writer's death (the page cache as the
  writer left it; ``shared_restore.py`` measures that through the servers).

With ``--cold`` the block files are dropped from the page cache (``POSIX_FADV_DONTNEED``) before
each run of ``read``, ``get`` and each restore: the disk's own rate, as a replica on another host
would read the store.

    python bench/restore_stages.py --blocks 32 --threads 2                    # CPU, 1 GiB
    python bench/restore_stages.py --blocks 128 --device cuda --tag restore_stages_h200   # H200
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from report import cpu_name, save
from serve_procs import drop_page_cache

from turnkv.bank import disk_blocks
from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS, Block, block_context, block_keys
from turnkv.kv.cache import KVShape

SHAPES = {  # (layers, KV heads, head dim)
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (30, 3, 64),
}
NS = "bench"


def make_blocks(shape: KVShape, n: int, fingerprint: str) -> tuple[list[int], list[Block]]:
    """``n`` chained blocks of random bytes (any bit pattern is a valid bf16 row for the store)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50000, (n * BLOCK_TOKENS,), generator=g).tolist()
    context = block_context(fingerprint, shape)
    keys = block_keys(context, NS, tokens)
    dims = (shape.num_layers, shape.num_kv_heads, BLOCK_TOKENS, shape.head_dim)
    blocks, parent = [], "0" * 64
    for i, key in enumerate(keys):
        raw = torch.randint(-(2**15), 2**15, (2, *dims), dtype=torch.int16, generator=g)
        kv = raw.view(shape.dtype) if shape.dtype.itemsize == 2 else raw.float().to(shape.dtype)
        rows = tuple(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])
        blocks.append(Block(key, parent, context, i, rows, kv[0].clone(), kv[1].clone()))
        parent = key
    return tokens, blocks


def open_store(kind: str, root: Path, redis_url: str):
    if kind == "dir":
        from turnkv.bank.shared_stores import SharedDirStore

        return SharedDirStore(root)
    if kind == "local":
        from turnkv.bank.disk_store import LocalDirStore

        return LocalDirStore(root)
    from turnkv.bank.shared_stores import RedisStore

    store = RedisStore(redis_url, prefix="turnkv-bench:")
    store._redis.flushdb()
    return store


def timed(
    fn: Callable[[], object], repeat: int, before: Callable[[], object] = lambda: None
) -> tuple[float, float]:
    """(median wall s, median CPU s) of ``repeat`` calls of ``fn``, each after ``before()``."""
    walls, cpus = [], []
    for _ in range(repeat):
        before()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def per_block(threads: int, n: int, work: Callable[[int, int], None]) -> Callable[[], None]:
    """A run of ``work(block, slot)`` over every block on ``threads`` threads; ``slot`` is the
    running thread's own (0 .. threads - 1), so that no two calls at once share a buffer."""

    def run() -> None:
        local, mu, ids = threading.local(), threading.Lock(), iter(range(threads))

        def one(i: int) -> None:
            if not hasattr(local, "slot"):
                with mu:
                    local.slot = next(ids)
            work(i, local.slot)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(n)))

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--store", choices=("dir", "local", "redis"), default="dir")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="the store's directory (default: a fresh temporary one)")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="dir/local: drop the block files from the page cache before each read, get and restore",
    )
    ap.add_argument("--chunk", type=int, default=0, help="disk_blocks.CHUNK in KiB (default: as it is)")
    ap.add_argument("--tag", default="restore_stages_cpu")
    args = ap.parse_args()
    if args.chunk:
        disk_blocks.CHUNK = args.chunk << 10
    layers, heads, dim = SHAPES[args.shape]
    shape = KVShape(layers, heads, dim, torch.bfloat16, torch.device(args.device))
    host = KVShape(layers, heads, dim, torch.bfloat16, torch.device("cpu"))
    tokens, blocks = make_blocks(host, args.blocks, "bench")
    block_bytes = blocks[0].nbytes
    total = block_bytes * len(blocks)
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    root = Path(tmp.name)
    store = open_store(args.store, root, args.redis)
    t0 = time.perf_counter()
    for i in range(0, len(blocks), 8):
        store.put_many(blocks[i : i + 8])
    write_s = time.perf_counter() - t0
    store.close()
    keys = [b.key for b in blocks]
    t = args.threads
    sync = torch.cuda.synchronize if shape.device.type == "cuda" else (lambda: None)

    def restore(tier: DiskTier) -> tuple[float, float]:
        """(wall s, CPU s) of ``tier``'s restore of every block, the copies synchronized."""
        c0, t0 = time.process_time(), time.perf_counter()
        snap = tier.extend(NS, tokens, None)
        sync()
        took = time.perf_counter() - t0, time.process_time() - c0
        assert snap is not None and snap.num_tokens == len(tokens), "the restore missed blocks"
        return took

    written = DiskTier.open(_store_for(args, root), "bench", shape, 1 << 50, load_threads=t)
    written_s = restore(written)  # the first read of the blocks since the write
    written.close()
    cold = (lambda: drop_page_cache(root)) if args.cold and args.store != "redis" else (lambda: None)
    bufs = [bytearray(block_bytes + (1 << 20)) for _ in range(t)]
    dims = (layers, heads, BLOCK_TOKENS, dim)
    dsts = [
        (torch.empty(dims, dtype=torch.bfloat16), torch.empty(dims, dtype=torch.bfloat16)) for _ in range(t)
    ]
    stages: dict[str, dict] = {}

    def record(name: str, wall: float, cpu: float, nbytes: int = total) -> None:
        stages[name] = {
            "wall_s": round(wall, 4),
            "cpu_s": round(cpu, 4),
            "gbps": round(nbytes / wall / 1e9, 2),
            "cpu_s_per_gb": round(cpu / (nbytes / 1e9), 3),
        }
        print(f"{name:>14}: {stages[name]}", flush=True)

    if args.store != "redis":
        paths = [str(store.path(k)) for k in keys]

        def read(i: int, slot: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.preadv(fd, [bufs[slot]], 0)
            finally:
                os.close(fd)

        record("read", *timed(per_block(t, len(keys), read), args.repeat, cold))
    raw = [[x.reshape(-1).view(torch.uint8).numpy() for x in (b.k, b.v)] for b in blocks[:t]]

    ids = [torch.tensor(b.tokens, dtype=torch.int64) for b in blocks[:t]]

    def checksum(i: int, slot: int) -> None:  # the writer's own: metadata, k, v, token ids
        disk_blocks.metadata(blocks[slot], ids[slot])

    def sha(i: int, slot: int) -> None:
        h = hashlib.sha256(raw[slot][0])
        h.update(raw[slot][1])

    record("checksum", *timed(per_block(t, len(keys), checksum), args.repeat))
    record("sha256", *timed(per_block(t, len(keys), sha), args.repeat))
    reader = open_store(args.store, root, args.redis) if args.store != "redis" else _reopen(args.redis)
    get = per_block(t, len(keys), lambda i, s: reader.get(keys[i], into=dsts[s]))
    record("get", *timed(get, args.repeat, cold))
    reader.close()

    if shape.device.type == "cuda":  # what the reader paid per block before its pinned ring
        live = min(len(keys), 2 * t)
        pins: list = []
        wall, cpu = timed(
            per_block(
                t,
                live,
                lambda i, s: pins.append(
                    [torch.empty(dims, dtype=torch.bfloat16, pin_memory=True) for _ in "kv"]
                ),
            ),
            1,
        )
        record("pin_per_block", wall, cpu, live * block_bytes)
        del pins
    firsts, thens = [], []
    for _ in range(args.repeat):  # a fresh tier each run: its first restore, then a second one
        tier = DiskTier.open(_store_for(args, root), "bench", shape, 1 << 50, load_threads=t)
        for out in (firsts, thens):
            cold()
            out.append(restore(tier))
        assert tier.stats.corrupt == 0 and tier.stats.faults == 0, tier.stats
        tier.close()
    record("restore_written", *written_s)
    record("restore_first", statistics.median(w for w, _ in firsts), statistics.median(c for _, c in firsts))
    record("restore", statistics.median(w for w, _ in thens), statistics.median(c for _, c in thens))
    results = {
        "shape": args.shape,
        "block_bytes": block_bytes,
        "blocks": len(blocks),
        "bytes": total,
        "threads": t,
        "chunk_bytes": getattr(disk_blocks, "CHUNK", None),
        "checksum": getattr(disk_blocks, "CHECKSUM", "sha256"),
        "store": args.store,
        "page_cache": "dropped before each run (posix_fadvise)" if args.cold else "warm",
        "device": args.device,
        "cpu": cpu_name(),
        "load_average": os.getloadavg(),
        "write_s": round(write_s, 3),
        "stages": stages,
    }
    tmp.cleanup()
    save(results, args.tag, _plot)


def _reopen(url: str):
    from turnkv.bank.shared_stores import RedisStore

    return RedisStore(url, prefix="turnkv-bench:")


def _store_for(args, root: Path):
    if args.store == "redis":
        return _reopen(args.redis)
    return open_store(args.store, root, args.redis)


def _plot(res: dict, plt, path: Path) -> None:
    names = list(res["stages"])
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(names, [res["stages"][n]["gbps"] for n in names])
    ax.set_ylabel("GB/s")
    ax.set_title(
        f"{res['blocks']} {res['shape']} blocks, {res['store']} store, {res['threads']} threads", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()

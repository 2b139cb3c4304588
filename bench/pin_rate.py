"""How fast host memory can be pinned, and how long pinning stalls a concurrent stream of CUDA work.

The RAM tier's pool is pinned memory; pinning holds the CUDA driver's lock, so while a chunk is
pinned every other CUDA call of the process (a step's launches, its copies) waits. Two ways:

- ``alloc``: ``torch.empty(n, pin_memory=True)`` (``cudaHostAlloc`` behind torch's host allocator),
  one call per chunk: faults, zeroes and registers the pages under the lock.
- ``register``: the pages faulted first without the lock (``torch.zeros``, pageable), then
  ``cudaHostRegister`` over ``--slice`` bytes at a time: the lock is held per slice.

For each, the rate (GB/s of pinned memory) and, with a thread launching a small kernel and waiting
for it in a loop meanwhile, that loop's longest gap and p99 gap against its gap with nothing pinned.

    python bench/pin_rate.py --bytes 4G --chunk 256M --slices 16M,64M,256M

Prints a table, writes ``bench/out/pin_rate.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
from report import save

from turnkv.config import parse_size


class Ticker:
    """A thread that launches a tiny kernel and synchronizes, over and over: its gaps are what a
    serving step would wait for the driver's lock."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._x = torch.zeros(1024, device="cuda")
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            self._x.add_(1.0)
            torch.cuda.synchronize()
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def __enter__(self) -> Ticker:
        self._thread.start()
        time.sleep(0.05)
        self.gaps.clear()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        g = sorted(self.gaps) or [0.0]
        return {"gap_max_ms": g[-1] * 1e3, "gap_p99_ms": g[int(0.99 * (len(g) - 1))] * 1e3, "ticks": len(g)}


def pin_alloc(total: int, chunk: int) -> tuple[list[torch.Tensor], float]:
    t0, held = time.perf_counter(), []
    for _ in range(total // chunk):
        held.append(torch.empty(chunk, dtype=torch.uint8, pin_memory=True))
    return held, time.perf_counter() - t0


def pin_register(total: int, chunk: int, piece: int) -> tuple[list[torch.Tensor], float, float]:
    """Fault ``total`` bytes in chunks, then register each ``piece`` bytes at a time; returns the
    tensors, the faulting seconds and the registering seconds."""
    cudart = torch.cuda.cudart()
    held, fault, reg = [], 0.0, 0.0
    for _ in range(total // chunk):
        t0 = time.perf_counter()
        t = torch.zeros(chunk, dtype=torch.uint8)  # pageable, pages faulted and zeroed
        t1 = time.perf_counter()
        for off in range(0, chunk, piece):
            err = cudart.cudaHostRegister(t.data_ptr() + off, min(piece, chunk - off), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
        fault, reg = fault + t1 - t0, reg + time.perf_counter() - t1
        held.append(t)
    return held, fault, reg


def unregister(held: list[torch.Tensor], piece: int) -> None:
    cudart = torch.cuda.cudart()
    for t in held:
        for off in range(0, t.numel(), piece):
            cudart.cudaHostUnregister(t.data_ptr() + off)


def copy_rate(host: torch.Tensor) -> float:
    """H2D GB/s from ``host`` (pinned, or inside one registration): the bus's speed only if pinned."""
    dev = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * host.numel() / (time.perf_counter() - t0) / 1e9


def spans(host: torch.Tensor) -> bool:
    """Whether one copy may span several registrations (a RAM tier's block must not, if not)."""
    try:
        copy_rate(host)
        return True
    except (RuntimeError, torch.AcceleratorError):
        torch.cuda.synchronize()
        return False


def plot(results: dict, plt, path) -> None:
    rows = results["rows"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["way"] for r in rows]
    ax[0].bar(names, [r["pin_GBps"] for r in rows])
    ax[0].set_ylabel("pinned GB/s")
    ax[1].bar(names, [r["gap_max_ms"] for r in rows])
    ax[1].set_ylabel("longest stall of a CUDA loop (ms)")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="4G", help="memory pinned per way")
    ap.add_argument("--chunk", default="256M", help="bytes allocated (and faulted) at a time")
    ap.add_argument("--slices", default="16M,64M,256M", help="cudaHostRegister sizes to try")
    ap.add_argument("--tag", default="pin_rate")
    args = ap.parse_args()
    total, chunk = parse_size(args.bytes), parse_size(args.chunk)
    torch.cuda.init()
    rows = []
    with Ticker() as idle:
        time.sleep(0.5)
    rows.append({"way": "nothing pinned", "pin_GBps": 0.0, **idle.summary()})
    with Ticker() as t:
        held, secs = pin_alloc(total, chunk)
    rows.append(
        {
            "way": f"alloc {args.chunk}",
            "pin_GBps": total / secs / 1e9,
            **t.summary(),
            "h2d_GBps": copy_rate(held[0]),
        }
    )
    del held
    for s in args.slices.split(","):
        piece = parse_size(s)
        with Ticker() as t:
            held, fault, reg = pin_register(total, chunk, piece)
        rows.append(
            {
                "way": f"register {s}",
                "pin_GBps": total / (fault + reg) / 1e9,
                "fault_GBps": total / fault / 1e9,
                "register_GBps": total / reg / 1e9,
                **t.summary(),
                "h2d_GBps": copy_rate(held[0][:piece]),
                "span_ok": spans(held[0]),
            }
        )
        unregister(held, piece)
        del held
    print(f"# {torch.cuda.get_device_name()}, {total / 2**30:.1f} GiB per way, chunks of {args.chunk}")
    print(
        f"{'way':<18} {'pin GB/s':>9} {'fault':>7} {'register':>9} {'H2D GB/s':>9} {'stall max':>10} {'p99':>7}"
    )
    for r in rows:
        print(
            f"{r['way']:<18} {r['pin_GBps']:>9.2f} {r.get('fault_GBps', 0):>7.2f} {r.get('register_GBps', 0):>9.2f} "
            f"{r.get('h2d_GBps', 0):>9.1f} {r['gap_max_ms']:>9.2f}ms {r['gap_p99_ms']:>6.2f} {r.get('span_ok', '')}"
        )
    save({"rows": rows, "bytes": total, "chunk": chunk, "gpu": torch.cuda.get_device_name()}, args.tag, plot)


if __name__ == "__main__":
    main()

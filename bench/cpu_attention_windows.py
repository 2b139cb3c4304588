"""The CPU attention of one window, per layer: the C kernel (``cpu_native``) against torch's route.

Every CPU window attends in C now, prefill chunks included, so that a row's bits do not depend on
the window it came in (cached == uncached); before, windows of 33 rows or more went through
torch's flash kernel. This times both on the default model's heads (9 query / 3 KV heads, d64,
bf16 rows as a CPU stores them) for decode rows and prefill chunks at several histories, on one
thread by default (process CPU time, which the machine's other load disturbs least), interleaved
repetitions, median and range.

    python bench/cpu_attention_windows.py
    python bench/cpu_attention_windows.py --isa=-mno-avx512f   # the C built as for an AVX2 CPU
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 DNNL_MAX_CPU_ISA=AVX2 \\
        python bench/cpu_attention_windows.py --isa=-mno-avx512f   # torch's kernels too

``--isa FLAG`` compiles ``cpu_attention.c`` with ``cbuild.FLAGS`` plus FLAG into a temporary file
and times that build. ``--prefill 512,2048`` times the default model's prefill of that many tokens
(tokens/s, chunks of 512) in this process, every window in C against the routing before (windows
of 33 rows or more through torch's flash kernel, decode windows in C), runs interleaved.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from turnkv import cbuild
from turnkv.attention import cpu_native
from turnkv.attention.portable import PortableStep, portable_route
from turnkv.kv.cache import KVWindow

HQ, HKV, D, LAYERS = 9, 3, 64, 2
SHAPES = [(0, 1), (1000, 1), (0, 33), (0, 128), (0, 512), (512, 512), (1536, 512), (0, 2048)]


def use_build(flag: str) -> None:
    """Load ``cpu_attention.c`` built with ``flag`` added as the kernel ``cpu_native`` calls."""
    so = Path(tempfile.mkdtemp()) / "cpu_attention.so"
    cmd = ["cc", *cbuild.FLAGS, *cbuild.OPENMP, flag, str(cpu_native.SOURCE), "-o", str(so)]
    subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    cpu_native._setup(lib)
    cpu_native.KERNEL.lib, cpu_native.KERNEL.why = lib, "ok"


def time_window(ws: int, m: int, threads: int, reps: int) -> dict[str, list[float]]:
    """ms per layer of a window of ``m`` rows after ``ws`` history rows, both ways."""
    g = torch.Generator().manual_seed(ws + m)
    k, v = (torch.randn(LAYERS, HKV, ws + m, D, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(m, HQ, D, generator=g)
    w = KVWindow(((k, v),), ws, m)
    route = portable_route(w, q.dtype, native=False)  # the torch ops of a CPU without the C kernel
    native = cpu_native.NativeStep([(0, w.views, ws, m)], threads=threads)
    out = torch.empty(m, HQ, D)
    runs = {
        "torch": lambda layer: PortableStep._attend(layer, q, D**-0.5, [0], [w], [route]),
        "c": lambda layer: native.attend(layer, q, out, D**-0.5),
    }
    clock = time.process_time if threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run(0)
    for _ in range(reps):
        for name, run in runs.items():
            t0 = clock()
            for layer in range(LAYERS):
                run(layer)
            times[name].append((clock() - t0) / LAYERS * 1e3)
    return times


def prefill(sizes: list[int], reps: int) -> None:
    """The default model's prefill, tokens/s, with the prefill windows in C and through torch."""
    from turnkv.attention import portable
    from turnkv.attention.routes import narrow
    from turnkv.config import EngineConfig
    from turnkv.runtime import load_engine

    every = portable._native_views
    routes = {"c": every, "torch": lambda w: narrow(w.rows) and every(w)}
    engine = load_engine(EngineConfig(device="cpu", prefill_chunk=512), progress=False)
    ids = engine.tokenizer.encode("The history of maps and of the people who drew them. " * 400)
    got: dict[tuple[str, int], list[float]] = {(r, n): [] for r in routes for n in sizes}
    try:
        for rep in range(reps):
            for name in sorted(routes, reverse=bool(rep % 2)):
                portable._native_views = routes[name]
                for n in sizes:
                    t0 = time.perf_counter()
                    engine.prefill(engine.new_cache(), ids[:n])
                    got[name, n].append(n / (time.perf_counter() - t0))
    finally:
        portable._native_views = every
    for (name, n), x in got.items():
        print(f"prefill {n:5d} tokens, prefill windows {name:5s}: {statistics.median(x):6.0f} tok/s "
              f"[{min(x):.0f}-{max(x):.0f}]")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="", help="a flag to build the C with, e.g. -mno-avx512f")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prefill", default="", help="prompt sizes of the default model's prefill A/B")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.isa:
        use_build(args.isa)
    assert cpu_native.library() is not None, cpu_native.status()
    if args.prefill:
        prefill([int(n) for n in args.prefill.split(",")], args.reps)
        return
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"C build {args.isa or 'native'}, {args.threads} thread(s); ms per layer, median [range]")  # fmt: skip
    for ws, m in SHAPES:
        t = time_window(ws, m, args.threads, args.reps)
        a, b = statistics.median(t["torch"]), statistics.median(t["c"])
        cell = {n: f"{statistics.median(x):7.3f} [{min(x):.3f}-{max(x):.3f}]" for n, x in t.items()}
        print(f"history {ws:5d} rows {m:5d}: torch {cell['torch']}  C {cell['c']}  C/torch {b / a:.2f}")


if __name__ == "__main__":
    main()

"""The packed-weight C kernel of another commit against this tree's, in one process, per ISA.

Both sides get the default model's decode matmuls with the weights of every layer distinct (30
layers of q|k|v, o, gate|up, down and the Q8_0 head: ~96 MB, streamed from memory as in a real
step, unlike ``cpu_matmul.py``, which reuses one matrix from cache), each call as the model makes
it: o and down add the residual, their inputs fp32 (the base side casts them to bf16 and adds the
residual with torch ops where its kernel cannot). Also one call on a 16 x 64 matrix: the fixed cost
a call pays. Timed alternately (base, tree, base, ...), CPU time of this process on one thread;
min and median of the repeats.

    TURNKV_CPU_ISA=avx2 python bench/cpu_kernel_ab.py --base main --rows 1,8

``--base`` is any git revision; its ``turnkv/models/cpu_int4.py`` and ``.c`` are loaded as a module
of their own (built by this tree's ``cbuild``, so the same flags and ISA). Prints a table, writes
``bench/out/<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from report import cpu_name, save

from turnkv import cbuild
from turnkv.models import cpu_int4

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
RESIDUAL = {"o", "down"}  # their inputs fp32 (attention's and silu's outputs) plus the residual
HEAD = (49152, 576)
LAYERS = 30


def base_module(rev: str, into: Path):
    """``cpu_int4`` as it was at ``rev``, importable beside this tree's."""
    for ext in ("py", "c"):
        src = subprocess.check_output(["git", "show", f"{rev}:turnkv/models/cpu_int4.{ext}"], cwd=ROOT)
        (into / f"cpu_int4.{ext}").write_bytes(src)
    (into / "cpu_int4_base.py").write_bytes((into / "cpu_int4.py").read_bytes())
    spec = importlib.util.spec_from_file_location("cpu_int4_base", into / "cpu_int4_base.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if mod.library() is None:
        raise SystemExit(f"the base kernel does not build: {mod.status()}")
    return mod


def caller(mod, packed: torch.Tensor, n: int):
    """``f(a, residual)`` as the model calls ``mod``'s kernel: a bound ``Matrix`` where ``mod`` has
    one (fp32 rows and the residual into the C), else ``mm`` after a bf16 cast, then ``add_``."""
    if hasattr(mod, "Matrix"):
        return mod.Matrix(packed, n).mm

    def call(a: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = mod.mm(a if a.dtype == torch.bfloat16 else a.bfloat16(), packed, n)
        return y if residual is None else y.add_(residual)

    return call


def weights(mod, seed: int):
    """The step's matrices packed by ``mod``: ``[(name, n, k, f)]`` per layer, then the head."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        for name, (n, k) in LAYER.items():
            u = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            s = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
            out.append((name, n, k, caller(mod, mod.pack([(u, s, -8 * s)], n, k), n)))
    n, k = HEAD
    q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    out.append(("head", n, k, caller(mod, mod.pack_q8(q, d, n, k), n)))
    return out


def step_fn(mats, rows: int):
    gen = torch.Generator().manual_seed(rows)
    inputs = {}
    for name, n, k, _ in mats:
        if name not in inputs:
            x = torch.randn(rows, k, generator=gen)
            res = torch.randn(rows, n, generator=gen) if name in RESIDUAL else None
            inputs[name] = (x if name in RESIDUAL else x.bfloat16(), res)

    def step():
        for name, _, _, f in mats:
            f(*inputs[name])

    return step


def cpu_time(f) -> float:
    t = time.thread_time()
    f()
    return time.thread_time() - t


def ab(fa, fb, repeat: int, inner: int = 1) -> tuple[list[float], list[float]]:
    for f in (fa, fb):
        f()
    a, b = [], []
    for _ in range(repeat):
        a.append(cpu_time(lambda: [fa() for _ in range(inner)]) / inner)
        b.append(cpu_time(lambda: [fb() for _ in range(inner)]) / inner)
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if cpu_int4.library() is None:
        raise SystemExit(f"no C kernel: {cpu_int4.status()}")
    tmp = Path(tempfile.mkdtemp())
    base = base_module(args.base, tmp)
    variant = cbuild.variant()
    commit = subprocess.check_output(["git", "rev-parse", "--short", args.base], cwd=ROOT, text=True).strip()
    print(
        f"# CPU {cpu_name()}, kernels {variant}, base {args.base} ({commit}) vs tree, 1 thread, load {os.getloadavg()[0]:.2f}"
    )
    results: dict = {"base": args.base, "base_commit": commit, "kernels": variant, "runs": []}

    def report(what: str, a: list[float], b: list[float], unit: float, label: str) -> None:
        row = {"what": what, "base_min": min(a) * unit, "base_median": statistics.median(a) * unit,
               "tree_min": min(b) * unit, "tree_median": statistics.median(b) * unit}  # fmt: skip
        row["ratio_median"] = row["base_median"] / row["tree_median"]
        results["runs"].append(row)
        print(
            f"{what:28s} base {row['base_min']:8.3f} / {row['base_median']:8.3f} {label} | tree "
            f"{row['tree_min']:8.3f} / {row['tree_median']:8.3f} {label} | {row['ratio_median']:.2f}x"
        )

    print(f"{'':28s} {'(min / median)':>26s}")
    for name, residual in (("call 16x64, M=1", False), ("call 16x64 + residual, M=1", True)):
        fs = []
        for mod in (base, cpu_int4):
            gen = torch.Generator().manual_seed(0)
            u = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=gen)
            f = caller(mod, mod.pack([(u, torch.ones(16, 2), torch.zeros(16, 2))], 16, 64), 16)
            x = torch.randn(1, 64, generator=gen)
            x = x if residual else x.bfloat16()
            r = torch.randn(1, 16, generator=gen) if residual else None
            fs.append(lambda f=f, x=x, r=r: f(x, r))
        report(name, *ab(*fs, args.repeat, inner=2000), 1e6, "us")
    mats = [weights(mod, seed=1) for mod in (base, cpu_int4)]
    for rows in (int(r) for r in args.rows.split(",")):
        a, b = ab(step_fn(mats[0], rows), step_fn(mats[1], rows), args.repeat)
        report(f"decode matmuls M={rows}", a, b, 1e3, "ms")
    save(results, args.tag or f"cpu_kernel_ab_{variant}", _plot)


def _plot(results: dict, plt, path: Path) -> None:
    runs = results["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(runs))
    ax.bar(
        [x - 0.2 for x in xs], [r["base_median"] / r["tree_median"] for r in runs], 0.4, label="base / tree"
    )
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xticks(list(xs), [r["what"] for r in runs], fontsize=6)
    ax.set_ylabel("speed-up (median CPU time)")
    ax.set_title(
        f"cpu_int4 {results['kernels']}: {results['base_commit']} -> tree on {results['cpu']}", fontsize=7
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

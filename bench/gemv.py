"""Batch-1 decode matmuls: cuBLAS (what torch takes) against turnkv's Triton GEMV, per tile.

For the linear layers of the 8B shape on one GPU and cut over two (``--tp 2``: q/k/v and
gate/up keep 1/N of their rows, o and down 1/N of their columns) and one row of ``x``, each
candidate runs over enough distinct copies of the weight that they do not fit the L2 cache (a
step reads 32 layers' weights once), captured in a CUDA graph; per call: microseconds and the
weight bytes over that time against the copy rate measured in the same run
(``decode.copy_bandwidth``). ``pick`` is ``triton_gemv.pick``'s choice; ``best`` the fastest tile of the sweep. Every GEMV output is
checked against the fp32 product (one bf16 rounding).

    python bench/gemv.py --tp 1,2
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from decode import copy_bandwidth
from report import save

SHAPES = {  # name: (N out, K in) of llama3-8b's linear layers (fused qkv and gate|up)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
L2_BYTES = 64 << 20


def cut(name: str, n: int, k: int, tp: int) -> tuple[int, int]:
    """This rank's shape of a layer under tensor parallelism of ``tp``."""
    if name in ("o", "down"):  # row-parallel: input columns cut
        return n, k // tp
    return n // tp, k  # column-parallel (and the vocabulary-split LM head)


def captured(fn, warm, seq) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn(w)`` for each ``w`` of ``seq``, after warm-up calls over ``warm`` on a
    side stream (kernels compiled before the capture), replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in warm:
            fn(w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in seq:
            fn(w)
    g.replay()
    return g


def time_calls(fn, weights, reps: int = 10) -> float:
    """Microseconds per call of ``fn(w)`` over ``weights``, replayed from a CUDA graph."""
    g = captured(fn, weights, weights)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (reps * len(weights))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="1,2")
    ap.add_argument(
        "--sweep",
        default="2,4,8,16:256,512,1024,2048:4,8:2,3,4",
        help="BLOCK_N list : BLOCK_K list : warps list : stages list",
    )
    ap.add_argument("--tag", default="gemv")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rate = copy_bandwidth(torch.device("cuda"))  # the copy rate decode.py measures its roof by
    bns, bks, wps, sts = ([int(v) for v in part.split(",")] for part in args.sweep.split(":"))
    results = {"copy_bytes_s": rate, "rows": []}
    print(f"copy rate {rate / 1e12:.2f} TB/s")
    print(f"{'tp':>3} {'layer':>8} {'N':>7} {'K':>6} {'cuBLAS us':>10} {'%':>5} {'pick us':>8} {'%':>5} "
          f"{'best us':>8} {'%':>5} {'best tile':>16} {'pick/cuBLAS':>11}")  # fmt: skip
    cfgs = [c for c in itertools.product(bns, bks, wps, sts) if c[0] * c[1] <= 16384]  # no spills
    for tp, (name, (n0, k0)) in itertools.product([int(v) for v in args.tp.split(",")], SHAPES.items()):
        n, k = cut(name, n0, k0, tp)
        row = measure(name, tp, n, k, rate, [c for c in cfgs if c[1] <= triton_next_pow2(k)])
        results["rows"].append(row)
        pct = lambda us, nbytes=row["bytes"]: 100 * nbytes / (us * 1e-6) / rate  # noqa: E731
        print(f"{tp:>3} {name:>8} {n:>7} {k:>6} {row['cublas_us']:>10.2f} {pct(row['cublas_us']):>5.1f} "
              f"{row['pick_us']:>8.2f} {pct(row['pick_us']):>5.1f} {row['best_us']:>8.2f} {pct(row['best_us']):>5.1f} "
              f"{row['best']!s:>16} {row['cublas_us'] / row['pick_us']:>10.2f}x", flush=True)  # fmt: skip
    save(results, args.tag, _plot)
    if args.json:
        print(json.dumps({k: v for k, v in results.items() if k != "rows"}))


def measure(name: str, tp: int, n: int, k: int, rate: float, cfgs: list) -> dict:
    """cuBLAS, ``pick``'s tile and every tile of ``cfgs`` on one ``[1, k] @ [n, k].T`` shape."""
    from turnkv.models.triton_gemv import gemv, pick

    dev = torch.device("cuda")
    nbytes = n * k * 2
    ws = [
        torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, -(-L2_BYTES * 2 // nbytes)))
    ]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, n, device=dev, dtype=torch.bfloat16)
    want = (x.float() @ ws[0].float().T + res.float()).bfloat16().float()
    got = gemv(x, ws[0], residual=res).float()
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 2**-6, f"{name} tp{tp}: GEMV off by {err:.3g} of the largest output"
    cublas = time_calls(lambda w: torch.addmm(res, x, w.T), ws)
    chosen = pick(n, k)
    pick_us = time_calls(lambda w: gemv(x, w, residual=res), ws)
    sweep = {c: time_calls(lambda w, c=c: gemv(x, w, residual=res, config=c), ws, reps=5) for c in cfgs}
    best = min(sweep, key=sweep.get) if sweep else chosen
    return {"tp": tp, "layer": name, "n": n, "k": k, "bytes": nbytes, "cublas_us": cublas, "pick": chosen,
            "pick_us": pick_us, "best": best, "best_us": sweep.get(best, pick_us), "max_rel_err": err,
            "sweep": {"x".join(map(str, c)): v for c, v in sweep.items()}}  # fmt: skip


def triton_next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def _plot(results: dict, plt, path) -> None:
    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['layer']} tp{r['tp']}" for r in rows]
    rate = results["copy_bytes_s"]
    for i, (key, name) in enumerate(
        (("cublas_us", "cuBLAS"), ("pick_us", "GEMV (pick)"), ("best_us", "GEMV (best)"))
    ):
        ax.bar([j + 0.27 * i for j in range(len(rows))], [100 * r["bytes"] / (r[key] * 1e-6) / rate for r in rows],
               width=0.27, label=name)  # fmt: skip
    ax.set_xticks([j + 0.27 for j in range(len(rows))], labels, rotation=30, fontsize=7)
    ax.set(ylabel="% of the copy rate", title="decode matmuls at 1 row")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

"""A row-invariant tensor-core GEMM for exact speculative decoding: is it fast enough at batch 1?

Exact speculation needs ``y = x @ W.T`` whose row ``r`` is the same bits whether ``x`` holds that
one row (a decode step) or ``k + 1`` rows (a verify window). Today batch-1 decode on CUDA takes
``turnkv.models.triton_gemv`` and a verify window cuBLAS, two kernels; and cuBLAS picks its kernel
by ``M`` (measured on the H200: the 8B ``o`` rows differ from the row alone at ``M`` 25-31 and 64+,
``down`` at 64+; the smaller ``M`` matched). The candidate here is a Triton kernel whose row tile is FIXED at
``BLOCK_M = 16`` (used for ``M = 1`` too): every tile is one ``tl.dot`` chain on
``[16, BLOCK_K] x [BLOCK_K, BLOCK_N]`` (or, ``swap``, ``[BLOCK_N, BLOCK_K] x [BLOCK_K, 16]``)
accumulated in fp32 over the same K order, rows past ``M`` masked, rounded to bf16 once. Tile,
warps, stages and a split-K factor come from ``(N, K)`` only (``pick``), never from ``M``. With
``SPLIT > 1`` each program writes its fp32 partial to ``[SPLIT, M, N]`` and the partials are summed
in fixed order ``s = 0, 1, ...``: by a second kernel, or (``fused``) by the last program of a
column tile to arrive (an atomic counter that it resets) -- both give the same bits.

Measured (CUDA): for the linear layers of Llama-3-8B and of SmolLM2-135M and ``M`` in
1..32, microseconds per call of cuBLAS (``F.linear``), ``turnkv.models.triton_gemv`` (``M = 1``)
and the candidate, each from a CUDA graph of back-to-back calls over enough distinct weight copies
to spill the L2, median of several replays; weight GB/s against a device copy (read + write) of
2 GiB; per-step totals ``L x (qkv + o + gate_up + down) + head`` against the roof (weight bytes
over the copy rate); and exactness: ``candidate(x[:M]) == candidate(x)[:M]`` bit for bit, every row
alone, the rows flipped, repeated calls -- with cuBLAS's differing rows for contrast.

    TRITON_INTERPRET=1 .venv/bin/python bench/rowinv_gemm.py --check-small   # CPU, interpreter
    python bench/rowinv_gemm.py --sweep            # tiles at M = 1, both models -> rowinv_sweep.json
    python bench/rowinv_gemm.py --tag rowinv_h200  # the bench (--table rowinv_sweep.json: sweep's tiles)

Writes ``<out>/<tag>.json`` (and ``.png`` where matplotlib imports); ``--out`` defaults to ``$OUT``
when set, else ``bench/out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report
from decode import copy_bandwidth  # the copy rate decode.py and gemv.py measure their roofs by
from gemv import captured

from turnkv.kernels.triton_common import INTERPRET
from turnkv.models.triton_rowinv import _COUNTERS, BLOCK_M, SMS, TABLE, Cfg, pick, rowinv_linear, rule

MS = (1, 2, 4, 8, 16, 32)
L2_SPILL = 192 << 20  # bytes of distinct weights each timed graph cycles through (H200 L2: 60 MB)

MODELS = {  # model: (layers, {layer: (N out, K in)}); qkv and gate|up fused
    "llama3-8b": (
        32,
        {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
         "head": (128256, 4096)},
    ),
    "smollm2-135m": (
        30,
        {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
         "head": (49152, 576)},
    ),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# CPU check (interpreter)
# ---------------------------------------------------------------------------------------------


def check_small(device: torch.device) -> bool:
    """Small shapes against the fp32 product (bf16 tolerances), and the prefix property."""
    cases = [
        ((48, 96), Cfg(16, 32, 1, 4, 2)),
        ((48, 96), Cfg(16, 32, 1, 4, 2, swap=True)),
        ((48, 96), Cfg(16, 32, 2, 4, 2)),  # split 2, second kernel
        ((48, 96), Cfg(16, 32, 2, 4, 2, fused=True)),  # split 2, fused sum
        ((48, 96), Cfg(32, 64, 2, 4, 2, swap=True, fused=True)),  # K slices not whole
        ((40, 100), Cfg(16, 32, 3, 4, 2)),  # N, K not multiples of the tile
        ((40, 100), Cfg(16, 32, 3, 4, 2, swap=True, fused=True)),
        ((48, 96), None),  # the rule's config
    ]
    g = torch.Generator().manual_seed(0)
    ok = True
    for (n, k), cfg in cases:
        case_ok = True
        w = torch.randn(n, k, generator=g).bfloat16().to(device)
        x = torch.randn(20, k, generator=g).bfloat16().to(device)
        full = rowinv_linear(x, w, cfg=cfg)
        for m in (1, 2, 3, 4, 5, 17, 20):
            got = rowinv_linear(x[:m], w, cfg=cfg)
            ref = x[:m].float() @ w.float().T
            close = torch.allclose(got.float(), ref, rtol=1.6e-2, atol=1e-3 * float(ref.abs().max()))
            same = torch.equal(got, full[:m])
            case_ok &= close and same
            if not (close and same):
                err = float((got.float() - ref).abs().max())
                print(f"FAIL n={n} k={k} m={m} {cfg}: close={close} prefix-equal={same} max err {err:.3g}")
        if cfg is not None and cfg.split > 1:  # both sums add the partials in the same order
            other = rowinv_linear(x, w, cfg=cfg._replace(fused=not cfg.fused))
            if not torch.equal(other, full):
                case_ok = False
                print(f"FAIL n={n} k={k} {cfg}: fused and two-kernel sums differ")
        ok &= case_ok
        label = (cfg or pick(n, k)).label()
        print(f"n={n:>3} k={k:>3} {label:<28} M in 1..5,17,20: {'ok' if case_ok else 'FAIL'}")
    counters = _COUNTERS.get(device)
    if counters is not None and bool(counters.any()):
        ok = False
        print("FAIL: arrival counters not reset")
    print("check-small:", "PASS" if ok else "FAIL")
    return ok


# ---------------------------------------------------------------------------------------------
# GPU measurement
# ---------------------------------------------------------------------------------------------


def weights(n: int, k: int, device: torch.device) -> list[torch.Tensor]:
    """Distinct [n, k] bf16 weights, together at least ``L2_SPILL`` bytes (at least two)."""
    count = max(2, -(-L2_SPILL // (n * k * 2)))
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) / math.sqrt(k) for _ in range(count)]


def time_us(fn, ws: list[torch.Tensor], calls: int = 20, reps: int = 7) -> float:
    """Microseconds per ``fn(w)``: a CUDA graph of max(calls, len(ws)) back-to-back calls cycling
    over ``ws``; median over ``reps`` replays, each timed by CUDA events."""
    seq = [ws[i % len(ws)] for i in range(max(calls, len(ws)))]
    g = captured(fn, ws[:2], seq)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    del g
    return statistics.median(times) * 1e3 / len(seq)


def sweep_cfgs(n: int, k: int) -> list[Cfg]:
    """Configs to try for one shape at M = 1: tiles 16..128 x 64..256, split 1..16 (fused and
    two-kernel sums), swapped operands where the weight tile is 64+ rows (wgmma). A large shape
    keeps only configs with SMS..16 x SMS programs; every config keeps a whole K slice per split."""
    out: list[Cfg] = [rule(n, k)]
    large = n * k * 2 >= 16 << 20
    for bn in (16, 32, 64, 128):
        tiles = triton.cdiv(n, bn)
        for bk in (64, 128, 256):
            if bk > triton.next_power_of_2(k) or (large and bk == 64):
                continue
            for split in (1, 2, 4, 8, 16):
                progs = tiles * split
                if k // split < bk or progs > 16 * SMS or (large and progs < SMS):
                    continue
                swaps = (False, True) if bn >= 64 and bn * bk <= 16384 else (False,)  # 128x256: smem
                for swap in swaps:
                    for fused in (True, False) if split > 1 else (False,):
                        out.append(Cfg(bn, bk, split, swap=swap, fused=fused))
    return list(dict.fromkeys(out))


def run_sweep(args, device: torch.device) -> None:
    from turnkv.models.triton_gemv import gemv

    bw = copy_bandwidth(device)
    print(f"copy rate {bw / 1e12:.3f} TB/s")
    table, detail = [], {}
    t0 = time.time()
    shapes = [(m, name, nk) for m in args.sweep_models.split(",") for name, nk in MODELS[m][1].items()]
    per_shape = args.sweep_budget / max(1, len(shapes))  # seconds of trying configs per shape
    for model, name, (n, k) in shapes:
        t_shape = time.time()
        ws = weights(n, k, device)
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        ref = (x.float() @ ws[0].float().T).squeeze(0)
        res = {}
        cands = sweep_cfgs(n, k)
        print(f"{model} {name}: {len(cands)} configs", flush=True)
        for phase in range(2):
            for cfg in cands:
                if phase == 0 and time.time() - t_shape > per_shape:
                    print(f"  {name}: time budget reached after {len(res)} configs")
                    break
                try:
                    got = rowinv_linear(x, ws[0], cfg=cfg).float().squeeze(0)
                    err = float((got - ref).abs().max() / ref.abs().max())
                    if err > 2**-6:
                        print(f"  {name} {cfg.label()}: WRONG (rel err {err:.3g})")
                        continue
                    res[cfg] = time_us(lambda w, c=cfg, x=x: rowinv_linear(x, w, cfg=c), ws, reps=5)
                except Exception as exc:  # a config that does not compile must not stop the sweep
                    print(f"  {name} {cfg.label()}: {type(exc).__name__}: {str(exc)[:200]}")
            if phase == 0 and res:  # then warps / stages around the best three tiles
                top = sorted(res, key=res.get)[:3]
                cands = [c._replace(**kw) for c in top for kw in ({"stages": 3}, {"stages": 5}, {"warps": 8})]
        if not res:
            print(f"{name:>8} N={n} K={k}: no config ran")
            continue
        best_cfg = min(res, key=res.get)
        nbytes = n * k * 2
        ranked = sorted(res.items(), key=lambda kv: kv[1])
        cub = time_us(lambda w, x=x: F.linear(x, w), ws)
        gem = time_us(lambda w, x=x: gemv(x, w), ws)
        print(f"{name:>8} reference: cuBLAS {cub:.2f}us {100 * nbytes / (cub * 1e-6) / bw:.0f}%; "
              f"triton_gemv {gem:.2f}us {100 * nbytes / (gem * 1e-6) / bw:.0f}%")  # fmt: skip
        print(f"{name:>8} N={n} K={k}: " + "; ".join(
            f"{c.label()} {us:.2f}us {100 * nbytes / (us * 1e-6) / bw:.0f}%" for c, us in ranked[:6]
        ), flush=True)  # fmt: skip
        table.append({"model": model, "layer": name, "n": n, "k": k, "cfg": list(best_cfg), "us": res[best_cfg],
                      "cublas_us": cub, "gemv_us": gem})  # fmt: skip
        detail[f"{model}/{name}"] = {c.label(): us for c, us in ranked}
        del ws
        torch.cuda.empty_cache()
    print(f"sweep took {time.time() - t0:.0f} s; best per shape:")
    for row in table:
        print(f"  ({row['n']}, {row['k']}): Cfg{tuple(row['cfg'])}  # {row['layer']} {row['us']:.2f} us")
    path = Path(args.out) / "rowinv_sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"copy_bytes_s": bw, "table": table, "detail": detail}, indent=1))
    print(f"wrote {path}")


def exactness(n: int, k: int, device: torch.device) -> dict:
    """Row invariance of the candidate (must hold) and of cuBLAS (for contrast)."""
    g = torch.Generator(device=device).manual_seed(1)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / math.sqrt(k)
    x = torch.randn(32, k, device=device, dtype=torch.bfloat16, generator=g)
    y32 = rowinv_linear(x, w)
    prefix = {m: torch.equal(rowinv_linear(x[:m], w), y32[:m]) for m in (1, 2, 4, 8, 16)}
    alone = sum(not torch.equal(rowinv_linear(x[r : r + 1], w)[0], y32[r]) for r in range(32))
    flip = torch.equal(rowinv_linear(x.flip(0).contiguous(), w).flip(0), y32)
    repeat = all(torch.equal(rowinv_linear(x, w), y32) for _ in range(3))
    ref = x.float() @ w.float().T
    err = float((y32.float() - ref).abs().max() / ref.abs().max())
    c32 = F.linear(x, w)
    cublas_prefix = {m: int((F.linear(x[:m], w) != c32[:m]).any(1).sum()) for m in (1, 2, 4, 8, 16)}
    cublas_alone = sum(not torch.equal(F.linear(x[r : r + 1], w)[0], c32[r]) for r in range(32))
    ok = all(prefix.values()) and alone == 0 and flip and repeat and err < 2**-6
    return {"pass": ok, "prefix_equal": prefix, "rows_alone_differ": int(alone), "flip_equal": flip,
            "repeat_equal": repeat, "max_rel_err": err, "cublas_prefix_rows_differ": cublas_prefix,
            "cublas_rows_alone_differ": int(cublas_alone)}  # fmt: skip


SCAN_MS = (*range(1, 33), 48, 64, 128, 256)


def invariance_scan(n: int, k: int, device: torch.device) -> dict:
    """Per M in SCAN_MS: rows r < M of ``f(x[:M])`` that differ from ``f(x[r:r+1])`` (row r
    decoded alone), for cuBLAS and the candidate; x ``[256, K]``."""
    g = torch.Generator(device=device).manual_seed(2)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / math.sqrt(k)
    x = torch.randn(max(SCAN_MS), k, device=device, dtype=torch.bfloat16, generator=g)
    out = {}
    for key, fn in (("cublas", F.linear), ("cand", rowinv_linear)):
        alone = torch.cat([fn(x[r : r + 1], w) for r in range(x.shape[0])])
        out[key] = {m: int((fn(x[:m], w) != alone[:m]).any(1).sum()) for m in SCAN_MS}
    return out


def run_bench(args, device: torch.device) -> None:
    from turnkv.models.triton_gemv import gemv

    if args.table and not Path(args.table).exists():
        print(f"no {args.table}: every shape takes the built-in table / rule")
    elif args.table:
        loaded = json.loads(Path(args.table).read_text())
        for row in loaded["table"]:
            TABLE[(row["n"], row["k"])] = Cfg(*row["cfg"])
        print(f"table from {args.table}: {len(loaded['table'])} shapes")
    bw = copy_bandwidth(device)
    props = torch.cuda.get_device_properties(device)
    print(f"{props.name}, {props.multi_processor_count} SMs; copy rate {bw / 1e12:.3f} TB/s; "
          f"triton {triton.__version__}, torch {torch.__version__}")  # fmt: skip
    pct = lambda nbytes, us: 100 * nbytes / (us * 1e-6) / bw  # noqa: E731
    rows, exact = [], {}
    for model, (_, layers) in MODELS.items():
        for name, (n, k) in layers.items():
            cfg = pick(n, k)
            ex = exactness(n, k, device)
            ex["scan_vs_alone"] = invariance_scan(n, k, device)
            ex["pass"] = ex["pass"] and not any(ex["scan_vs_alone"]["cand"].values())
            exact[f"{model}/{name}"] = {"cfg": cfg.label(), **ex}
            ws = weights(n, k, device)
            nbytes = n * k * 2
            for m in MS:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                r = {"model": model, "layer": name, "n": n, "k": k, "m": m, "bytes": nbytes,
                     "cfg": cfg.label()}  # fmt: skip
                r["cublas_us"] = time_us(lambda w, x=x: F.linear(x, w), ws)
                r["cand_us"] = time_us(lambda w, x=x: rowinv_linear(x, w), ws)
                r["gemv_us"] = time_us(lambda w, x=x: gemv(x, w), ws) if m == 1 else None
                for key in ("cublas", "cand", "gemv"):
                    us = r[f"{key}_us"]
                    r[f"{key}_gbs"] = nbytes / (us * 1e-6) / 1e9 if us else None
                    r[f"{key}_pct"] = pct(nbytes, us) if us else None
                rows.append(r)
            print(f"{model:>13} {name:>8} {cfg.label():<28} exact {'PASS' if ex['pass'] else 'FAIL'}; M=1 "
                  f"cuBLAS {rows[-len(MS)]['cublas_us']:.2f} us, gemv {rows[-len(MS)]['gemv_us']:.2f} us, "
                  f"cand {rows[-len(MS)]['cand_us']:.2f} us", flush=True)  # fmt: skip
            del ws
            torch.cuda.empty_cache()

    steps = {}
    for model, (nl, layers) in MODELS.items():
        wbytes = sum(n * k * 2 * (1 if name == "head" else nl) for name, (n, k) in layers.items())
        roof_us = wbytes / bw * 1e6
        per = {}
        for m in MS:
            sel = {r["layer"]: r for r in rows if r["model"] == model and r["m"] == m}
            for key in ("cublas", "cand", "gemv"):
                if any(sel[name][f"{key}_us"] is None for name in layers):
                    continue
                us = sum(sel[name][f"{key}_us"] * (1 if name == "head" else nl) for name in layers)
                per.setdefault(key, {})[m] = {"ms": us / 1e3, "pct_roof": 100 * roof_us / us}
        steps[model] = {"layers": nl, "weight_bytes": wbytes, "roof_ms": roof_us / 1e3, **per}

    results = {"copy_bytes_s": bw, "device": props.name, "sms": props.multi_processor_count,
               "triton": triton.__version__, "block_m": BLOCK_M,
               "table": {f"{n}x{k}": c.label() for (n, k), c in TABLE.items()},
               "rows": rows, "exactness": exact, "steps": steps}  # fmt: skip
    report.OUT = Path(args.out)
    save(results, args.tag)
    print_tables(results)


def save(results: dict, tag: str) -> None:
    try:
        report.save(results, tag, _plot)
    except Exception as exc:  # a broken plot must not lose the JSON (written before the plot)
        print(f"plot failed ({type(exc).__name__}: {exc}); JSON at {report.OUT / f'{tag}.json'}")


def print_tables(results: dict) -> None:
    bw = results["copy_bytes_s"]
    print("\n# exactness (candidate must be bit-identical; cuBLAS rows differing, for contrast)")
    print(f"{'shape':<22} {'cfg':<28} {'cand':>5} {'prefix M=1,2,4,8,16':>20} {'alone':>6} {'flip':>5} "
          f"{'rep':>4} {'rel err':>8} | cuBLAS rows differing M=1,2,4,8,16; alone/32")  # fmt: skip
    for key, e in results["exactness"].items():
        pre = "".join("=" if v else "x" for v in e["prefix_equal"].values())
        cb = ",".join(str(v) for v in e["cublas_prefix_rows_differ"].values())
        print(f"{key:<22} {e['cfg']:<28} {'PASS' if e['pass'] else 'FAIL':>5} {pre:>20} "
              f"{e['rows_alone_differ']:>6} {e['flip_equal']!s:>5} {e['repeat_equal']!s:>4} "
              f"{e['max_rel_err']:>8.1e} | {cb}; {e['cublas_rows_alone_differ']}")  # fmt: skip
    print("\n# rows of f(x[:M]) differing from row r decoded alone, M in 1..32,48,64,128,256 "
          "(listed: M:rows where > 0)")  # fmt: skip
    for key, e in results["exactness"].items():
        scan = e["scan_vs_alone"]
        cells = {
            who: " ".join(f"{m}:{v}" for m, v in scan[who].items() if v) or "none"
            for who in ("cand", "cublas")
        }
        print(f"{key:<22} cand {cells['cand']}; cuBLAS {cells['cublas']}")
    print(f"\n# per-step weight matmuls: L x (qkv + o + gate_up + down) + head; roof = weight bytes / copy "
          f"rate {bw / 1e12:.3f} TB/s")  # fmt: skip
    for model, st in results["steps"].items():
        print(f"{model} (L={st['layers']}, {st['weight_bytes'] / 1e9:.3f} GB, roof {st['roof_ms']:.3f} ms)")
        for key in ("cublas", "gemv", "cand"):
            if key not in st:
                continue
            cells = "  ".join(f"M={m}: {v['ms']:.3f} ms {v['pct_roof']:.1f}%" for m, v in st[key].items())
            print(f"  {key:<7} {cells}")
        for key in ("cublas", "cand"):
            one = st[key][1]["ms"]
            extra = "  ".join(f"M={m}: +{(v['ms'] - one) / (m - 1) * 1e3:.1f} us/row"
                              for m, v in st[key].items() if m > 1)  # fmt: skip
            print(f"  {key:<7} extra row vs M=1: {extra}")
    print("\n# per call: us (% of copy rate); cand/cuBLAS = time ratio (< 1: candidate faster)")
    print(f"{'model':<13} {'layer':>7} {'N':>6} {'K':>5} {'M':>3} {'cuBLAS':>15} {'gemv':>15} "
          f"{'cand':>15} {'cand/cuB':>8}  cfg")  # fmt: skip
    for r in results["rows"]:
        cell = lambda key, r=r: (  # noqa: E731
            f"{r[f'{key}_us']:7.2f} ({r[f'{key}_pct']:4.1f}%)" if r[f"{key}_us"] else f"{'-':>15}"
        )
        print(f"{r['model']:<13} {r['layer']:>7} {r['n']:>6} {r['k']:>5} {r['m']:>3} {cell('cublas')} "
              f"{cell('gemv')} {cell('cand')} {r['cand_us'] / r['cublas_us']:>8.2f}  "
              f"{r['cfg'] if r['m'] == 1 else ''}")  # fmt: skip


def _plot(results: dict, plt, path) -> None:
    bw = results["copy_bytes_s"]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.2))
    one = [r for r in results["rows"] if r["m"] == 1]
    labels = [f"{r['model'].split('-')[0]} {r['layer']}" for r in one]
    for i, (key, name) in enumerate((("cublas", "cuBLAS"), ("gemv", "triton_gemv"), ("cand", "row-inv"))):
        a0.bar([j + 0.27 * i for j in range(len(one))], [r[f"{key}_pct"] or 0 for r in one], width=0.27,
               label=name)  # fmt: skip
    a0.set_xticks([j + 0.27 for j in range(len(one))], labels, rotation=35, fontsize=7)
    a0.set(ylabel="% of copy rate", title=f"M = 1 (copy {bw / 1e12:.2f} TB/s)")
    a0.legend(fontsize=8)
    st = results["steps"]["llama3-8b"]
    for key, name in (("cublas", "cuBLAS"), ("cand", "row-inv")):
        ms = sorted(int(m) for m in st[key])
        a1.plot(ms, [st[key][m]["ms"] for m in ms], marker="o", label=name)
    a1.axhline(st["roof_ms"], color="grey", ls="--", label="roof")
    a1.set(xscale="log", xlabel="rows M", ylabel="ms per step", title="llama3-8b weight matmuls per step")
    a1.set_xticks(list(MS), [str(m) for m in MS])
    a1.minorticks_off()
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-small", action="store_true", help="small shapes (CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--sweep", action="store_true", help="configs at M=1 -> <out>/rowinv_sweep.json")
    ap.add_argument("--sweep-models", default="llama3-8b,smollm2-135m")
    ap.add_argument("--sweep-budget", type=float, default=200.0, help="seconds of config trials in all")
    ap.add_argument("--table", default="", help="a rowinv_sweep.json whose best configs override the table")
    ap.add_argument("--tag", default="rowinv_gemm")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(report.OUT))
    args = ap.parse_args()
    if args.check_small:
        device = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
        sys.exit(0 if check_small(device) else 1)
    if not torch.cuda.is_available():
        sys.exit("needs CUDA (or --check-small under TRITON_INTERPRET=1)")
    device = torch.device("cuda")
    if args.sweep:
        run_sweep(args, device)
    else:
        run_bench(args, device)


if __name__ == "__main__":
    main()

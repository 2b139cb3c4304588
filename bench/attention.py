"""The fused attention kernels over the step engine's segment table, against roofs measured in the same run.

    python bench/attention.py --out DIR [--sections headline,decode_sweep,prefill_sweep] [--json]
    TRITON_INTERPRET=1 python bench/attention.py --device cpu --quick      # smoke test, tiny shapes

Heads are llama3-8b's (32 query / 8 KV heads, d128, bf16) unless ``--quick``. Sections:

- ``headline``: decode (1 row) and verify windows (4, 32 rows) at batch 1 and 8 over 1 and 12 views
  at 8K/32K keys, and one prefill chunk of 512/2048/8192 rows over a 32K history. "fused" is the
  engine's call (``FusedBackend.plan(windows).attend``, tiles from ``pick_config``); beside it torch
  SDPA on one contiguous buffer (dense window-causal mask, and ``causal_lower_right``), and for
  windows the portable route (``PortableBackend``: SDPA on the view, or ``lse`` over 12; eager).
  % of the floor ``max(KV bytes / copy rate, causal FLOPs / matmul rate)``.
- ``decode_sweep``: one-row windows at batch 1/8/32 x 8K/32K keys over 4 views (three segments of
  72/19/9 % of the history and a 128-row tail), every block_n x num_warps x num_stages x splits
  beside ``pick_config``'s choice (sized for ``padded_batch(B)`` and ``key_bucket(keys)``, as a
  CUDA-graph step is). TB/s of KV read and % of the copy rate; where splits > 1 the time includes
  the combine pass (``segment_attention`` launches both kernels).
- ``prefill_sweep``: chunks of 2048/4096/8192 rows over 0/16K/56K history rows, every block_m x
  block_n x num_warps x num_stages at ``pick_config``'s splits: TFLOP/s and % of the matmul rate.

Ceilings, measured first: copy = bytes read + written per second by a 1 GiB device copy; matmul =
bf16 8192^3. Causal FLOPs are exact: ``4 * Hq * D * sum_i min(T, window_start + i + 1)``. Times: the
calls of a case rotate over enough layers of the views that L2 cannot hold them, captured in one
CUDA graph; median of 7 replays, per call (CPU: wall time of one pass). Every fused config is run
once per shape against ``reference_attention`` first (``err``: max error / ``selfcheck.tolerance``);
one over 1.0 is reported and never chosen as best. Writes ``attention.json`` and ``.png`` into
``--out`` (``report.save``), prints tables; ``--json`` prints the whole result as the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
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

from turnkv.attention import triton_segments as ts
from turnkv.attention.fused import FusedBackend
from turnkv.attention.portable import PortableBackend
from turnkv.attention.reference import reference_attention, visible_mask
from turnkv.attention.segment_table import pack, padded_batch, upload
from turnkv.attention.selfcheck import error_ratio, tolerance
from turnkv.attention.verdict import Verdict
from turnkv.kv.cache import KVWindow

SPLITS = (0.72, 0.19, 0.09)  # a history's sealed segments, as the merge policy keeps them
L2_BYTES = 60 << 20  # H200: rotate over enough layers that a case reads >= 3x this
DT = torch.bfloat16
DEV = torch.device("cuda")
OK = Verdict(route="fused", verdict="ok", reason="bench")


@dataclasses.dataclass(frozen=True)
class Plan:
    heads: tuple = (32, 8, 128)  # query heads, KV heads, head_dim (llama3-8b)
    tail: int = 128  # rows of the last (writable) view beside the segments
    keys: tuple = (8192, 32768)  # headline windows
    rows: tuple = (1, 4, 32)
    batches: tuple = (1, 8)
    views: tuple = (1, 12)
    chunks: tuple = (512, 2048, 8192)  # headline prefill, over chunk_history rows
    chunk_history: int = 32768
    d_batches: tuple = (1, 8, 32)  # decode sweep
    d_keys: tuple = (8192, 32768)
    d_splits: tuple = (1, 2, 4, 8, 16, 32, 64, 128)
    d_block_n: tuple = (32, 64, 128)
    warps: tuple = (4, 8)
    stages: tuple = (2, 3)
    p_chunks: tuple = (2048, 4096, 8192)  # prefill sweep
    p_history: tuple = (0, 16384, 57344)
    p_block_m: tuple = (64, 128)
    p_block_n: tuple = (64, 128)


QUICK = Plan(heads=(8, 2, 64), tail=8, keys=(160,), rows=(1, 4), batches=(1, 2), chunks=(40,),
             chunk_history=120, d_batches=(1, 3), d_keys=(200,), d_splits=(1, 3), d_block_n=(32, 64),
             warps=(4,), stages=(2,), p_chunks=(40,), p_history=(0, 100), p_block_m=(64,), p_block_n=(32, 64))  # fmt: skip


# -- timing, ceilings, shapes -------------------------------------------------------------------
def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed(calls: list, graph: bool = True, reps: int = 7) -> float:
    """Median seconds per call of ``calls`` (one per layer copy): captured in one CUDA graph, repeated
    to ~1 ms a replay (``graph=False``: eager passes, host work included). CPU: one pass, wall time."""

    def run() -> None:
        for c in calls:
            c()

    t0 = time.perf_counter()
    run()  # warm-up (the correctness call compiled already) and a first estimate
    sync()
    once = (time.perf_counter() - t0) / len(calls)
    if DEV.type != "cuda":
        return once
    n = max(1, min(256 // len(calls), math.ceil(1e-3 / once / len(calls)))) if graph else 1
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                run()
        run = g.replay
    run()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times) / (n * len(calls))


def ceilings() -> dict:
    """Copy (read + written bytes/s, 1 GiB) and bf16 matmul (8192^3) rates; tiny sizes on a CPU."""
    big = DEV.type == "cuda"
    x = torch.empty((1 << 29) if big else (1 << 22), dtype=DT, device=DEV)
    copy = 4 * x.numel() / timed([functools.partial(torch.empty_like(x).copy_, x)], graph=False)
    e = 8192 if big else 256
    a, b = torch.randn(e, e, device=DEV, dtype=DT), torch.randn(e, e, device=DEV, dtype=DT)
    mm = 2 * e**3 / timed([functools.partial(a.matmul, b)], graph=False)  # eager: ms-long calls
    return {"copy_bytes_per_s": copy, "matmul_flop_per_s": mm}


def causal_flops(hq: int, d: int, keys: int, rows: int) -> int:
    """Exact FLOPs of one window: row i sees keys - rows + i + 1 keys, 4 * D FLOPs each per head."""
    return 4 * hq * d * (rows * (keys - rows) + rows * (rows + 1) // 2)


def kv_bytes_of(p: Plan, batch: int, keys: int) -> int:
    return batch * 2 * p.heads[1] * keys * p.heads[2] * DT.itemsize


def lengths(keys: int, views: int, tail: int) -> list[int]:
    """View lengths of one sequence: ``views - 1`` segments of the history (72/19/9 % for three,
    else harmonic, oldest largest), then the tail that holds the window."""
    hist = keys - tail
    if views == 1 or hist <= 0:
        return [keys]
    w = SPLITS if views == 4 else [1 / (i + 1) for i in range(views - 1)]
    segs = [int(hist * x / sum(w)) for x in w]
    segs[0] += hist - sum(segs)
    return [n for n in segs if n] + [tail]


def make_views(lens: list[int], layers: int, hkv: int, d: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One sequence's views ``[layers, Hkv, n, D]``: separate allocations with spare rows (own strides)."""
    out = []
    for i, n in enumerate(lens):
        buf = torch.empty(2, layers, hkv, n + 64 + 16 * i, d, device=DEV, dtype=DT).normal_()
        out.append((buf[0, :, :, :n], buf[1, :, :, :n]))
    return out


def layers_for(kv_bytes: int) -> int:
    """Layer copies to rotate over so that a case reads >= 3x the L2 (two on a CPU: the layer stride)."""
    return max(1, min(16, math.ceil(3 * L2_BYTES / kv_bytes))) if DEV.type == "cuda" else 2


def past(deadline: float, res: dict, what: str) -> bool:
    """Whether ``--deadline`` has passed (then ``what`` is listed as skipped)."""
    late = time.time() > deadline
    if late:
        res["skipped"].append(f"{what}: past the deadline")
    return late


def empty_cache() -> None:
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


class Oracle:
    """fp32 reference and tolerance of a flat batch at layer 0, per sequence (row pieces bound memory)."""

    def __init__(self, q: torch.Tensor, seqs: list, q_lens: list[int], scale: float) -> None:
        self.parts = []
        start = 0
        for views, m in zip(seqs, q_lens, strict=True):
            qs = q[start : start + m].transpose(0, 1)  # [Hq, m, D]
            lv = [(k[0], v[0]) for k, v in views]  # [Hkv, T_i, D] each
            t = sum(k.shape[1] for k, _ in lv)
            step = max(1, (1 << 28) // (qs.shape[0] * t))  # rows per piece: <= 256M fp32 scores
            refs, tols = [], []
            for a in range(0, m, step):
                qa, ws = qs[:, a : a + step], t - m + a
                refs.append(reference_attention(qa, lv, scale, ws))
                tols.append(tolerance(qa, lv, scale, refs[-1], ws))
            self.parts.append((start, m, torch.cat(refs, 1), torch.cat(tols, 1)))
            start += m

    def ratio(self, out: torch.Tensor) -> float:
        """max error / tolerance of ``out`` ``[N, Hq, D]`` over all sequences."""
        return max(error_ratio(out[s : s + m].transpose(0, 1), ref, tol) for s, m, ref, tol in self.parts)


def sig(x: float) -> float:
    return float(f"{x:.4g}")  # 4 significant digits (CPU smoke-test rates are tiny)


def kilo(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def label(c: dict) -> str:
    return f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']} x{c['splits']}"


def figures(secs: float, kv_bytes: int, flops: int, ceil: dict, floor: float | None = None) -> dict:
    bps, fps = kv_bytes / secs, flops / secs
    out = {"us": sig(secs * 1e6), "tbps": sig(bps / 1e12), "tflops": sig(fps / 1e12),
           "copy_pct": sig(100 * bps / ceil["copy_bytes_per_s"]), "mm_pct": sig(100 * fps / ceil["matmul_flop_per_s"])}  # fmt: skip
    return out if floor is None else {**out, "floor_pct": sig(100 * floor / secs)}


# -- headline -------------------------------------------------------------------------------------
HEAD_COLS = ("fused_1", "fused_12", "sdpa", "sdpa_lower_right", "portable_1", "portable_12")


def headline(p: Plan, ceil: dict, res: dict, deadline: float) -> None:
    print("\nheadline: µs (% of floor); TB/s, TFLOP/s and tiles of fused (12 views, else 1)\n| batch | keys "
          "| rows | floor µs | fused 1 view | fused 12 views | SDPA | SDPA lower-right | portable 1 "
          "| portable 12 (lse) | TB/s | TFLOP/s | tiles |")  # fmt: skip
    hkv, d = p.heads[1:]
    groups = [(b, keys, p.rows, p.tail) for keys in p.keys for b in p.batches]
    groups += [(1, p.chunk_history + c, (c,), c) for c in p.chunks]
    for b, keys, rows_list, tail in groups:
        if past(deadline, res, f"headline batch {b} keys {keys}"):
            continue
        layers = layers_for(kv_bytes_of(p, b, keys))
        seqs = {nv: [make_views(lengths(keys, nv, tail), layers, hkv, d) for _ in range(b)] for nv in p.views}
        flat = torch.empty(2, layers, b, hkv, keys, d, device=DEV, dtype=DT).normal_()  # [K|V, L, B, Hkv, T, D]  # fmt: skip
        for rows in rows_list:
            res["headline"].append(headline_case(p, ceil, res["errors"], rows, seqs, flat))
            print(headline_line(res["headline"][-1]), flush=True)
        del seqs, flat
        empty_cache()


def fused_check(step, q: torch.Tensor, views: list, rows: int, scale: float) -> dict:
    err = Oracle(q, views, [rows] * len(views), scale).ratio(step.attend(0, q, scale))
    return {"err": round(err, 3), "config": step.launches[0].config._asdict()}


def sdpa_at(q4, flat, mask, scale, layer):
    """torch SDPA on one contiguous buffer per batch: q4 ``[B, Hq, M, D]``, ``flat[:, layer]``."""
    return F.scaled_dot_product_attention(q4, flat[0, layer], flat[1, layer], attn_mask=mask, scale=scale, enable_gqa=True)  # fmt: skip


def headline_case(p: Plan, ceil: dict, errors: list, rows: int, seqs: dict, flat: torch.Tensor) -> dict:
    """Every implementation at one (batch, keys, rows) point; fused results checked first."""
    hq, hkv, d = p.heads
    scale, (_, layers, b, _, keys, _) = d**-0.5, flat.shape
    kv_bytes, flops = kv_bytes_of(p, b, keys), b * causal_flops(hq, d, keys, rows)
    floor = max(kv_bytes / ceil["copy_bytes_per_s"], flops / ceil["matmul_flop_per_s"])
    q = torch.randn(b * rows, hq, d, device=DEV, dtype=DT)  # [N, Hq, D] flat rows
    impls = {}  # name -> (call of layer=, through a CUDA graph?, check giving extra fields)
    for nv, views in seqs.items():
        windows = [KVWindow(tuple(v), keys - rows, rows) for v in views]
        step = FusedBackend(OK, hq, hkv).plan(windows)
        check = functools.partial(fused_check, step, q, views, rows, scale)
        impls[f"fused_{nv}"] = (functools.partial(step.attend, q=q, scale=scale), True, check)
        if rows <= 32:  # the portable route (eager, as the engine runs it); lse over a chunk: far slower
            port = PortableBackend(Verdict(), DT).plan(windows)
            impls[f"portable_{nv}"] = (functools.partial(port.attend, q=q, scale=scale), False, None)
    q4 = q.view(b, rows, hq, d).transpose(1, 2).contiguous()  # [B, Hq, M, D]
    masks = {"sdpa": None if rows == 1 else visible_mask(rows, keys, keys - rows, DEV)}
    if rows > 1:
        from torch.nn.attention.bias import causal_lower_right

        masks["sdpa_lower_right"] = causal_lower_right(rows, keys)
    for name, mask in masks.items():
        impls[name] = (functools.partial(sdpa_at, q4, flat, mask, scale), True, None)
    rec = {"batch": b, "keys": keys, "rows": rows, "floor_us": sig(floor * 1e6), "impl": {}}
    for name, (fn, graph, check) in impls.items():
        try:
            extra = check() if check else {}
            secs = timed([functools.partial(fn, layer=i) for i in range(layers)], graph)
            rec["impl"][name] = {**figures(secs, kv_bytes, flops, ceil, floor), **extra}
        except Exception as exc:
            errors.append(f"headline {name} b{b} T{keys} rows {rows}: {type(exc).__name__}: {exc}"[:300])
    return rec


def headline_line(r: dict) -> str:
    cells = [f"{x['us']:.1f} ({x['floor_pct']:.0f} %)" if (x := r["impl"].get(c)) else "–" for c in HEAD_COLS]
    f = r["impl"].get("fused_12") or r["impl"].get("fused_1") or {}
    return (f"| {r['batch']} | {kilo(r['keys'])} | {r['rows']} | {r['floor_us']:.1f} | " + " | ".join(cells)
            + f" | {f.get('tbps', '–')} | {f.get('tflops', '–')} | {label(f['config']) if f else '–'} |")  # fmt: skip


# -- sweeps ---------------------------------------------------------------------------------------
def decode_sweep(p: Plan, ceil: dict, res: dict, deadline: float) -> None:
    vary = {"block_n": p.d_block_n, "num_warps": p.warps, "num_stages": p.stages, "splits": p.d_splits}
    for keys, b in itertools.product(p.d_keys, p.d_batches):
        if past(deadline, res, f"decode_sweep batch {b} keys {keys}"):
            continue
        seqs = [make_views(lengths(keys, 4, p.tail), layers_for(kv_bytes_of(p, b, keys)), *p.heads[1:])
                for _ in range(b)]  # fmt: skip
        # packed as a captured decode step is: padded to its graph batch
        sweep_shape("decode_sweep", p, seqs, [1] * b, vary, ceil, res, deadline, padded_batch(b))
        del seqs
        empty_cache()


def prefill_sweep(p: Plan, ceil: dict, res: dict, deadline: float) -> None:
    vary = {"block_m": p.p_block_m, "block_n": p.p_block_n, "num_warps": p.warps, "num_stages": p.stages}
    for m, hist in itertools.product(p.p_chunks, p.p_history):
        if past(deadline, res, f"prefill_sweep {m} rows over {hist}"):
            continue
        seqs = [make_views(lengths(hist + m, 4, m), layers_for(kv_bytes_of(p, 1, hist + m)), *p.heads[1:])]
        sweep_shape("prefill_sweep", p, seqs, [m], vary, ceil, res, deadline)
        del seqs
        empty_cache()


def run_config(q, packed, meta, scale, cfg, layers, oracle, kv_bytes, flops, ceil) -> dict:
    """Check ``cfg`` once against the oracle, then time it over all layers; a failure is a row."""
    rec = cfg._asdict()
    try:
        rec["err"] = round(oracle.ratio(ts.segment_attention(q, packed, meta, 0, scale, cfg)), 3)
        call = functools.partial(ts.segment_attention, q, packed, meta, scale=scale, config=cfg)
        rec |= figures(timed([functools.partial(call, layer=i) for i in range(layers)]), kv_bytes, flops, ceil)  # fmt: skip
    except Exception as exc:  # e.g. out of shared memory at wide tiles and 3 stages
        rec["error"] = f"{type(exc).__name__}: {exc}"[:240]
    return rec


def sweep_shape(name, p, seqs, q_lens, vary, ceil, res, deadline, pad_to=None) -> None:
    """One shape of a sweep: ``pick_config``'s choice first, then every combination of ``vary``."""
    hq, hkv, d = p.heads
    scale, b, layers, keys = d**-0.5, len(seqs), seqs[0][0][0].shape[0], sum(k.shape[2] for k, _ in seqs[0])
    kv_bytes, flops = kv_bytes_of(p, b, keys), b * causal_flops(hq, d, keys, q_lens[0])
    t0 = time.perf_counter()
    words, meta = pack(seqs, q_lens, pad_to=pad_to)
    packed = upload(words, DEV)
    sync()
    shape = {"batch": b, "keys": keys, "rows": q_lens[0], "history": keys - q_lens[0], "views": len(seqs[0]),
             "pack_upload_us": round((time.perf_counter() - t0) * 1e6, 1)}  # fmt: skip
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=DT)  # [N, Hq, D] flat rows
    oracle = Oracle(q, seqs, q_lens, scale)
    pick = ts.pick_config(meta, hq // hkv, DEV)
    grid = [pick._replace(**dict(zip(vary, vals, strict=True))) for vals in itertools.product(*vary.values())]
    runs = []
    for cfg in [pick, *(c for c in grid if c != pick)]:
        if past(
            deadline,
            res,
            f"{name} batch {b} keys {keys} rows {q_lens[0]}: {len(grid) + 1 - len(runs)} configs",
        ):
            break
        runs.append(run_config(q, packed, meta, scale, cfg, layers, oracle, kv_bytes, flops, ceil))
    key = "tbps" if name == "decode_sweep" else "tflops"
    good = [r for r in runs if "us" in r and r["err"] <= 1.0]
    best = max(good, key=lambda r: r[key], default=None)
    pick_r = runs[0] if runs and "us" in runs[0] else None
    by_splits = {}  # the best rate at each split count, over the other knobs
    for r in good:
        by_splits[r["splits"]] = max(by_splits.get(r["splits"], 0), r[key])
    out = {**shape, "pick": runs[0] if runs else None, "best": best, "by_splits": by_splits,
           "pick_of_best": round(pick_r[key] / best[key], 3) if pick_r and best else None, "runs": runs}  # fmt: skip
    if not res[name]:
        print(f"\n{name}: pick_config today | µs | rate | % of roof (err) vs the best passing config | pick/best")  # fmt: skip
    res[name].append(out)
    print(sweep_line(out, key), flush=True)
    if len(by_splits) > 1:
        print("    best by splits: " + "  ".join(f"{k}: {v}" for k, v in sorted(by_splits.items())))


def sweep_line(s: dict, key: str) -> str:
    unit, pct = ("TB/s", "copy_pct") if key == "tbps" else ("TFLOP/s", "mm_pct")
    shape = f"b{s['batch']} {kilo(s['keys'])}" if key == "tbps" else f"{s['rows']} / {kilo(s['history'])}"

    def cell(r):
        if not r or "us" not in r:
            return f"{label(r) if r else '–'} | failed: {(r or {}).get('error', '')[:80]} | | "
        return f"{label(r)} | {r['us']:.1f} | {r[key]} {unit} | {r[pct]:.0f} % ({r['err']})"

    return f"| {shape} | {cell(s['pick'])} | {cell(s['best'])} | {s['pick_of_best']} |"


# -- report ---------------------------------------------------------------------------------------
def plot(res: dict, plt, path: Path) -> None:
    names = [n for n in ("headline", "decode_sweep", "prefill_sweep") if res.get(n)] or ["headline"]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        rs = res[name]
        if name == "headline":
            for c in HEAD_COLS:
                pts = [(i, r["impl"][c]["floor_pct"]) for i, r in enumerate(rs) if c in r["impl"]]
                if pts:
                    ax.plot(*zip(*pts, strict=True), "o", ms=4, label=c)
            ax.set_xticks(range(len(rs)), [f"b{r['batch']} {kilo(r['keys'])} q{r['rows']}" for r in rs])
            ax.tick_params(axis="x", labelrotation=70, labelsize=6)
            ax.set(ylabel="% of floor", yscale="log")
        elif name == "decode_sweep":
            for s in rs:
                pts = sorted((int(k), v) for k, v in s["by_splits"].items()) or [(1, 0)]
                line = ax.plot(*zip(*pts, strict=True), "-o", ms=3, label=f"b{s['batch']} {kilo(s['keys'])}")
                if s["pick"] and "us" in s["pick"]:
                    ax.plot(s["pick"]["splits"], s["pick"]["tbps"], "x", ms=9, color=line[0].get_color())
            ax.axhline(res["ceilings"]["copy_bytes_per_s"] / 1e12, ls=":", color="k", label="copy")
            ax.set_xscale("log", base=2)
            ax.set(xlabel="splits (best tiles at each; x: pick_config)", ylabel="TB/s of KV read")
        else:
            xs = list(range(len(rs)))
            ax.bar(xs, [(s["best"] or {}).get("tflops", 0) for s in rs], label="best")
            ax.plot(xs, [(s["pick"] or {}).get("tflops", 0) for s in rs], "x", ms=9, color="C3", label="pick")
            ax.axhline(res["ceilings"]["matmul_flop_per_s"] / 1e12, ls=":", color="k", label="matmul")
            ax.set_xticks(xs, [f"{s['rows']}/{kilo(s['history'])}" for s in rs], fontsize=7)
            ax.set(xlabel="chunk rows / history", ylabel="TFLOP/s")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"fused attention on {res['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def estimate(p: Plan, sections: list[str]) -> dict:
    """Seconds per section on an H200 from assumed, not measured, costs: ~1.5 s per Triton compile
    (decode: 3 split classes per tile/warp/stage variant, and the combine pass), ~30 ms per decode
    config, ~0.3 s per prefill config, ~2 s per headline case. The run prints the real times."""
    variants = len(p.d_block_n) * len(p.warps) * len(p.stages)
    n_dec = len(p.d_keys) * len(p.d_batches) * len(p.d_splits) * variants
    tiles = len(p.p_block_m) * len(p.p_block_n) * len(p.warps) * len(p.stages)
    est = {"headline": 2 * (len(p.keys) * len(p.batches) * len(p.rows) + len(p.chunks)) + 15,
           "decode_sweep": 0.03 * n_dec + 1.5 * (3 * variants + 8),
           "prefill_sweep": (0.3 * len(p.p_chunks) * len(p.p_history) + 1.5) * tiles}  # fmt: skip
    return {k: round(v) for k, v in est.items() if k in sections}


SECTIONS = {"headline": headline, "decode_sweep": decode_sweep, "prefill_sweep": prefill_sweep}


def main() -> int:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and sweeps (a smoke test)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of " + ",".join(SECTIONS))
    ap.add_argument("--deadline", type=float, default=480, help="seconds; later cases are skipped")
    ap.add_argument("--out", default=str(report.OUT), help="folder for attention.json/.png")
    ap.add_argument("--json", action="store_true", help="the whole result as one JSON line, last")
    ap.add_argument(
        "--heads", default="", help="HQ,HKV,D instead of llama3-8b's (e.g. 16,4,128: its TP2 shard)"
    )
    ap.add_argument("--decode-batches", default="", help="comma list replacing the decode sweep's batches")
    ap.add_argument("--decode-keys", default="", help="comma list replacing the decode sweep's key counts")
    args = ap.parse_args()
    DEV = torch.device(args.device)
    if DEV.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("on a CPU the kernels run only under Triton's interpreter: set TRITON_INTERPRET=1")
    sections = [s for s in args.sections.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        sys.exit(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    p = QUICK if args.quick else Plan()
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    if args.heads:
        p = dataclasses.replace(p, heads=ints(args.heads))
    if args.decode_batches:
        p = dataclasses.replace(p, d_batches=ints(args.decode_batches))
    if args.decode_keys:
        p = dataclasses.replace(p, d_keys=ints(args.decode_keys))
    est = estimate(p, sections)
    print(f"estimate (assumed costs, H200): {est} s, {sum(est.values())} s in all", flush=True)
    res = {"device": torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "cpu (interpreter)",
           "triton": triton.__version__, "heads": p.heads, "plan": dataclasses.asdict(p), "estimate_s": est,
           "headline": [], "decode_sweep": [], "prefill_sweep": [], "errors": [], "skipped": [], "section_s": {}}  # fmt: skip
    res["ceilings"] = ceil = ceilings()
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.3g} TB/s, bf16 matmul {ceil['matmul_flop_per_s'] / 1e12:.3g} TFLOP/s")  # fmt: skip
    start = time.time()
    for name in sections:
        t0 = time.time()
        SECTIONS[name](p, ceil, res, start + args.deadline)
        res["section_s"][name] = round(time.time() - t0, 1)
        print(f"section {name}: {res['section_s'][name]} s", flush=True)
    for e in res["errors"] + res["skipped"]:
        print("NOTE", e)
    report.OUT = Path(args.out)
    report.save(res, "attention", plot)
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fused segment attention against torch SDPA on one contiguous buffer, as % of the roofline floor.

    python bench/attention.py --out DIR [--sections ceil,decode,prefill,host,graph,sweep] [--deadline S]

For each shape (32/8 heads d128, 64/8 d128, 16/8 d256, 9/3 d64), 8K/32K/128K keys, 1/4/9/16/32 query
rows and 1/4/12 views it times the fused kernel over a prebuilt segment table, and in the same run
torch SDPA on one contiguous buffer with the same window-causal mask (``route.single_attention``,
the router's ``single`` path) and SDPA with ``causal_lower_right`` (the same mask without a dense
tensor). The floor is ``max(KV bytes / copy bandwidth, 4*G*rows*D*T*Hkv / bf16 matmul rate)``, both
ceilings measured at the start of the run. Times are CUDA-graph replays (one graph holds many calls,
rotating over enough copies of the KV that L2 cannot hold them), median of 7 replays.

Writes ``attention.json`` (every figure), ``attention.md`` (the tables) and ``attention.png`` into
``--out``, and prints a short summary last.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnkv.attention import triton_segments as ts
from turnkv.attention.lse import lse_attention
from turnkv.attention.reference import visible_mask
from turnkv.attention.route import single_attention

SHAPES = [(32, 8, 128), (64, 8, 128), (16, 8, 256), (9, 3, 64)]
LENGTHS = [8192, 32768, 131072]
ROWS = [1, 4, 9, 16, 32]
SEGMENTS = [1, 4, 12]
PREFILL = (32, 8, 128, 32768, 2048)  # heads, kv heads, head_dim, history, chunk rows
HOST = (32, 8, 128, 32768)
SWEEP = {(32, 8, 128): [1, 16, 32], (9, 3, 64): [1, 32]}  # shape -> rows, at 32K keys, 12 views
SWEEP_KEYS = 32768
L2_BYTES = 60 << 20
DT = torch.bfloat16
DEV = "cuda"  # --dry-run: "cpu" through TRITON_INTERPRET=1, tiny shapes, wall-clock times


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def wall_time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def cuda_time(fn, reps: int = 20) -> float:
    """Median seconds of ``fn`` by CUDA events, after a warm-up."""
    if DEV != "cuda":
        return wall_time(fn, 2)
    fn()
    sync()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def graph_time(calls: list, min_calls: int = 12) -> float:
    """Median seconds per call: ``calls`` (one per KV copy) captured in one CUDA graph, replayed."""
    for c in calls:
        c()  # compile and warm up outside the capture
    sync()
    if DEV != "cuda":
        return sum(wall_time(c, 1) for c in calls) / len(calls)
    rep = max(1, math.ceil(min_calls / len(calls)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rep):
            for c in calls:
                c()
    t = cuda_time(g.replay, reps=7)
    del g
    return t / (rep * len(calls))


def ceilings() -> dict:
    n = 1 << 30 if DEV == "cuda" else 1 << 24  # bytes
    x = torch.empty(n // 2, dtype=DT, device=DEV).normal_()
    t_copy = cuda_time(functools.partial(torch.empty_like(x).copy_, x))
    del x
    e = 8192 if DEV == "cuda" else 256
    a = torch.randn(e, e, device=DEV, dtype=DT)
    b = torch.randn(e, e, device=DEV, dtype=DT)
    t_mm = cuda_time(functools.partial(torch.matmul, a, b))
    return {"copy_bytes_per_s": 2 * n / t_copy, "bf16_flop_per_s": 2 * e**3 / t_mm}


def split_lengths(t: int, nseg: int, rows: int) -> list[int]:
    """A conversation's turns: harmonic sizes, oldest largest; the last view ends with the window."""
    w = [1 / (i + 1) for i in range(nseg)]
    lens = [int(t * x / sum(w)) for x in w]
    lens[-1] = max(lens[-1], rows)
    lens[0] = t - sum(lens[1:])
    return lens


def layout(hkv: int, d: int, lens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Views of separate allocations with spare capacity, so every view has its own strides."""
    out = []
    for i, n in enumerate(lens):
        cap = n + 64 + 16 * i
        k = torch.empty(hkv, cap, d, device=DEV, dtype=DT).normal_()
        v = torch.empty(hkv, cap, d, device=DEV, dtype=DT).normal_()
        out.append((k[:, :n], v[:, :n]))
    return out


def floor_s(ceil: dict, hkv: int, gqa: int, d: int, t: int, rows: int) -> float:
    kv_bytes = 2 * hkv * t * d * 2
    flops = 4 * gqa * rows * d * t * hkv
    return max(kv_bytes / ceil["copy_bytes_per_s"], flops / ceil["bf16_flop_per_s"])


def sdpa_dense(q, k, v, scale, mask):
    """torch SDPA on 4-D tensors with the window-causal mask as a dense bool tensor (none for 1 row)."""
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
    )[0]


def sdpa_lower_right(q, k, v, scale):
    """SDPA with the bottom-right causal bias object: the window mask without a dense tensor."""
    from torch.nn.attention.bias import causal_lower_right

    m, t = q.shape[-2], k.shape[-2]
    mask = causal_lower_right(m, t)
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
    )[0]


def calls(fn, *per_set, **kw) -> list:
    """One bound call of ``fn`` per KV copy: ``fn(*args_of_set_i, **kw)``."""
    return [functools.partial(fn, *args, **kw) for args in zip(*per_set, strict=True)]


def max_diff_vs_sdpa(q, views, out, scale) -> float:
    """A sanity check of each timed result: SDPA on the same rows gathered into one buffer."""
    k = torch.cat([k for k, _ in views], dim=1)
    v = torch.cat([v for _, v in views], dim=1)
    return (out.float() - single_attention(q, k, v, scale).float()).abs().max().item()


def fused_call(q, table, scale, config=None):
    return ts.segment_attention(q.unsqueeze(0), table, scale, config)


def decode_point(ceil, hq, hkv, d, t, rows, layouts, flat) -> list[dict]:
    """Every implementation at one (shape, keys, rows) point."""
    gqa, scale, sets = hq // hkv, d**-0.5, len(flat)
    kv_bytes = 2 * hkv * t * d * 2
    fl = floor_s(ceil, hkv, gqa, d, t, rows)
    base = {"hq": hq, "hkv": hkv, "d": d, "keys": t, "rows": rows, "floor_us": fl * 1e6}
    qs = [torch.randn(hq, rows, d, device=DEV, dtype=DT) for _ in range(sets)]
    ks, vs = [k for k, _ in flat], [v for _, v in flat]
    out = []

    def record(impl, secs, **extra):
        us = secs * 1e6
        out.append(
            {
                **base,
                "impl": impl,
                "us": us,
                "kv_tbps": kv_bytes / secs / 1e12,
                "pct_floor": 100 * fl / secs,
                **extra,
            }
        )

    mask = None if rows == 1 else visible_mask(rows, t, t - rows, torch.device(DEV))
    record("sdpa", graph_time(calls(sdpa_dense, qs, ks, vs, scale=scale, mask=mask)))
    if (hq, hkv, d) == SHAPES[0]:  # the router's single path as written (3-D inputs): once, for the record
        record("sdpa_router_single", graph_time(calls(single_attention, qs, ks, vs, scale=scale)))
    if rows > 1:
        record("sdpa_lower_right", graph_time(calls(sdpa_lower_right, qs, ks, vs, scale=scale)))
    for nseg, sets_views in layouts.items():
        tabs = [ts.build_table([views], rows) for views in sets_views]
        cfg = ts.pick_config(1, hkv, gqa, rows, d, t, 1, torch.device(DEV))
        diff = max_diff_vs_sdpa(qs[0], sets_views[0], fused_call(qs[0], tabs[0], scale)[0], scale)
        secs = graph_time(calls(fused_call, qs, tabs, scale=scale))
        record("fused", secs, segments=nseg, config=cfg._asdict(), max_diff_vs_sdpa=diff)
    return out


def decode_section(ceil: dict, res: dict, deadline: float) -> None:
    for hq, hkv, d in SHAPES:
        for t in LENGTHS:
            if time.time() > deadline:
                res["skipped"].append(f"decode {hq}/{hkv} d{d} T{t}: deadline")
                continue
            kv_bytes = 2 * hkv * t * d * 2
            sets = max(1, min(16, math.ceil(3 * L2_BYTES / kv_bytes)))
            layouts = {n: [layout(hkv, d, split_lengths(t, n, 32)) for _ in range(sets)] for n in SEGMENTS}
            flat = [layout(hkv, d, [t])[0] for _ in range(sets)]
            for rows in ROWS:
                try:
                    res["decode"] += decode_point(ceil, hq, hkv, d, t, rows, layouts, flat)
                except Exception as exc:
                    res["errors"].append(f"decode {hq}/{hkv} d{d} T{t} rows {rows}: {exc}"[:400])
            del layouts, flat
            empty_cache()


def prefill_section(ceil: dict, res: dict) -> None:
    """A 2K-row chunk over a 32K history (34816 keys), 32/8 heads d128."""
    hq, hkv, d, hist, m = PREFILL
    t, scale = hist + m, d**-0.5
    q = torch.randn(hq, m, d, device=DEV, dtype=DT)
    flat = layout(hkv, d, [t])[0]
    flops = 4 * hq * m * d * (hist + m / 2)
    out = {
        "hq": hq,
        "hkv": hkv,
        "d": d,
        "history": hist,
        "rows": m,
        "floor_us": flops / ceil["bf16_flop_per_s"] * 1e6,
    }
    mask = visible_mask(m, t, t - m, q.device)
    out["sdpa_us"] = graph_time([functools.partial(sdpa_dense, q, *flat, scale, mask)], 4) * 1e6
    try:
        out["sdpa_lower_right_us"] = graph_time([lambda: sdpa_lower_right(q, *flat, scale)], 4) * 1e6
    except Exception as exc:
        res["errors"].append(f"prefill sdpa_lower_right: {exc}"[:300])
    for nseg in (1, 12):
        views = layout(hkv, d, split_lengths(t, nseg, m))
        tab = ts.build_table([views], m)
        o = ts.segment_attention(q[None], tab, scale)[0]
        out[f"fused_{nseg}_max_diff_vs_sdpa"] = max_diff_vs_sdpa(q, views, o, scale)
        out[f"fused_{nseg}_us"] = (
            graph_time([lambda tab=tab: ts.segment_attention(q[None], tab, scale)], 4) * 1e6
        )
        out[f"fused_{nseg}_config"] = ts.pick_config(
            1, hkv, hq // hkv, m, d, t, tab.groups, q.device
        )._asdict()
    res["prefill"] = out


def host_section(res: dict) -> None:
    """Host cost of the router's callable (table build + upload + launches) at 12 views, 1 row."""
    hq, hkv, d, t = HOST
    views = layout(hkv, d, split_lengths(t, 12, 1))
    q = torch.randn(hq, 1, d, device=DEV, dtype=DT)
    scale = d**-0.5
    out = {}
    for name, fn in {
        "build_table": lambda: ts.build_table([views], 1),
        "fused_attention": lambda: ts.fused_attention(q, views, scale),
        "lse_attention": lambda: lse_attention(q, views, scale),
        "segment_attention_prebuilt_table": functools.partial(
            fused_call, q, ts.build_table([views], 1), scale
        ),
    }.items():
        fn()
        sync()
        n = 200 if DEV == "cuda" else 2
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out[f"{name}_us_per_call"] = (time.perf_counter() - t0) / n * 1e6
    tab = ts.build_table([views], 1)
    out["kernel_us_graph"] = graph_time([lambda: ts.segment_attention(q[None], tab, scale)]) * 1e6
    res["host"] = out


def graph_section(res: dict) -> None:
    """Capture one decode call in a CUDA graph; replay after the tail grew; torch.compile the op."""
    hq, hkv, d, t = HOST
    scale = d**-0.5
    out: dict = {}
    lens = split_lengths(t, 12, 1)
    views = layout(hkv, d, lens)
    tail_k, tail_v = views[-1]
    base_k, base_v = tail_k._base, tail_v._base  # spare capacity behind the tail
    q_static = torch.randn(1, hq, 1, d, device=DEV, dtype=DT)
    table = ts.build_table([views], 1)
    cfg = ts.pick_config(1, hkv, hq // hkv, 1, d, t + 64, 1, q_static.device)  # fixed for the graph
    out_static = torch.empty_like(q_static)
    try:
        if DEV != "cuda":
            raise RuntimeError("no CUDA graphs in a dry run")
        ts.segment_attention(q_static, table, scale, cfg, out_static)
        sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ts.segment_attention(q_static, table, scale, cfg, out_static)
        errs = []
        for step in range(3):  # decode steps: the tail grows by a row, the table is rewritten in place
            n = lens[-1] + step
            grown = [*views[:-1], (base_k[:, :n], base_v[:, :n])]
            table.update_([grown], 1)
            q_static.normal_()
            g.replay()
            want = ts.fused_attention(q_static[0], grown, scale)
            ref = lse_attention(q_static[0], grown, scale)
            errs.append({"bit_identical_to_eager": bool(torch.equal(out_static[0], want)),
                         "max_diff_vs_lse": (out_static[0].float() - ref.float()).abs().max().item()})  # fmt: skip
        out["cuda_graph_replay"] = errs
    except Exception as exc:
        out["cuda_graph_error"] = traceback.format_exc()[-800:]
        res["errors"].append(f"graph: {exc}"[:300])
    # the split path must be deterministic: identical runs give identical bits
    repeat = {}
    for rows in (1, 4, 16, 32):
        q = torch.randn(hq, rows, d, device=DEV, dtype=DT)
        tab = ts.build_table([views], rows)
        first = fused_call(q, tab, scale)
        repeat[f"rows{rows}"] = all(
            torch.equal(fused_call(q, tab, scale), first) for _ in range(100 if DEV == "cuda" else 2)
        )
    out["repeat_bit_identical"] = repeat
    ks, vs = [k for k, _ in views], [v for _, v in views]
    q = torch.randn(hq, 1, d, device=DEV, dtype=DT)

    def step(q, ks, vs):
        return torch.ops.turnkv.segment_attention(q * 1.0, ks, vs, scale) + 0.0

    eager = step(q, ks, vs)
    for mode in ("default", "reduce-overhead") if DEV == "cuda" else ("default",):
        try:
            fn = torch.compile(step, fullgraph=True, mode=mode)
            for _ in range(3):
                got = fn(q, ks, vs)
            out[f"compile_{mode}"] = {"ok": True, "bit_identical": bool(torch.equal(got, eager))}
        except Exception as exc:
            out[f"compile_{mode}"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    res["graph"] = out


def sweep_section(ceil: dict, res: dict, deadline: float) -> None:
    """Tile / warp / stage / split variants at 32K keys, 12 views."""
    for (hq, hkv, d), rows_list in SWEEP.items():
        gqa, scale, t = hq // hkv, d**-0.5, SWEEP_KEYS
        sets = 3
        layouts = [layout(hkv, d, split_lengths(t, 12, 32)) for _ in range(sets)]
        bns = [64, 128] if d <= 128 else [32, 64]
        for rows in rows_list:
            qs = [torch.randn(hq, rows, d, device=DEV, dtype=DT) for _ in range(sets)]
            tabs = [ts.build_table([v], rows) for v in layouts]
            base = ts.pick_config(1, hkv, gqa, rows, d, t, 1, torch.device(DEV))
            fl = floor_s(ceil, hkv, gqa, d, t, rows)
            variants = [base._replace(block_n=bn) for bn in bns if bn != base.block_n]
            variants += [base._replace(splits=max(1, int(base.splits * f))) for f in (0.5, 1, 2)]
            for cfg in variants:
                if time.time() > deadline:
                    return
                try:
                    secs = graph_time(calls(fused_call, qs, tabs, scale=scale, config=cfg))
                    res["sweep"].append({"hq": hq, "hkv": hkv, "d": d, "rows": rows, **cfg._asdict(), "us": secs * 1e6,
                                         "pct_floor": 100 * fl / secs})  # fmt: skip
                except Exception as exc:
                    res["sweep"].append(
                        {"hq": hq, "d": d, "rows": rows, **cfg._asdict(), "error": str(exc)[:200]}
                    )
        del layouts
        empty_cache()


def ptx_section(res: dict) -> None:
    """What the compiler made of the kernel: vector widths of the K/V loads and the MMA flavour."""
    import re

    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    pats = {
        "cp_async_16B": r"cp\.async\.cg\.shared\.global[^;]*, 0x10",
        "cp_async_other": r"cp\.async\.ca\.shared\.global",
        "ld_global_v4": r"ld\.global[^;]*\.v4\.",
        "ld_global_scalar_b16": r"ld\.global[^;v]*\.b16 ",
        "wgmma": r"wgmma\.mma_async",
        "mma_sync": r"mma\.sync",
        "tma": r"cp\.async\.bulk\.tensor",
    }
    found = []
    for f in sorted(root.rglob("_segment_attn_kernel.ptx")):
        text = f.read_text()
        meta = {}
        for j in f.parent.glob("_segment_attn_kernel.json"):
            m = json.loads(j.read_text())
            meta = {k: m.get(k) for k in ("num_warps", "num_stages", "shared", "n_regs", "n_spills")}
            meta["constants"] = {k: v for k, v in (m.get("constants") or {}).items() if k.isupper()}
        found.append({**meta, **{k: len(re.findall(p, text)) for k, p in pats.items()}})
    res["ptx"] = found


def write_outputs(res: dict, out: Path) -> None:
    (out / "attention.json").write_text(json.dumps(res, indent=1))
    lines = []
    dec = res["decode"]
    if dec:
        lines.append(
            "| shape | keys | rows | floor µs | SDPA µs (%) | SDPA lower-right µs (%) | fused 1 view µs (%) | 4 views | 12 views | fused TB/s (12) |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        keys = sorted(
            {(r["hq"], r["hkv"], r["d"], r["keys"], r["rows"]) for r in dec},
            key=lambda k: (-k[0] * k[2], k[3], k[4]),
        )
        for key in keys:
            rs = {
                (r["impl"], r.get("segments")): r
                for r in dec
                if (r["hq"], r["hkv"], r["d"], r["keys"], r["rows"]) == key
            }
            lines.append(table_line(key, rs))
    (out / "attention.md").write_text("\n".join(lines) + "\n")
    if dec:
        try:
            plot(res, out / "attention.png")
        except Exception as exc:
            res["errors"].append(f"plot: {exc}"[:200])


def table_line(key: tuple, rs: dict) -> str:
    hq, hkv, d, t, rows = key

    def cell(k):
        r = rs.get(k)
        return f"{r['us']:.1f} ({r['pct_floor']:.0f} %)" if r else "–"

    f12 = rs.get(("fused", 12))
    floor_us = next(iter(rs.values()))["floor_us"]
    cells = [
        cell(k)
        for k in [("sdpa", None), ("sdpa_lower_right", None), ("fused", 1), ("fused", 4), ("fused", 12)]
    ]
    tbps = f"{f12['kv_tbps']:.2f}" if f12 else "–"
    return (
        f"| {hq}/{hkv} d{d} | {t // 1024}K | {rows} | {floor_us:.1f} | " + " | ".join(cells) + f" | {tbps} |"
    )


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["hq"], r["hkv"], r["d"]) for r in res["decode"]}, key=lambda s: -s[0] * s[2])
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False, sharey=True)
    for ax, (hq, hkv, d) in zip(axes[0], shapes, strict=True):
        for t, style in zip(LENGTHS, ["-", "--", ":"][: len(LENGTHS)], strict=True):
            for impl, seg, color in [
                ("fused", 12, "C0"),
                ("fused", 1, "C2"),
                ("sdpa", None, "C3"),
                ("sdpa_lower_right", None, "C1"),
            ]:
                pts = sorted((r["rows"], r["pct_floor"]) for r in res["decode"]
                             if (r["hq"], r["hkv"], r["d"], r["keys"], r["impl"], r.get("segments")) == (hq, hkv, d, t, impl, seg))  # fmt: skip
                if pts:
                    label = f"{impl}{'' if seg is None else f' {seg} views'} {t // 1024}K"
                    ax.plot(*zip(*pts, strict=True), style, color=color, marker="o", ms=3, label=label)
        ax.set_title(f"{hq}/{hkv} heads, d{d}")
        ax.set_xlabel("query rows")
        ax.set_xticks(ROWS)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("% of roofline floor")
    axes[0][-1].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def dry_run() -> None:
    global DEV, SHAPES, LENGTHS, ROWS, PREFILL, HOST, SWEEP, SWEEP_KEYS
    DEV, SHAPES, LENGTHS, ROWS = "cpu", [(8, 2, 64)], [192, 320], [1, 9]
    PREFILL, HOST, SWEEP, SWEEP_KEYS = (8, 2, 64, 256, 48), (8, 2, 64, 256), {(8, 2, 64): [1, 4]}, 256


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--sections", default="decode,prefill,host,graph,ptx")
    ap.add_argument("--shapes", default="", help="e.g. 32/8/128,9/3/64 (default: all four)")
    ap.add_argument(
        "--deadline", type=float, default=480.0, help="seconds; later decode sections are skipped"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes: checks the script"
    )
    args = ap.parse_args()
    if args.dry_run:
        dry_run()
    if args.shapes:
        global SHAPES
        SHAPES = [tuple(int(x) for x in sh.split("/")) for sh in args.shapes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = start + args.deadline
    sections = args.sections.split(",")
    res: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)", "torch": torch.__version__, "decode": [], "sweep": [],
                 "errors": [], "skipped": []}  # fmt: skip
    import triton

    res["triton"] = triton.__version__
    res["ceilings"] = ceil = ceilings()
    print(
        f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    for name in sections:
        t0 = time.time()
        try:
            if name == "sweep":
                sweep_section(ceil, res, deadline)
            elif name == "decode":
                decode_section(ceil, res, deadline)
            elif name == "prefill":
                prefill_section(ceil, res)
            elif name == "host":
                host_section(res)
            elif name == "graph":
                graph_section(res)
            elif name == "ptx":
                ptx_section(res)
        except Exception:
            res["errors"].append(f"{name}: {traceback.format_exc()[-1500:]}")
        res.setdefault("section_seconds", {})[name] = round(time.time() - t0, 1)
        write_outputs(res, out)
        print(f"section {name}: {time.time() - t0:.0f} s", flush=True)
    summary(res)
    return 0


def summary(res: dict) -> None:
    for e in res["errors"]:
        print("ERROR", e[:400])
    if res["sweep"]:
        best = {}
        for r in res["sweep"]:
            if "us" in r:
                k = (r["hq"], r["d"], r["rows"])
                if k not in best or r["us"] < best[k]["us"]:
                    best[k] = r
        for k, r in sorted(best.items()):
            print("sweep best", k, {x: r[x] for x in ("block_m", "block_n", "num_warps", "num_stages", "splits")},
                  f"{r['us']:.1f} us {r['pct_floor']:.0f} %")  # fmt: skip
    for r in res.get("ptx", [])[:12]:
        print("ptx", json.dumps(r)[:300])
    for key in ("prefill", "host", "graph"):
        if key in res:
            print(key, json.dumps(res[key])[:900])
    print("shape keys rows | floor | sdpa% sdpa_lr% | fused1% fused4% fused12%")
    keys = [
        ("sdpa", None),
        ("sdpa_lower_right", None),
        ("fused", 1),
        ("fused", 4),
        ("fused", 12),
    ]
    for r in res["decode"]:
        if r["impl"] == "fused" and r["segments"] == 12 and r["keys"] >= 32768:
            at = (r["hq"], r["d"], r["keys"], r["rows"])
            others = {
                (x["impl"], x.get("segments")): x
                for x in res["decode"]
                if (x["hq"], x["d"], x["keys"], x["rows"]) == at
            }
            pct = " ".join(f"{others.get(k, {}).get('pct_floor', float('nan')):.0f}" for k in keys)
            print(
                f"{r['hq']}/{r['hkv']}d{r['d']} {r['keys'] // 1024}K {r['rows']:>2} | {r['floor_us']:.0f}us | {pct}"
            )


if __name__ == "__main__":
    sys.exit(main())

"""Decode (and first-turn prefill) speed of the step engine against its roof, in one process.

Decode: ``B`` conversations each continue a segmented history of ``--context`` tokens (three sealed
segments, 72/19/9 %, so four views with the tail) with a follow-up of ``--new`` prompt tokens and
``--gen`` greedy tokens, all through the real turn path (bank restore by reference, scheduler,
steps, sampling). The contiguous layout runs the same conversations beside it (its restore copies
each history into one buffer). Histories are random K/V rows built directly on the device: decode
reads the same bytes whatever they hold, and no prefill of B x context tokens is needed.

Per run: ``tok_s`` (aggregate decode tokens/s over steps where all B turns decode), ``step_ms``
(wall per step), ``host_ms`` (wall per step minus the time the scheduler waits for the GPU),
``gpu_ms`` (kernel time per step, from torch.profiler; CUDA only) and the roof: weight bytes read
per step (every weight but an untied embedding table) + KV bytes of all B contexts, over the copy
bandwidth measured in this run (``roof_tok_s``; null on a CPU).

``--prefill 32768,65536``: a first turn of that many tokens through the same path, in chunks of
``--chunk`` rows, against the FLOP floor (linear 2 x params x tokens + causal attention
4 x L x Hq x D x N^2 / 2) at the bf16 matmul rate measured in this run.

    python bench/decode.py --model default --device cpu --batch 1,8 --context 1024 --gen 32
    python bench/decode.py --shape llama3-8b --device cuda --batch 1,8,32 --context 8192 --gen 128 --json
    python bench/decode.py --shape llama3-8b --device cuda --batch 1 --context 8192 --prefill 32768,65536

Several engines (``--deterministic on,off``, ``--kv-dtype``, ``--layouts`` lists) decode step for
step alternately on a CPU (``--interleave``, ``bench/decode_run.py``: a shared machine's load then
falls on both alike), each run timed once its thread governor has chosen its count; the
``--deterministic`` A/B reports the median speed ratio of the interleaved step pairs.

Prints a table, then (``--json``) one JSON object as its last line; writes bench/out/<tag>.json/.png.
"""

from __future__ import annotations

from turnkv.threads import prepare_env

prepare_env()  # OpenMP spins briefly (as the CLI sets it), before torch loads

import argparse
import itertools
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from decode_run import DecodeRun, paired_ratio, run_decode, run_interleaved
from report import cpu_name, save

from turnkv.attention import cpu_native
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import Failed, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef
from turnkv.models import cpu_int4
from turnkv.runtime import load_engine, new_bank, run_ahead

SPLITS = (0.72, 0.19, 0.09)  # sizes that the merge policy keeps as three segments


# -- ceilings -----------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of a large device-to-device copy (read + written), or None on a CPU."""
    if device.type != "cuda":
        return None
    x = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float | None:
    """FLOP/s of an 8192^3 matmul in ``dtype`` on random data, or None on a CPU."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    return 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1e3)


def weight_bytes_per_step(engine: Engine) -> int:
    """Bytes of weights one decode step reads: all parameters but an untied embedding table, and
    the int4 planes and scales of packed CPU weights (``QuantWeight``; not their GGUF blocks,
    which only embedding lookups gather)."""
    from turnkv.models.quant import QuantWeight

    model = engine.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None and isinstance(model.embed, torch.Tensor):
        total -= model.embed.numel() * model.embed.element_size()  # untied: a few rows gathered
    for m in model.modules():
        if isinstance(m, QuantWeight) and m.packed is not None:
            total += sum(t.numel() * t.element_size() for t in (m.packed, m.scale_zeros) if t is not None)
    return total


# -- histories ----------------------------------------------------------------------------------
def synthetic_history(engine: Engine, context: int, seed: int) -> SegmentedSnapshot:
    """``context`` rows of random K/V in three segments (random token ids, no prefill)."""
    s = engine.shape
    g = torch.Generator(device=s.device).manual_seed(seed)
    vocab = engine.loaded.config.vocab_size
    eos = set(engine.tokenizer.eos_token_ids)
    refs = []
    sizes = [int(context * f) for f in SPLITS[:-1]]
    sizes.append(context - sum(sizes))
    for n in sizes:
        kv = torch.randn((2, s.num_layers, s.num_kv_heads, n, s.head_dim), generator=g, device=s.device)
        kv = kv.to(s.dtype)
        ids = torch.randint(0, vocab, (n,), generator=g, device=s.device).tolist()
        seg = Segment(kv[0], kv[1], tuple(t if t not in eos else (t + 1) % vocab for t in ids))
        refs.append(SegmentRef(seg, n))
    return SegmentedSnapshot(refs)


# -- prefill ------------------------------------------------------------------------------------
def run_prefill(engine: Engine, n: int, chunk: int, flops_rate: float | None, args) -> dict:
    mc = engine.loaded.config
    engine.prefill_chunk = chunk
    if not getattr(engine, "_prefill_warm", False):  # Triton compiles the prefill kernels once
        engine.prefill(engine.new_cache(), list(range(1, 2 * chunk + 1)))
        engine._prefill_warm = True
    bank = new_bank(engine, 2 * n * engine.shape.bytes_per_row + (4 << 30))
    sched = Scheduler(
        engine, bank, max_running=1, max_batch_tokens=chunk, run_ahead=run_ahead(engine.cfg, engine)
    )
    ids = torch.randint(0, mc.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    eos = set(engine.tokenizer.eos_token_ids)
    ids = [t if t not in eos else (t + 1) % mc.vocab_size for t in ids]
    done = []
    sched.submit(TurnRequest(ids, SamplingParams(ignore_eos=True), max_tokens=1),
                 lambda ev: done.append(ev))  # fmt: skip
    if engine.shape.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while sched.busy:
        sched.step()
    if engine.shape.device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    failed = [ev for ev in done if isinstance(ev, Failed)]
    if failed:
        raise RuntimeError(f"the prefill turn failed: {failed[0]}")
    params = weight_bytes_per_step(engine) // engine.shape.dtype.itemsize - mc.vocab_size * mc.hidden_size
    flops = 2 * params * n + 2 * mc.vocab_size * mc.hidden_size  # the LM head on the last row only
    flops += 4 * mc.num_layers * mc.num_heads * mc.head_dim * n * (n + 1) / 2
    floor = flops / flops_rate if flops_rate else None
    return {"tokens": n, "chunk": chunk, "seconds": secs, "tflop": flops / 1e12,
            "floor_s": floor, "floor_pct": 100 * floor / secs if floor else None}  # fmt: skip


# -- main ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--shape", help="random weights: llama3-8b | qwen3-8b | qwen3-32b | test")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--layouts", default="segmented,contiguous")
    ap.add_argument("--kv-dtype", default="auto", help="KV dtypes to run, e.g. auto,float32 (A/B on a CPU)")
    ap.add_argument("--cuda-graphs", default="auto")
    ap.add_argument(
        "--cpu-kernel",
        default="auto",
        help="CPU decode attention: auto | c | torch, or a list (c,torch) to A/B them in this process",
    )
    ap.add_argument(
        "--cpu-int4",
        default="auto",
        help="CPU packed-weight matmul: auto | c | torch, or c,torch to A/B them (one model loaded each)",
    )
    ap.add_argument("--speculate", default="auto", help="auto (the engine's default) | off")
    ap.add_argument(
        "--deterministic",
        default="off",
        help="on | off, or on,off to A/B them (one model loaded, an engine each)",
    )
    ap.add_argument(
        "--interleave",
        default="auto",
        help="several engines (e.g. --deterministic on,off): alternate their decode steps one by one, each "
        "timed alone, and report paired ratios (auto: on a CPU; bench/decode_run.py says why) | on | off",
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; else each turn samples (seeded)"
    )
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument(
        "--run-ahead",
        default="auto",
        help="the scheduler's run-ahead: auto (on with CUDA graphs) | on | off, or a list (A/B)",
    )
    ap.add_argument("--prefill", default="", help="first-turn sizes to time against the FLOP floor")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill rows per step (--prefill)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--profile-top", type=int, default=0, help="print the N costliest kernels per run")
    ap.add_argument("--host-profile", type=int, default=0, help="print the N costliest Python functions")
    ap.add_argument("--tag", default="decode")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="N > 1: the same runs on one process and on a group of N (bench/decode_parallel.py)")  # fmt: skip
    ap.add_argument("--sizes", default="", help="group sizes to run with --tensor-parallel (default 1,N)")
    args = ap.parse_args()
    from turnkv.threads import set_threads

    set_threads(0)  # torch threads = the cores available, as the CLI does
    if args.tensor_parallel > 1:
        from decode_parallel import compare

        compare(args, measure_rank, _plot)
        return
    results = measure(args)
    save(dict(results), args.tag, _plot)
    if args.json:
        print(json.dumps(results))


def measure_rank(group, argv: dict) -> dict | None:
    """One rank of a group running ``measure`` (spawned by ``decode_parallel.compare``); rank 0's
    results come back."""
    out = measure(argparse.Namespace(**argv), group)
    return out if group.rank == 0 else None


def measure(args, group=None) -> dict:
    """Every run of ``args`` in this process (``group``: as one rank of it; rank 0 prints)."""
    say = print if group is None or group.rank == 0 else _quiet
    size = 1 if group is None else args.tensor_parallel
    model = f"random:{args.shape}" if args.shape else args.model
    base = EngineConfig(model=model, device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs,
                        tensor_parallel=size, speculate=args.speculate)  # fmt: skip
    kvs, int4s, dets = args.kv_dtype.split(","), args.cpu_int4.split(","), args.deterministic.split(",")
    engines = {}  # label -> engine: the layout, KV dtype and CPU matmul where several are compared
    for int4 in int4s:
        if int4 != "auto":  # one model loaded per matmul kernel (packing is done at load)
            cpu_int4.set_enabled(int4 == "c")
        loaded = None
        for name, kv, det in itertools.product(args.layouts.split(","), kvs, dets):
            cfg = replace(base, kv_layout=name, kv_dtype=kv, deterministic=det)
            e = load_engine(cfg, progress=False) if loaded is None else Engine(loaded, cfg)
            loaded = e.loaded
            label = name if len(kvs) == 1 else f"{name}/{e.info.kv_dtype}"
            label = label if len(int4s) == 1 else f"{label}/mm-{int4}"
            label = label if len(dets) == 1 else f"{label}/det-{det}"
            engines[label] = e
    cpu_int4.set_enabled(True)
    first = next(iter(engines.values()))
    for e in engines.values():
        # torch's thread count is the process's: one governor for all (a server has one engine);
        # each with its own, two engines of an A/B kept different counts on a loaded VM, one a
        # spinning 2-thread team at half the other's speed (docs/BENCHMARKS.md, issue 33)
        e.threads = first.threads
    device = first.shape.device
    capacity = kv_capacity(first)  # before the histories take memory, as a server would see it
    bw = copy_bandwidth(device)
    rate = matmul_rate(device, first.shape.dtype)
    wbytes = weight_bytes_per_step(first)
    info = first.info
    ceilings = f"copy {bw / 1e12:.2f} TB/s; matmul {rate / 1e12:.0f} TFLOP/s; " if bw and rate else ""
    say(f"# {info.model_name} on {info.device} {info.dtype} x{size}; attention {info.verdict.route} "
        f"({info.verdict.verdict}); graphs {info.graphs}; {ceilings}"
        f"weights read per step {wbytes / 1e9:.3f} GB per GPU; KV capacity {capacity['tokens']} tokens")  # fmt: skip
    if device.type == "cpu":  # the CPU and its vector extensions, and the C kernels' variant
        from turnkv import cbuild

        say(f"# CPU {cpu_name()}, {torch.get_num_threads()} thread(s), C kernels {cbuild.variant()}")
    runs, pairs_out = [], []
    for b in [int(x) for x in args.batch.split(",") if x]:
        histories = {}  # per KV dtype: rows of one dtype restore only into caches of it
        for e in engines.values():
            if e.shape.dtype not in histories:
                histories[e.shape.dtype] = [synthetic_history(e, args.context, seed=i) for i in range(b)]
        kernels = getattr(args, "cpu_kernel", "auto").split(",")
        combos = list(itertools.product(engines.items(), args.run_ahead.split(","), kernels))
        mode = getattr(args, "interleave", "off")
        # engines only: the C-kernel switch is process-wide, and run-ahead names no engine apart
        interleave = len(combos) == len(engines) > 1 and (
            mode == "on" or (mode == "auto" and device.type == "cpu")
        )
        if interleave:
            done, pairs = run_interleaved(
                [DecodeRun(e, histories[e.shape.dtype], args, ahead) for (_, e), ahead, _ in combos]
            )
            steps = {n: p for ((n, _), _, _), p in zip(combos, pairs, strict=True)}
            for ((name, e), ahead, _), r in zip(combos, done, strict=True):
                runs.append(_run_row(name, b, args, e, ahead, r, wbytes, bw))
                _say_run(say, runs[-1], name, ahead)
            for name in steps:  # a --deterministic A/B: each on engine against its off twin
                twin = name.replace("det-on", "det-off")
                if "det-on" in name and twin in steps:
                    ab = {"batch": b, "a": name, "b": twin, **paired_ratio(steps[name], steps[twin])}
                    pairs_out.append(ab)
                    say(f"{name} speed / {twin}: x{ab['median']} (quartiles {ab['q1']}-{ab['q3']}, "
                        f"{ab['pairs']} interleaved step pairs)", flush=True)  # fmt: skip
            del histories
            continue
        for (name, engine), ahead, kern in combos:
            if kern != "auto":
                cpu_native.set_enabled(kern == "c")
                name = f"{name}+{kern}" if len(kernels) > 1 else name
            try:
                r = run_decode(engine, histories[engine.shape.dtype], args, ahead)
            except Exception as exc:  # one failed run must not lose the others' figures
                import traceback

                traceback.print_exc()
                runs.append({"layout": name, "batch": b, "context": args.context, "error": repr(exc)})
                continue
            runs.append(_run_row(name, b, args, engine, ahead, r, wbytes, bw))
            _say_run(say, runs[-1], name, ahead)
        del histories
    prefills = []
    timed = list(engines.items()) if len(dets) > 1 else [("", first)]  # the A/B: each engine
    for n, (label, e) in itertools.product([int(x) for x in args.prefill.split(",") if x], timed):
        try:
            p = {"engine": label, **run_prefill(e, n, args.chunk, rate, args)}
        except Exception as exc:
            import traceback

            traceback.print_exc()
            prefills.append({"tokens": n, "error": repr(exc)})
            continue
        prefills.append(p)
        say(f"{label} prefill {n:>6} tokens in chunks of {args.chunk}: {p['seconds']:.2f} s, floor "
            f"{p['floor_s'] and round(p['floor_s'], 2)} s ({p['floor_pct'] and round(p['floor_pct'], 1)} %)", flush=True)  # fmt: skip
    control_us = None
    if group is not None and size > 1:  # what the server's rank 0 adds to each step to drive the others
        from turnkv.parallel.control import message_cost_us

        control_us = round(message_cost_us(group), 1)
        say(f"control message per step (rank 0 to the others, gloo): {control_us} us")
        say(f"all-reduce: {group.health.all_reduce}")
    return {"device": info.device, "model": info.model_name, "dtype": info.dtype, "gpus": size,
            "control_us_per_step": control_us,
            "all_reduce": group.health.all_reduce if group is not None else None,
            "attention": info.verdict.route, "graphs": info.graphs, "copy_bytes_s": bw,
            "matmul_flop_s": rate, "weight_bytes_per_step": wbytes, "kv_capacity": capacity,
            "runs": runs, "interleaved_ab": pairs_out, "prefill": prefills}  # fmt: skip


def _run_row(name: str, b: int, args, engine: Engine, ahead: str, r: dict, wbytes: int, bw) -> dict:
    """One run's row of the table and the JSON."""
    ctx = args.context + args.new + args.gen // 2
    kv = b * ctx * engine.shape.bytes_per_row
    roof = b / ((wbytes + kv) / bw) if bw else None
    tok_s = b * r["steps"] / r["wall_s"] if r["wall_s"] else 0.0
    med = r["median_step_s"]
    return {
        "layout": name, "batch": b, "context": args.context, "tok_s": round(tok_s, 2),
        "step_ms": round(1e3 * r["wall_s"] / max(r["steps"], 1), 3),
        "median_step_ms": med and round(1e3 * med, 3),
        "host_ms": round(1e3 * r["host_s"] / max(r["steps"], 1), 3),
        "gpu_ms": r["gpu_ms"] and round(r["gpu_ms"], 3),
        "roof_tok_s": roof and round(roof, 2), "roof_pct": roof and round(100 * tok_s / roof, 1),
        "cached_tokens": r["cached"], "steps": r["steps"], "settle_steps": r["settle_steps"],
        "threads": r["threads"], "graph_replays": r["graph_replays"],
        "run_ahead": ahead, "run_ahead_steps": r["run_ahead_steps"],
        "kv_dtype": engine.info.kv_dtype, "cpu_kernel": cpu_native.status(), "cpu_int4": engine.info.weights["matmul"],
    }  # fmt: skip


def _say_run(say, x: dict, name: str, ahead: str) -> None:
    b = x["batch"]
    say(f"{name:>10} {'ahead ' + ahead if ahead != 'auto' else '':>9} batch {b:>3} ctx {x['context']:>6}: {x['tok_s']:>9.1f} tok/s  step {x['step_ms']:>8.3f} ms"
        f"  host {x['host_ms']:>7.3f} ms  gpu {x['gpu_ms']} ms  roof {x['roof_tok_s']} tok/s ({x['roof_pct']} %)",
        flush=True)  # fmt: skip


def kv_capacity(engine: Engine) -> dict:
    """What ``--bank-bytes auto`` gives this engine now: bytes per GPU and tokens (rows) of KV."""
    budget = new_bank(engine, "auto").budget_bytes
    return {"budget_bytes": budget, "bytes_per_row": engine.shape.bytes_per_row,
            "tokens": budget // engine.shape.bytes_per_row}  # fmt: skip


def _quiet(*args, **kwargs) -> None:
    """``print`` on ranks other than 0."""


def _plot(results: dict, plt, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for layout in sorted({r["layout"] for r in results["runs"]}):
        rs = [r for r in results["runs"] if r["layout"] == layout and "tok_s" in r]
        ax.plot([r["batch"] for r in rs], [r["tok_s"] for r in rs], "-o", label=f"{layout} tok/s")
        if rs and rs[0]["roof_tok_s"]:
            ax.plot([r["batch"] for r in rs], [r["roof_tok_s"] for r in rs], ":", label=f"{layout} roof")
    ax.set(xscale="log", yscale="log", xlabel="conversations per step", ylabel="decode tokens/s",
           title=f"{results['model']} on {results['device']}")  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

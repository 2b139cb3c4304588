"""Where one CPU decode step's time goes: the C matmuls by shape, the attention kernel, the rest.

Wraps ``cpu_decoder.Decoder.run`` (the layers in one C call), ``cpu_int4.Matrix.mm`` and
``NativeStep.attend`` (the LM head, and the torch loop's calls with ``--torch-loop``) with
wall-clock timers around a greedy decode of the default model (``TURNKV_CPU_ISA`` picks the
kernels' variant), one process per thread count:

    TURNKV_CPU_ISA=avx2 python bench/cpu_profile.py --threads 1,2

Prints per-token milliseconds per part; the "rest" is the step's wall time less the timed kernels
(norms, rope, sampling, Python glue). The floor is the weight bytes read per token over this
machine's measured copy rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict


def child(threads: int, gen: int, torch_loop: bool) -> dict:
    from turnkv.threads import prepare_env

    prepare_env()
    from cpu_matmul import copy_rate  # (imports torch: after prepare_env)

    from turnkv import cbuild
    from turnkv.attention import cpu_native
    from turnkv.config import EngineConfig
    from turnkv.engine.sampling import SamplingParams
    from turnkv.engine.turn import GenEvent, TurnRequest
    from turnkv.models import cpu_decoder, cpu_int4
    from turnkv.runtime import build, load_engine
    from turnkv.threads import set_threads

    set_threads(threads)
    cpu_decoder.set_enabled(not torch_loop)
    cfg = EngineConfig(device="cpu", weights="packed", threads=threads, speculate="off")  # one row a step
    eng = load_engine(cfg, progress=False)
    rt = build(cfg, "bench", engine=eng)
    bank = rt.new_bank("1G")
    times: dict[str, float] = defaultdict(float)
    wbytes: dict[str, int] = {}
    calls: dict[str, int] = defaultdict(int)
    mm, attend, layers = cpu_int4.Matrix.mm, cpu_native.NativeStep.attend, cpu_decoder.Decoder.run

    def timed_mm(self, a, residual=None):
        t0 = time.perf_counter()
        out = mm(self, a, residual)
        packed, n = self.packed, self.n
        key = f"mm M={a.shape[0]} {n}x{a.shape[1]}{' q8' if cpu_int4.is_q8(packed) else ''}"
        times[key] += time.perf_counter() - t0
        calls[key] += 1
        wbytes[key] = packed.numel() * packed.element_size()
        return out

    def timed_attend(self, *args, **kw):
        t0 = time.perf_counter()
        attend(self, *args, **kw)
        times["attention"] += time.perf_counter() - t0
        calls["attention"] += 1

    def timed_layers(self, x, *args):
        t0 = time.perf_counter()
        out = layers(self, x, *args)
        key = f"layers in C M={x.shape[0]}"
        times[key] += time.perf_counter() - t0
        calls[key] += 1
        return out

    cpu_int4.Matrix.mm, cpu_native.NativeStep.attend = timed_mm, timed_attend
    cpu_decoder.Decoder.run = timed_layers
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])

    def run(n: int, ns: str) -> float:
        req = TurnRequest(list(ids), SamplingParams(ignore_eos=True), max_tokens=n, namespace=ns)
        stats = [e.stats for e in rt.run_turn(req, bank) if isinstance(e, GenEvent) and e.stats][-1]
        return stats.decode_tok_s

    run(8, "warm")
    times.clear()
    calls.clear()
    t0 = time.perf_counter()
    tps = run(gen, "many")
    wall = time.perf_counter() - t0
    # every call of the turn (its prefill rows too: keys with M > 8), per decoded token
    per = {k: [v / gen * 1e3, calls[k] / gen] for k, v in times.items()}
    gbps = copy_rate() / 1e9  # read + write
    return {
        "threads": threads,
        "kernels": cbuild.variant(),
        "layers": "torch loop" if torch_loop else "C (cpu_decoder)",
        "decode_tok_s": tps,
        "step_ms": wall / gen * 1e3,  # the turn's wall time per token, prefill included
        "parts_ms": per,
        # the decode rows' matrices (M=1), as often as a token calls them
        "weight_mb_per_token": sum(b * calls[k] / gen for k, b in wbytes.items() if " M=1 " in f" {k} ")
        / 1e6,
        "copy_gbps": gbps,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2", help="counts to profile; 0: the thread governor picks")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--torch-loop", action="store_true", help="the layers as torch ops (cpu_decoder off)")
    ap.add_argument("--child", type=int, default=None)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child, a.gen, a.torch_loop)))
        return
    print(f"load average before: {os.getloadavg()}")
    from report import cpu_name

    cpu = cpu_name()  # the model and its vector extensions
    for t in (int(s) for s in a.threads.split(",")):
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(t), "--gen", str(a.gen)]
            + ["--torch-loop"] * a.torch_loop,
            capture_output=True,
            text=True,
            env=os.environ,
        )
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        floor = r["weight_mb_per_token"] / 1e3 / (r["copy_gbps"] / 2) * 1e3  # reads at half the copy rate
        print(
            f"\n{cpu} | kernels {r['kernels']}, layers {r['layers']} | {t} thread(s): {r['decode_tok_s']:.1f} tok/s, "
            f"step {r['step_ms']:.2f} ms; weights {r['weight_mb_per_token']:.1f} MB/token, "
            f"copy {r['copy_gbps']:.1f} GB/s -> floor ~{floor:.2f} ms"
        )
        kern = 0.0
        for k, v in sorted(r["parts_ms"].items(), key=lambda kv: -kv[1][0]):
            kern += v[0]
            print(f"  {k:32s} {v[0]:7.3f} ms  {v[1]:5.1f} calls/token")
        print(f"  {'rest (norms, rope, glue, sampling)':32s} {r['step_ms'] - kern:7.3f} ms")


if __name__ == "__main__":
    main()

"""The CPU decode step's layers in one C call (``cpu_decoder``) against the torch loop, in one process.

Greedy turns of the default model (packed weights, speculation off: one row a step), the two
paths alternated turn by turn (``cpu_decoder.set_enabled``), one process per thread count; per
turn the decode tok/s (wall) and the process's CPU time per decoded token (all its threads; the
neighbours' load disturbs wall-clock figures, less the CPU time), and whether both paths chose the
same tokens. Batch 8 against batch 1: ``bench/decode.py --device cpu``.

    TURNKV_CPU_ISA=avx2 python bench/cpu_decoder_ab.py --threads 1,2 --repeat 5

Prints medians and the ratio per thread count, with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(threads: int, gen: int, repeat: int) -> dict:
    from turnkv.threads import prepare_env

    prepare_env()
    from turnkv import cbuild
    from turnkv.config import EngineConfig
    from turnkv.engine.sampling import SamplingParams
    from turnkv.engine.turn import GenEvent, TurnRequest
    from turnkv.models import cpu_decoder
    from turnkv.runtime import build, load_engine
    from turnkv.threads import set_threads

    set_threads(threads)
    cfg = EngineConfig(device="cpu", weights="packed", threads=threads, speculate="off")
    eng = load_engine(cfg, progress=False)
    rt = build(cfg, "bench", engine=eng)
    bank = rt.new_bank("1G")
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])

    def turn(ns: str) -> tuple[float, float, list[int]]:
        req = TurnRequest(list(ids), SamplingParams(ignore_eos=True), max_tokens=gen, namespace=ns)
        c0 = time.process_time()
        events = list(rt.run_turn(req, bank))
        cpu = (time.process_time() - c0) / gen * 1e3
        stats = [e.stats for e in events if isinstance(e, GenEvent) and e.stats][-1]
        toks = [e.token_id for e in events if isinstance(e, GenEvent) and e.token_id is not None]
        return stats.decode_tok_s, cpu, toks

    out: dict = {"c": [], "torch": []}
    same = True
    for side in ("c", "torch"):  # warm both
        cpu_decoder.set_enabled(side == "c")
        turn(f"warm-{side}")
    for i in range(repeat):
        toks = {}
        for side in ("c", "torch") if i % 2 == 0 else ("torch", "c"):
            cpu_decoder.set_enabled(side == "c")
            tps, cpu, toks[side] = turn(f"{side}-{i}")
            out[side].append((tps, cpu))
        same = same and toks["c"] == toks["torch"]
    return {"threads": threads, "kernels": cbuild.variant(), "same_tokens": same, **out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--child", type=int, default=None)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child, a.gen, a.repeat)))
        return
    from report import cpu_name

    print(f"{cpu_name()}; load average before: {os.getloadavg()}")
    for t in (int(s) for s in a.threads.split(",")):
        cmd = [sys.executable, __file__, "--child", str(t), "--gen", str(a.gen), "--repeat", str(a.repeat)]
        run = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if run.returncode:
            sys.exit(run.stderr[-3000:])
        r = json.loads(run.stdout.strip().splitlines()[-1])
        med = {s: [statistics.median(v[i] for v in r[s]) for i in (0, 1)] for s in ("c", "torch")}
        print(
            f"{t} thread(s), kernels {r['kernels']}: decode tok/s C layers {med['c'][0]:.1f} / torch loop "
            f"{med['torch'][0]:.1f} ({med['c'][0] / med['torch'][0]:.2f}x); CPU ms/token {med['c'][1]:.2f} / "
            f"{med['torch'][1]:.2f} ({med['torch'][1] / med['c'][1]:.2f}x); same tokens: {r['same_tokens']}; "
            f"per turn {json.dumps({s: [[round(x, 2) for x in v] for v in r[s]] for s in ('c', 'torch')})}"
        )
        print(f"  load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

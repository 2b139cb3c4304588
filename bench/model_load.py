"""Model load time, cold (empty turnkv cache) and warm (header, tokenizer and packed weights
cached), and the build time of random-weight shapes; each measurement in a fresh process so
nothing is shared.

    python bench/model_load.py [--spec default] [--device auto] [--dtype auto] [--repeat 3]
                               [--shapes llama3-8b,qwen3-8b]

Prints one line per measurement and a JSON summary last. Cold runs use a fresh
``TURNKV_CACHE_DIR``; warm runs reuse the one the cold run filled. The first process also pays
for the file entering the page cache, which later ones do not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from turnkv.models.load import build_random_model, load_model
t1 = time.perf_counter()
spec, device, dtype = sys.argv[1:4]
if spec.startswith("random:"):
    lm = build_random_model(spec.split(":", 1)[1], device, dtype)
else:
    lm = load_model(spec, device, dtype, progress=False)
if lm.device.type == "cuda":
    torch.cuda.synchronize()
t2 = time.perf_counter()
params = sum(p.numel() for p in lm.model.parameters())
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "params": params, "name": lm.name,
                  "device": str(lm.device), "dtype": str(lm.dtype)}))
"""


def measure(spec: str, device: str, dtype: str, cache: str) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TURNKV_CACHE_DIR=cache, PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, spec, device, dtype],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shapes", default="", help="comma-separated random shapes to time as well")
    args = ap.parse_args()
    summary: dict = {"spec": args.spec}
    if args.spec:
        cold, warm = [], []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as cache:
                cold.append(measure(args.spec, args.device, args.dtype, cache))
                warm.append(measure(args.spec, args.device, args.dtype, cache))
                print(
                    f"cold {cold[-1]['load_s']:.2f} s  warm {warm[-1]['load_s']:.2f} s  ({cold[-1]['device']})"
                )
        summary.update(
            device=cold[0]["device"],
            dtype=cold[0]["dtype"],
            import_s=statistics.median(r["import_s"] for r in warm),
            cold_load_s=statistics.median(r["load_s"] for r in cold),
            warm_load_s=statistics.median(r["load_s"] for r in warm),
        )
    for shape in filter(None, args.shapes.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            r = measure(f"random:{shape}", args.device, args.dtype, cache)
        print(f"random:{shape} {r['params'] / 1e9:.2f}B params built in {r['load_s']:.2f} s on {r['device']}")
        summary[f"random:{shape}_s"] = r["load_s"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Wall time of one CLI command from a cold and from a warm turnkv cache, each run a fresh process.

    python bench/startup.py [--runs 5] [--root PATH] [-- generate --prompt Hi --max-tokens 16]

Cold runs get an empty ``TURNKV_CACHE_DIR`` and ``XDG_CACHE_HOME`` (header, tokenizer, packed
weights and the C kernels' builds all made again); warm runs reuse one that a first run filled.
``--root`` runs another checkout's ``turnkv`` (e.g. ``git archive <commit> | tar -x -C DIR``) to
compare. Prints each run with the 1-minute load average (the machine may be shared), then a JSON
summary: min and median per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["generate", "--prompt", "Hi", "--max-tokens", "16"]


def run_once(root: Path, cache: str, command: list[str]) -> float:
    env = dict(os.environ, TURNKV_CACHE_DIR=cache, XDG_CACHE_HOME=cache, PYTHONPATH=str(root))
    t0 = time.perf_counter()
    # cwd: ``-m`` puts it first on sys.path, so it decides which checkout's turnkv runs
    out = subprocess.run([sys.executable, "-m", "turnkv", *command], env=env, cwd=root, capture_output=True)
    if out.returncode:
        raise SystemExit(
            f"turnkv {' '.join(command)} exited {out.returncode}:\n{out.stderr.decode()[-3000:]}"
        )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose turnkv runs")
    ap.add_argument("command", nargs="*", default=COMMAND, help="the turnkv command (after --)")
    args = ap.parse_args()
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as warm_cache:
        run_once(args.root, warm_cache, args.command)  # fills the warm cache
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as cold_cache:
                for case, cache in (("cold", cold_cache), ("warm", warm_cache)):
                    times[case].append(run_once(args.root, cache, args.command))
                    print(f"{case} {times[case][-1]:.2f} s  (load average {os.getloadavg()[0]:.2f})")
    summary = {"root": str(args.root), "command": args.command, "cpus": os.cpu_count()}
    for case, ts in times.items():
        summary[case] = {"min_s": round(min(ts), 2), "median_s": round(statistics.median(ts), 2)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

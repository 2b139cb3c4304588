"""Wall time of one CLI command from a cold and from a warm cache, each run a fresh process.

    python bench/startup.py [--runs 5] [--root PATH ...] [--no-cold] [-- generate --prompt Hi ...]

Cold runs get an empty ``TURNKV_CACHE_DIR`` and ``XDG_CACHE_HOME`` (GGUF header, tokenizer,
packed weights and the C kernels' builds all made again); warm runs reuse one that a first run
filled. Each ``--root`` is a checkout whose ``turnkv`` runs (default: this one; another commit:
``git archive <commit> | tar -x -C DIR``); with several, their runs alternate, so they share the
machine's conditions. Prints each run with its user+system CPU time and the 1-minute load average
(the machine may be shared), then a JSON summary: min and median per checkout and case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["generate", "--prompt", "Hi", "--max-tokens", "16"]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(root: Path, cache: str, command: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``python -m turnkv <command>`` in a fresh process."""
    env = dict(os.environ, TURNKV_CACHE_DIR=cache, XDG_CACHE_HOME=cache, PYTHONPATH=str(root))
    cpu0, t0 = _children_cpu(), time.perf_counter()
    # cwd: ``-m`` puts it first on sys.path, so it decides which checkout's turnkv runs
    out = subprocess.run([sys.executable, "-m", "turnkv", *command], env=env, cwd=root, capture_output=True)
    if out.returncode:
        raise SystemExit(
            f"turnkv {' '.join(command)} exited {out.returncode}:\n{out.stderr.decode()[-3000:]}"
        )
    return time.perf_counter() - t0, _children_cpu() - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--root", type=Path, action="append", help="a checkout whose turnkv runs (repeatable)")
    ap.add_argument("--no-cold", dest="cold", action="store_false", help="warm runs only")
    ap.add_argument("command", nargs="*", default=COMMAND, help="the turnkv command (after --)")
    args = ap.parse_args()
    roots = args.root or [ROOT]
    cases = ("cold", "warm") if args.cold else ("warm",)
    times = {(r, c): [] for r in roots for c in cases}
    with tempfile.TemporaryDirectory() as base:
        warm = {r: tempfile.mkdtemp(dir=base) for r in roots}
        for r in roots:
            run_once(r, warm[r], args.command)  # fills its warm cache
        for _ in range(args.runs):
            for r in roots:
                for case in cases:
                    with tempfile.TemporaryDirectory(dir=base) as cold:
                        wall, cpu = run_once(r, cold if case == "cold" else warm[r], args.command)
                    times[r, case].append(wall)
                    load = os.getloadavg()[0]
                    print(f"{r} {case} {wall:.2f} s wall, {cpu:.2f} s CPU  (load average {load:.2f})")
    summary = {"command": args.command, "cpus": os.cpu_count(), "results": []}
    for (r, case), ts in times.items():
        stats = {"min_s": round(min(ts), 2), "median_s": round(statistics.median(ts), 2)}
        summary["results"].append({"root": str(r), "case": case, **stats})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""What the bench scripts do with their results: stamp them, write JSON, draw a PNG."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "out"


def git_commit() -> str:
    """The tree's commit; ``TURNKV_COMMIT`` where the tree has no git state of its own (the lent GPU
    machine gets a copy of the working tree, and its ``.git`` does not name the tree it runs)."""
    if os.environ.get("TURNKV_COMMIT"):
        return os.environ["TURNKV_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"  # e.g. a copy of the tree without .git (the lent GPU machine)


VECTOR_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_int8",
)


def cpu_name() -> str:
    """This CPU's model and vector extensions, for every table: ``AMD EPYC (avx2 fma ... avx512_vnni)``."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == (platform.processor() or platform.machine()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = [f for f in VECTOR_FLAGS if f in value.split()]
    except OSError:
        pass
    return f"{model} ({' '.join(flags) or 'no x86 vector flags'})"


def save(results: dict, tag: str, plot: Callable[[dict, object, Path], None]) -> None:
    """Stamp ``results`` (date, machine, commit, torch), write ``OUT/<tag>.json`` and, where matplotlib
    imports, ``OUT/<tag>.png`` drawn by ``plot(results, pyplot, path)``."""
    results.update(
        date=time.strftime("%Y-%m-%d"),
        machine=platform.node(),
        cpu=cpu_name(),
        commit=git_commit(),
        torch=torch.__version__,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{tag}.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {OUT / f'{tag}.json'} (matplotlib missing: no plot)")
        return
    plot(results, plt, OUT / f"{tag}.png")
    print(f"wrote {OUT / f'{tag}.json'} and .png")

"""What the bench scripts do with their results: stamp them, write JSON, draw a PNG."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "out"


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"  # e.g. a copy of the tree without .git (the lent GPU machine)


def save(results: dict, tag: str, plot: Callable[[dict, object, Path], None]) -> None:
    """Stamp ``results`` (date, machine, commit, torch), write ``OUT/<tag>.json`` and, where matplotlib
    imports, ``OUT/<tag>.png`` drawn by ``plot(results, pyplot, path)``."""
    results.update(
        date=time.strftime("%Y-%m-%d"), machine=platform.node(), commit=git_commit(), torch=torch.__version__
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

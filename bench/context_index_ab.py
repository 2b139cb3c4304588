"""The draft index (``engine/context_copy.ContextIndex``) of another commit against this tree's, in
one process: its build over a prompt (at a turn's first draft, on the engine thread) and a decode
step's ``push`` + ``draft``, alternated base / tree, min and median of the repeats.

    python bench/context_index_ab.py --base main --tokens 1000,12000,65536

The prompt is random ids over the default model's vocabulary with a repeated quarter, so chains
and matches exist. Both sides must draft the same tokens (checked). Prints a table, writes
``bench/out/<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from report import cpu_name, save

from turnkv.engine.context_copy import ContextIndex

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152


def base_class(rev: str, into: Path):
    """``ContextIndex`` as it was at ``rev`` (its module loaded beside this tree's)."""
    src = subprocess.check_output(["git", "show", f"{rev}:turnkv/engine/context_copy.py"], cwd=ROOT)
    path = into / "context_copy_base.py"
    path.write_bytes(src)
    spec = importlib.util.spec_from_file_location("context_copy_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ContextIndex


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    ids = [rng.randrange(VOCAB) for _ in range(n - n // 4)]
    start = rng.randrange(max(1, len(ids) - n // 4))
    return ids + ids[start : start + n // 4]  # a quoted quarter: what context copy drafts from


def steps(cls, ids: list[int], answer: list[int]) -> list:
    index = cls(ids)
    out = []
    for t in answer:
        index.push(t)
        out.append(index.draft(31))
    return out


def measure(cls, ids: list[int], answer: list[int]) -> tuple[float, float]:
    """(s to build ``cls`` over ``ids``, s per push + draft of each token of ``answer``)."""
    t0 = time.perf_counter()
    index = cls(ids)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    for x in answer:
        index.push(x)
        index.draft(31)
    return build, (time.perf_counter() - t0) / len(answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main")
    ap.add_argument("--tokens", default="1000,12000,65536")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--steps", type=int, default=256, help="push + draft per measurement")
    ap.add_argument("--tag", default="context_index_ab")
    args = ap.parse_args()
    base = base_class(args.base, Path(tempfile.mkdtemp()))
    commit = subprocess.check_output(["git", "rev-parse", "--short", args.base], cwd=ROOT, text=True).strip()
    print(f"# CPU {cpu_name()}, ContextIndex of {args.base} ({commit}) vs tree")
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        ids = prompt(n, n)
        answer = ids[n // 2 : n // 2 + args.steps]  # an answer that quotes the prompt: drafts match
        assert steps(base, ids, answer) == steps(ContextIndex, ids, answer), (
            "the two indexes draft differently"
        )
        b, t, bs, ts = [], [], [], []
        for _ in range(args.repeat):  # alternated: a shared machine's load falls on both alike
            for builds, per_step, cls in ((b, bs, base), (t, ts, ContextIndex)):
                build, step = measure(cls, ids, answer)
                builds.append(build)
                per_step.append(step)
        row = {"tokens": n,
               "build_ms": {"base_min": min(b) * 1e3, "base_median": statistics.median(b) * 1e3,
                            "tree_min": min(t) * 1e3, "tree_median": statistics.median(t) * 1e3},
               "step_us": {"base_median": statistics.median(bs) * 1e6, "tree_median": statistics.median(ts) * 1e6}}  # fmt: skip
        row["build_ratio"] = row["build_ms"]["base_median"] / row["build_ms"]["tree_median"]
        rows.append(row)
        bm, sm = row["build_ms"], row["step_us"]
        print(
            f"{n:>7} tokens  build base {bm['base_min']:7.3f} / {bm['base_median']:7.3f} ms | tree "
            f"{bm['tree_min']:7.3f} / {bm['tree_median']:7.3f} ms | {row['build_ratio']:.2f}x   push+draft "
            f"{sm['base_median']:.2f} -> {sm['tree_median']:.2f} us"
        )

    def plot(res, plt, path):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [r["tokens"] for r in res["rows"]]
        ax.plot(xs, [r["build_ms"]["base_median"] for r in res["rows"]], "o-", label=f"base {res['base']}")
        ax.plot(xs, [r["build_ms"]["tree_median"] for r in res["rows"]], "o-", label="tree")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="prompt tokens",
            ylabel="build ms (median)",
            title="ContextIndex build",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)

    save({"base": args.base, "base_commit": commit, "rows": rows}, args.tag, plot)


if __name__ == "__main__":
    main()

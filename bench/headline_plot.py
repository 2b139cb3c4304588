"""The headline results at the top of docs/BENCHMARKS.md: one table and one plot, both drawn from
``docs/bench/headline.json``, so that the two cannot disagree.

    python bench/headline_plot.py            # writes docs/bench/headline.png, prints the table

The figures themselves are copied by hand from the log below the table (the newest measurement of
each kind, as written there); ``tests/test_docs.py`` checks that the table in the file is this
script's rendering of the JSON and that every figure in it appears elsewhere in the file.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JSON_PATH = ROOT / "docs" / "bench" / "headline.json"
PNG_PATH = ROOT / "docs" / "bench" / "headline.png"
HEADER = ("result", "turnkv", "against", "machine", "date", "in the log")
KINDS = ("roof", "ratio")


@dataclass(frozen=True)
class Bar:
    """One bar of the plot: a figure (or the ends of a range) exactly as the log writes it."""

    label: str
    kind: str  # "roof": % of the hardware roof; "ratio": x the row's baseline
    values: tuple[str, ...]

    @property
    def low(self) -> float:
        return float(self.values[0])

    @property
    def high(self) -> float:
        return float(self.values[-1])

    @property
    def text(self) -> str:
        unit = " %" if self.kind == "roof" else "x"
        return "-".join(self.values) + unit


@dataclass(frozen=True)
class Row:
    """One row of the table: what was measured, its figure, its baseline and where the log has it."""

    result: str
    turnkv: str
    against: str
    machine: str
    date: str
    section: str  # a heading of docs/BENCHMARKS.md, as written
    where: str  # which paragraph of that section, or ""
    bars: tuple[Bar, ...]


def load(path: Path = JSON_PATH) -> list[Row]:
    rows = []
    for raw in json.loads(path.read_text())["rows"]:
        bars = tuple(Bar(b["label"], b["kind"], tuple(b["values"])) for b in raw["bars"])
        if any(b.kind not in KINDS or len(b.values) not in (1, 2) for b in bars):
            raise ValueError(f"bad bar in {raw['result']!r}: {raw['bars']}")
        rows.append(Row(**{**raw, "bars": bars}))
    return rows


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link(row: Row) -> str:
    short = re.sub(r"\s*\(issues? [\d, ]+\)$", "", row.section)
    cell = f"[{short}](#{anchor(row.section)})"
    return f"{cell}, {row.where}" if row.where else cell


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.result} | {r.turnkv} | {r.against} | {r.machine} | {r.date} | {link(r)} |")
    return "\n".join(lines)


def _panel(ax, bars: list[Bar], roof: bool) -> None:
    """Horizontal bars, the first on top; a range is solid up to its end nearer the baseline and pale
    beyond it, so the bar never claims more than the least of the runs."""
    ys = list(range(len(bars)))[::-1]
    base = 0.0 if roof else 1.0  # ratios grow out of "as fast as the baseline" on a log axis
    for y, bar in zip(ys, bars, strict=True):
        slower = not roof and bar.high < 1
        near, far = (bar.high, bar.low) if slower else (bar.low, bar.high)
        color = "#c8553d" if slower else "#2a7fb8"
        ax.barh(y, near - base, left=base, color=color, height=0.62)
        if far != near:
            ax.barh(y, far - near, left=near, color=color, alpha=0.35, height=0.62)
        if roof:  # inside the bar's end, clear of the roof's line
            ax.text(near - 1.2, y, bar.text, va="center", ha="right", fontsize=10, color="white")
        else:
            x = far / 1.07 if slower else far * 1.07
            ax.text(x, y, bar.text, va="center", ha="right" if slower else "left", fontsize=10)
    ax.set_yticks(ys, [b.label for b in bars], fontsize=10)
    ax.axvline(100.0 if roof else 1.0, color="#444", linewidth=1, linestyle="--")
    ax.grid(axis="x", color="#ddd", linewidth=0.6)
    ax.set_axisbelow(True)
    if roof:
        ax.set_xlim(0, 112)
        ax.set_xlabel("% of the hardware roof (one H200, Llama-3-8B shape; dashed: the roof)")
    else:
        ax.set_xscale("log")
        ax.set_xlim(0.15, 250)
        ax.set_xticks(
            [0.25, 0.5, 1, 2, 5, 10, 20, 50, 100],
            ["0.25x", "0.5x", "1x", "2x", "5x", "10x", "20x", "50x", "100x"],
        )
        ax.set_xlabel("x the row's baseline, log scale (dashed: as fast as the baseline; red: slower)")


def plot(rows: list[Row], path: Path = PNG_PATH) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof = [b for r in rows for b in r.bars if b.kind == "roof"]
    ratio = [b for r in rows for b in r.bars if b.kind == "ratio"]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 9), gridspec_kw={"height_ratios": [len(roof) + 1.5, len(ratio) + 1.5]}
    )
    _panel(top, roof, roof=True)
    _panel(bottom, ratio, roof=False)
    top.set_title("turnkv: headline results (docs/BENCHMARKS.md)", fontsize=13, loc="left")
    fig.text(
        0.01,
        0.008,
        "H200: Llama-3-8B shape, random weights (speculation: the default model).\n"
        "CPU: the 2-core AMD EPYC VM (AVX-512), the default model; AVX2 only: issue 28's report, another VM.",
        fontsize=9,
        color="#444",
    )
    fig.tight_layout(rect=(0, 0.045, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=JSON_PATH)
    ap.add_argument("--png", type=Path, default=PNG_PATH)
    args = ap.parse_args()
    rows = load(args.json)
    plot(rows, args.png)
    print(table(rows))
    print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()

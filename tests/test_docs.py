"""The docs stand on their own (issue 7, item 12): every file the README, the docs and the code
name is in the repository, and the package metadata builds without deprecation warnings."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = sorted((ROOT / "turnkv").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def test_every_markdown_link_and_doc_name_resolves_inside_the_repository():
    missing = []
    for md in TEXTS:
        text = md.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in target and not (md.parent / target).exists():
                missing.append(f"{md.name}: {target}")
        for name in re.findall(r"`?((?:docs/)?[A-Z][A-Z_]+\.md)`?", text):
            if not ((md.parent / name).exists() or (ROOT / name).exists() or (ROOT / "docs" / name).exists()):
                missing.append(f"{md.name}: {name}")
    for src in SOURCES:
        for name in re.findall(r"\b((?:docs/)?[A-Z][A-Z_]+\.md)\b", src.read_text()):
            if not ((ROOT / name).exists() or (ROOT / "docs" / name).exists()):
                missing.append(f"{src.relative_to(ROOT)}: {name}")
    assert not missing, missing
    assert (ROOT / "docs" / "DESIGN.md").is_file()


def test_nothing_points_outside_the_repository():
    for path in [*TEXTS, *SOURCES]:
        assert "/work/" not in path.read_text(), path


def test_the_license_is_an_spdx_string():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # a TOML table is deprecated by setuptools
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in meta["build-system"]["requires"])


def _headline_plot():
    spec = importlib.util.spec_from_file_location("headline_plot", ROOT / "bench" / "headline_plot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _anchors(text: str, anchor) -> set[str]:
    """The anchors GitHub gives the file's headings (outside code blocks; a repeated one gets -1, -2...)."""
    anchors: set[str] = set()
    count: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            base = anchor(m.group(1))
            n = count.get(base, 0)
            anchors.add(f"{base}-{n}" if n else base)
            count[base] = n + 1
    return anchors


def _headline_table(text: str) -> str:
    """The first table under "## Headline results": its lines from the first '|' to the next other."""
    section = text.split("\n## Headline results\n", 1)[1].split("\n## ", 1)[0]
    table = re.search(r"^\|.*(?:\n\|.*)*", section, re.MULTILINE)
    assert table, "no table under ## Headline results"
    return table.group(0)


def test_headings_get_github_anchors():
    anchor = _headline_plot().anchor
    assert anchor("CPU: packed quantized weights against llama.cpp (issue 11)") == (
        "cpu-packed-quantized-weights-against-llamacpp-issue-11"
    )
    assert (
        anchor("CPU decode attention in C (issues 8, 9, 11, 12)")
        == "cpu-decode-attention-in-c-issues-8-9-11-12"
    )
    assert anchor("Multi-turn follow-ups (issue 2)") == "multi-turn-follow-ups-issue-2"


def test_every_link_in_the_benchmarks_headline_table_resolves_to_a_heading_in_the_file():
    text = BENCHMARKS.read_text()
    anchors = _anchors(text, _headline_plot().anchor)
    rows = _headline_table(text).splitlines()[2:]
    assert len(rows) >= 10, "docs/BENCHMARKS.md opens with a table of headline results"
    for row in rows:
        links = re.findall(r"\]\(#([^)]+)\)", row)
        assert links and all(link in anchors for link in links), row
    dangling = [link for link in re.findall(r"\]\(#([^)]+)\)", text) if link not in anchors]
    assert not dangling, dangling


def test_the_benchmarks_headline_table_is_drawn_from_its_json_and_quotes_only_figures_of_the_file():
    plot = _headline_plot()
    rows = plot.load()
    text = BENCHMARKS.read_text()
    table = _headline_table(text)
    assert table == plot.table(rows), "re-run python bench/headline_plot.py and paste its table"
    rest = text.replace(table, "")
    for row in rows:
        cells = f"{row.turnkv} {row.against}"
        for number in NUMBER.findall(cells):
            assert re.search(rf"(?<![\d.]){re.escape(number)}(?!\d|\.\d)", rest), (number, row.result)
        for bar in row.bars:  # the plot shows a figure of its row, not one derived from it
            assert all(re.search(rf"(?<![\d.]){re.escape(v)}(?!\d|\.\d)", cells) for v in bar.values), bar
    assert (ROOT / "docs" / "bench" / "headline.png").is_file()

"""The docs stand on their own (issue 7, item 12): every file the README, the docs and the code
name is in the repository, and the package metadata builds without deprecation warnings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = sorted((ROOT / "turnkv").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))


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

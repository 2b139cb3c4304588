"""The package's import graph, as the architecture promises it (docs/ARCHITECTURE.md, "Layers").

Every ``import`` in ``turnkv/`` counts, those inside functions too (a lazy import still runs);
only ``if TYPE_CHECKING:`` blocks do not. Run as a script to print the graph's cycles and every
import that goes against the layers:

    python tests/test_import_graph.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "turnkv"

# bottom to top; a module may import its own layer and the layers below it
LAYERS = [
    ("turnkv.limits", "turnkv.threads", "turnkv.cbuild", "turnkv.kernels", "turnkv.tokenizer"),
    ("turnkv.config", "turnkv.kv", "turnkv.attention", "turnkv.models", "turnkv.bank", "turnkv.chat_format"),
    ("turnkv.engine",),
    ("turnkv.parallel", "turnkv.runtime"),
    (
        "turnkv.server",
        "turnkv.chat",
        "turnkv.cache_cli",
        "turnkv.serve_times",
        "turnkv.serve_router",
        "turnkv.serve_ray",
        "turnkv.cli",
        "turnkv.__main__",
    ),
]


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The turnkv modules ``name`` imports at run time."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
    # ``from turnkv import x`` names the (empty) root package too: not a dependency
    return {m for m in out if m in known and m not in (name, "turnkv")}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(g)))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer(name: str) -> int:
    """The layer of ``name``: its longest matching prefix."""
    best, at = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, at = len(p), i
    assert at >= 0, f"{name} is in no layer: add it to LAYERS"
    return at


def upward(g: dict[str, set[str]]) -> list[str]:
    """Imports of a module from a higher layer; and ``engine`` reaching a sibling of its own."""
    bad = [f"{a} -> {b}" for a in sorted(g) for b in sorted(g[a]) if layer(b) > layer(a)]
    bad += [
        f"{a} -> {b}"
        for a in sorted(g)
        if a.startswith("turnkv.engine")
        for b in sorted(g[a])
        if b.startswith("turnkv.chat_format")  # the engine sees grammars through engine.masks' Protocols
    ]
    return bad


def test_no_import_cycle_at_run_time():
    assert cycles(graph()) == []


def test_every_import_goes_down_the_layers():
    assert upward(graph()) == []


def test_the_checker_sees_a_cycle_and_an_upward_import():
    g = {"turnkv.kv.a": {"turnkv.engine.b"}, "turnkv.engine.b": {"turnkv.kv.a"}}
    assert cycles(g) == [["turnkv.engine.b", "turnkv.kv.a"]]
    assert upward(g) == ["turnkv.kv.a -> turnkv.engine.b"]


if __name__ == "__main__":
    g = graph()
    found = cycles(g)
    print("cycles:", *([" <-> ".join(c) for c in found] or ["none"]), sep="\n  ")
    bad = upward(g)
    print("imports against the layers:", *(bad or ["none"]), sep="\n  ")
    sys.exit(1 if found or bad else 0)

"""Checks of a JSON schema before llguidance compiles it: schemas the library accepts and then fails
on in the middle of a turn (a 500 at the first token, an empty answer, a lexer that runs out, masks
that stall every step: docs/BENCHMARKS.md "Structured output"). Each problem is a ``SchemaProblem``
naming where it is in the schema (a JSON pointer: ``#/properties/a``).

- ``x-guidance`` at the root: llguidance's own options (layout, ``lenient``). They would override
  the canonical layout (``grammar.CANONICAL``) that lets an answer re-render into its cached
  tokens, or silently ignore keywords it does not implement; no JSON Schema client needs it.
- nesting deeper than ``DEPTH_MAX`` schema levels.
- a subschema whose every value is infinite: it requires itself through ``$ref`` with no way out
  (``{"$ref": "#"}``, a cycle of definitions, a required property or ``minItems`` that recurses).
  Its grammar only grows: an empty answer, or "Too many items" once the model enters it. Decided
  as the least fixpoint of "has a finite value" (the grammar's meaning), in linear time.
- a ``pattern`` whose counted repetitions multiply out past ``PATTERN_MAX`` characters; a
  ``const`` or ``enum`` value, or a property name, longer than ``LITERAL_MAX`` (forced text that
  llguidance re-tokenizes at every step).

``check`` returns the subschemas where many alternatives open at once (``PROBE_ALTERNATIVES``):
``grammar_probe`` compiles those alone and lets llguidance say whether their first rows fit.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from turnkv.chat_format.pattern_size import pattern_size

DEPTH_MAX = 64  # schema levels (llguidance's own JSON parser stops at 128 JSON levels)
PATTERN_MAX = 512  # characters a pattern's counted repetitions multiply out to
LITERAL_MAX = 4096  # characters of one const / enum value (as JSON) or property name
PROBE_ALTERNATIVES = 64  # a subschema opening this many alternatives is probed alone
PROBES_MAX = 8  # the largest of them

_ONE = ("items", "additionalItems", "contains", "additionalProperties", "propertyNames", "not", "if")
_ONE += ("then", "else", "unevaluatedItems", "unevaluatedProperties")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_DEFS = ("$defs/", "definitions/")
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class SchemaProblem(ValueError):
    """A schema refused before compiling; the message starts with where (a JSON pointer)."""


@dataclass
class _Node:
    schema: Any  # a dict or a bool
    where: str  # JSON pointer from the root
    kids: dict[str, _Node] = field(default_factory=dict)  # by pointer step: "properties/a", "anyOf/0"


def check(root: Any) -> list[tuple[str, dict]]:
    """Raise ``SchemaProblem`` for the first problem of ``root``; else the ``(where, schema)`` of
    the subschemas to probe alone (none when their ``$ref`` would not resolve on their own)."""
    if isinstance(root, dict) and "x-guidance" in root:
        raise SchemaProblem(
            "#: x-guidance (the grammar library's own options) is not accepted: the server writes JSON "
            "in one canonical layout and enforces every keyword it accepts"
        )
    nodes = _tree(root)
    for node in nodes:
        if isinstance(node.schema, dict):
            _check_texts(node)
    _check_finite(root, nodes)
    return _probes(root, nodes)


def _children(schema: dict) -> Iterator[tuple[str, Any]]:
    """(pointer step, subschema) of every keyword that holds subschemas."""
    for key in _ONE:
        if isinstance(schema.get(key), (dict, bool)):
            yield key, schema[key]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if isinstance(sub, (dict, bool)):
                    yield f"{key}/{_escape(name)}", sub
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if isinstance(sub, (dict, bool)):
                    yield f"{key}/{i}", sub


def _short(where: str) -> str:
    """A pointer for a message: a long one keeps its start and its end."""
    return where if len(where) <= 120 else f"{where[:50]}/.../{where[-60:]}"


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _tree(root: Any) -> list[_Node]:
    """Every subschema, parents before children (a loop, not recursion: depth is checked here)."""
    top = _Node(root, "#")
    nodes, stack = [top], [(top, 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node.schema, dict):
            continue
        if depth >= DEPTH_MAX:
            raise SchemaProblem(f"{_short(node.where)}: the schema nests deeper than {DEPTH_MAX} levels")
        for step, sub in _children(node.schema):
            child = node.kids[step] = _Node(sub, f"{node.where}/{step}")
            nodes.append(child)
            stack.append((child, depth + 1))
    return nodes


def _check_texts(node: _Node) -> None:
    s, where = node.schema, _short(node.where)
    patterns = [s["pattern"]] if isinstance(s.get("pattern"), str) else []
    if isinstance(s.get("patternProperties"), dict):
        patterns += list(s["patternProperties"])
    for p in patterns:
        size = pattern_size(p)
        if size > PATTERN_MAX:
            raise SchemaProblem(
                f"{where}: pattern {p[:60]!r} repeats up to {size} characters (its counted repetitions "
                f"multiplied out); at most {PATTERN_MAX}: bound a long string with maxLength instead"
            )
    values = [s["const"]] if "const" in s else []
    values += s["enum"] if isinstance(s.get("enum"), list) else []
    names = list(s["properties"]) if isinstance(s.get("properties"), dict) else []
    names += (
        [r for r in s.get("required", ()) if isinstance(r, str)]
        if isinstance(s.get("required"), list)
        else []
    )
    for text in [*(json.dumps(v) for v in values), *names]:
        if len(text) > LITERAL_MAX:
            raise SchemaProblem(
                f"{where}: a const, enum value or property name longer than {LITERAL_MAX} characters"
            )


def _resolve(root: Any, ref: str, by_id: dict[int, _Node]) -> _Node | None:
    """The node a local ``#...`` pointer names (None: not local, or not found: llguidance says)."""
    if not ref.startswith("#"):
        return None
    at: Any = root
    for part in ref[2:].split("/") if ref not in ("#", "#/") else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(at, dict) and part in at:
            at = at[part]
        elif isinstance(at, list) and part.isdigit() and int(part) < len(at):
            at = at[int(part)]
        else:
            return None
    return by_id.get(id(at))


class _Circuit:
    """A monotone and/or circuit; ``solve`` gives which gates are true (Horn propagation)."""

    def __init__(self) -> None:
        self.kind: list[str] = ["and"]
        self.inputs: list[list[int]] = [[]]
        self.true_gate, self.false_gate = 0, self.gate("or", [])

    def gate(self, kind: str, inputs: list[int]) -> int:
        if len(inputs) == 1:
            return inputs[0]
        self.kind.append(kind)
        self.inputs.append(inputs)
        return len(self.kind) - 1

    def solve(self, wires: dict[int, int]) -> list[bool]:
        """``wires``: the input of each ``$ref`` gate (its target's gate), given last."""
        inputs = [[*ins, wires[g]] if g in wires else ins for g, ins in enumerate(self.inputs)]
        users: list[list[int]] = [[] for _ in inputs]
        need = [len(ins) if kind == "and" else 1 for kind, ins in zip(self.kind, inputs, strict=True)]
        for g, ins in enumerate(inputs):
            for i in ins:
                users[i].append(g)
        true = [False] * len(inputs)
        queue = deque(g for g, n in enumerate(need) if n == 0)
        while queue:
            g = queue.popleft()
            if not true[g]:
                true[g] = True
                for u in users[g]:
                    need[u] -= 1
                    if need[u] == 0:
                        queue.append(u)
        return true


class _Finite:
    """A gate per node, true iff the node admits a finite value; each ``$ref`` a gate whose input,
    its target, is wired in ``solve`` (so recursion can be assumed to end, or not)."""

    def __init__(self, nodes: list[_Node]) -> None:
        self.c = _Circuit()
        self.gates: dict[int, int] = {}
        self.refs: dict[int, str] = {}  # ref gate -> the $ref
        for node in reversed(nodes):  # children first
            self.gates[id(node)] = self._node(node)

    def _node(self, node: _Node) -> int:
        s, c = node.schema, self.c
        if not isinstance(s, dict):
            return c.false_gate if s is False else c.true_gate
        if "const" in s or isinstance(s.get("enum"), list):
            return c.true_gate  # a value from the list: finite (or unsatisfiable: llguidance says)
        sub = {step: self.gates[id(kid)] for step, kid in node.kids.items()}
        parts = [self._typed(s, sub)] + [g for step, g in sub.items() if step.startswith("allOf/")]
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                parts.append(c.gate("or", [g for step, g in sub.items() if step.startswith(key + "/")]))
        if isinstance(s.get("$ref"), str):
            c.kind.append("and")
            c.inputs.append([])
            self.refs[len(c.kind) - 1] = s["$ref"]
            parts.append(len(c.kind) - 1)
        return c.gate("and", parts)

    def _typed(self, s: dict, sub: dict[str, int]) -> int:
        """Some type the node allows has a finite value."""
        types = s.get("type", list(_TYPES))
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else list(_TYPES)
        options = []
        for t in types:
            if t == "object":
                options.append(self._object(s, sub))
            elif t == "array":
                options.append(self._array(s, sub))
            else:
                options.append(self.c.true_gate)
        return self.c.gate("or", options)

    def _object(self, s: dict, sub: dict[str, int]) -> int:
        c = self.c
        props = s["properties"] if isinstance(s.get("properties"), dict) else {}
        patterns = s["patternProperties"] if isinstance(s.get("patternProperties"), dict) else {}
        extra = sub.get(
            "additionalProperties", c.false_gate if s.get("additionalProperties") is False else c.true_gate
        )
        required = s["required"] if isinstance(s.get("required"), list) else []
        names = list(dict.fromkeys(r for r in required if isinstance(r, str)))
        need = []
        for name in names:
            if name in props:
                need.append(sub.get(f"properties/{_escape(name)}", c.true_gate))
                continue
            matched = [
                sub.get(f"patternProperties/{_escape(p)}", c.true_gate) for p in patterns if _matches(p, name)
            ]
            need += matched or [extra]
        least = s.get("minProperties")
        if isinstance(least, int) and least > len(names):
            sources = [g for step, g in sub.items() if step.startswith(("properties/", "patternProperties/"))]
            need.append(c.gate("or", [*sources, extra]))
        return c.gate("and", need)

    def _array(self, s: dict, sub: dict[str, int]) -> int:
        c = self.c
        least = s.get("minItems") if isinstance(s.get("minItems"), int) else 0
        tuple_key = "prefixItems" if isinstance(s.get("prefixItems"), list) else "items"
        prefix = s[tuple_key] if isinstance(s.get(tuple_key), list) else []
        rest_key = "additionalItems" if tuple_key == "items" and prefix else "items"
        need = [sub.get(f"{tuple_key}/{i}", c.true_gate) for i in range(min(least, len(prefix)))]
        if least > len(prefix):
            need.append(sub.get(rest_key, c.false_gate if s.get(rest_key) is False else c.true_gate))
        if "contains" in s and s.get("minContains", 1) != 0:
            need.append(sub.get("contains", c.true_gate))
        return c.gate("and", need)


def _matches(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except (re.error, RecursionError, OverflowError):
        return True  # a pattern Python cannot read: assume it applies (llguidance reads it)


def _check_finite(root: Any, nodes: list[_Node]) -> None:
    """Refuse the first subschema (breadth first from the root, definitions where a ``$ref`` uses
    them) whose values are all infinite because of recursion (were recursion assumed to end, it
    would have one)."""
    by_id = {id(n.schema): n for n in reversed(nodes) if isinstance(n.schema, dict)}
    f = _Finite(nodes)
    targets = {g: _resolve(root, ref, by_id) for g, ref in f.refs.items()}
    least = f.c.solve({g: f.gates[id(t)] if t else f.c.true_gate for g, t in targets.items()})
    ending = f.c.solve(dict.fromkeys(targets, f.c.true_gate))
    seen, queue = set(), deque([nodes[0]])
    while queue:
        node = queue.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        gate = f.gates[id(node)]
        if ending[gate] and not least[gate]:
            raise SchemaProblem(
                f"{_short(node.where)}: every value it admits is infinite: it requires itself through $ref with "
                "no way out (a $ref to itself or a cycle of them, a required property or minItems that recurses)"
            )
        # definitions count where a $ref uses them; no value of a "not" is ever written
        queue.extend(kid for step, kid in node.kids.items() if step != "not" and not step.startswith(_DEFS))
        if isinstance(node.schema, dict) and isinstance(node.schema.get("$ref"), str):
            target = _resolve(root, node.schema["$ref"], by_id)
            queue.extend([target] if target else [])


def _alternatives(s: Any, kids: dict[str, int]) -> int:
    """About how many alternatives open where a value of ``s`` starts (llguidance's parser keeps
    them all in one row: nested unions add up, every property of an object may come next)."""
    if not isinstance(s, dict):
        return 1
    union = sum(n for step, n in kids.items() if step.startswith(("anyOf/", "oneOf/")))
    containers = sum(isinstance(v, (list, dict)) for v in s["enum"]) if isinstance(s.get("enum"), list) else 0
    props = len(s["properties"]) if isinstance(s.get("properties"), dict) else 0
    return max(union, containers, props + len(s.get("patternProperties") or ()), 1)


def _probes(root: Any, nodes: list[_Node]) -> list[tuple[str, dict]]:
    """The largest subschemas (not the root: the whole grammar is probed) of many alternatives,
    each with the root's definitions, when every ``$ref`` points into those definitions."""
    alts: dict[int, int] = {}
    for node in reversed(nodes):
        alts[id(node)] = _alternatives(node.schema, {s: alts[id(k)] for s, k in node.kids.items()})
    big = [n for n in nodes[1:] if alts[id(n)] >= PROBE_ALTERNATIVES and isinstance(n.schema, dict)]
    if not big or not isinstance(root, dict):
        return []
    local = ("#/$defs/", "#/definitions/")
    for n in nodes[1:]:
        if isinstance(n.schema, dict):
            ref = n.schema.get("$ref")
            if (
                (isinstance(ref, str) and not ref.startswith(local))
                or "$id" in n.schema
                or "$anchor" in n.schema
            ):
                return []
    defs = {k: root[k] for k in ("$defs", "definitions") if isinstance(root.get(k), dict)}
    big.sort(key=lambda n: -alts[id(n)])
    return [(n.where, _alone(n.schema, defs)) for n in big[:PROBES_MAX]]


def _alone(schema: dict, defs: dict[str, dict]) -> dict:
    """``schema`` with the root's definitions beside its own (its ``$ref`` resolve as in the root)."""
    own = {k: schema[k] for k in defs if isinstance(schema.get(k), dict)}
    return {**schema, **{k: {**v, **own.get(k, {})} for k, v in defs.items()}}

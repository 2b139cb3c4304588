"""How long a regex ``pattern`` can make a string, with its counted repetitions multiplied out: a
bound on what llguidance's lexer builds for it (``schema_check`` refuses large ones). Read from
the pattern's text (escapes, classes, groups, quantifiers) rather than parsed: it serves Rust and
ECMAScript syntax alike, and a pattern neither reads still gets a size."""

from __future__ import annotations

import re

_QUANT = re.compile(r"\{(\d+)(,(\d*))?\}")
_CAP = 10**12  # sizes saturate here (a pattern's {n} may be any integer)


def pattern_size(pattern: str) -> int:
    """The characters ``pattern`` repeats up to: a sequence and the branches of an alternation add
    up, ``x{m,n}`` is ``n`` times ``x`` (``{m}`` and ``{m,}``: ``m``; ``*``, ``+``, ``?``: once)."""
    stack = [[0, 0]]  # per open group: [its size so far, the size of its last atom]
    i, n = 0, len(pattern)
    while i < n:
        c, atom = pattern[i], 1
        if c == "\\":
            i += 2
            if pattern[i - 1 : i] in ("p", "P", "x", "u") and pattern[i : i + 1] == "{":
                i = pattern.find("}", i) + 1 or n
        elif c == "[":
            i = _class_end(pattern, i)
        elif c == "(":
            stack.append([0, 0])
            i += 1
            continue
        elif c == ")" and len(stack) > 1:
            atom = stack.pop()[0]
            i += 1
        elif c == "{" and (m := _QUANT.match(pattern, i)):
            times = min(int(m[1]) if m[2] is None or not m[3] else int(m[3]), _CAP)
            times = max(times, 1) if m[2] is not None and not m[3] else times
            top = stack[-1]
            top[0] = min(top[0] + top[1] * (times - 1), _CAP)
            top[1] = min(top[1] * times, _CAP)
            i = m.end()
            continue
        elif c in "*+?|^$":
            if c == "|":
                stack[-1][1] = 0
            i += 1
            continue
        else:
            i += 1
        top = stack[-1]
        top[0], top[1] = min(top[0] + atom, _CAP), atom
    return min(sum(size for size, _ in stack), _CAP)


def _class_end(p: str, i: int) -> int:
    """The index after the character class opening at ``p[i]`` (nested classes included)."""
    j = i + 1
    j += p[j : j + 1] == "^"
    j += p[j : j + 1] == "]"
    depth = 1
    while j < len(p):
        if p[j] == "\\":
            j += 2
            continue
        depth += (p[j] == "[") - (p[j] == "]")
        j += 1
        if depth == 0:
            return j
    return len(p)

"""A radix tree over token ids: the longest prefix any stored sequence shares with a query.

One ``TokenIndex`` per cache namespace. Edges hold runs of tokens; every node knows the entries
that reach it (``through``) and those that end on it (``ends``), so a lookup walks the query once
and returns the match length and every entry sharing it, at token granularity (a match may end
in the middle of an edge). Insert and remove are O(length of the sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

from turnkv.kv.cache import common_prefix_len


class _Node:
    """A radix-tree node; ``edge`` is the token run leading into it from its parent."""

    __slots__ = ("children", "edge", "ends", "through")

    def __init__(self, edge: tuple[int, ...]) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.through: set[int] = set()  # entries whose tokens reach this node (pass or end)
        self.ends: set[int] = set()  # entries whose tokens end exactly here


class TokenIndex:
    """Radix tree over token ids of one namespace: longest-prefix lookup at token granularity."""

    def __init__(self) -> None:
        self.root = _Node(())

    def insert(self, tokens: Sequence[int], eid: int) -> None:
        node, i = self.root, 0
        node.through.add(eid)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tuple(tokens[i:]))
                leaf.through.add(eid)
                leaf.ends.add(eid)
                node.children[tokens[i]] = leaf
                return
            k = common_prefix_len(child.edge, tokens, i)
            if k < len(child.edge):  # split the edge so the entry can branch or end at k
                mid = _Node(child.edge[:k])
                mid.through = set(child.through)
                child.edge = child.edge[k:]
                mid.children[child.edge[0]] = child
                node.children[tokens[i]] = mid
                child = mid
            child.through.add(eid)
            node, i = child, i + k
        node.ends.add(eid)

    def longest(self, tokens: Sequence[int]) -> tuple[int, set[int]]:
        """(n, entries): ``tokens[:n]`` is the longest prefix any entry shares; those entries share it."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = common_prefix_len(child.edge, tokens, i)
            i += k
            if k < len(child.edge):
                return i, child.through
            node = child
        return i, (node.through if i else set())

    def prefixes_of(self, tokens: Sequence[int]) -> set[int]:
        """Entries whose whole token sequence is a prefix of ``tokens`` (including equal)."""
        out: set[int] = set()
        node, i = self.root, 0
        while True:
            out |= node.ends
            if i >= len(tokens):
                return out
            child = node.children.get(tokens[i])
            if child is None or common_prefix_len(child.edge, tokens, i) < len(child.edge):
                return out
            node, i = child, i + len(child.edge)

    def remove(self, tokens: Sequence[int], eid: int) -> None:
        path = [self.root]
        node, i = self.root, 0
        while i < len(tokens):
            node = node.children[tokens[i]]
            path.append(node)
            i += len(node.edge)
        for n in path:
            n.through.discard(eid)
        path[-1].ends.discard(eid)
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:]), strict=True):
            if child.through:
                break
            del parent.children[child.edge[0]]

    @property
    def empty(self) -> bool:
        return not self.root.through

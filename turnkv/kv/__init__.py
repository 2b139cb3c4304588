"""KV layouts: ``segmented`` (per-turn segments + a tail) and ``contiguous`` (the A/B baseline)."""

from __future__ import annotations

from turnkv.kv.cache import KVCache, KVShape, KVWindow, Layout, Snapshot, Views, kv_dtype
from turnkv.kv.contiguous import ContiguousKV, ContiguousLayout
from turnkv.kv.segments import (
    MAX_SEGMENTS,
    ConversationKV,
    MergePolicy,
    Segment,
    SegmentedLayout,
    SegmentedSnapshot,
    SegmentRef,
    SegmentStats,
    unique_bytes,
)

LAYOUTS = {"segmented": SegmentedLayout, "contiguous": ContiguousLayout}


def make_layout(name: str, shape: KVShape) -> SegmentedLayout | ContiguousLayout:
    """The layout called ``name`` (``segmented`` or ``contiguous``) for caches of ``shape``."""
    try:
        return LAYOUTS[name](shape)
    except KeyError:
        raise ValueError(f"unknown kv layout {name!r}; expected one of {sorted(LAYOUTS)}") from None


__all__ = [
    "LAYOUTS",
    "MAX_SEGMENTS",
    "ContiguousKV",
    "ContiguousLayout",
    "ConversationKV",
    "KVCache",
    "KVShape",
    "KVWindow",
    "Layout",
    "MergePolicy",
    "Segment",
    "SegmentRef",
    "SegmentStats",
    "SegmentedLayout",
    "SegmentedSnapshot",
    "Snapshot",
    "Views",
    "kv_dtype",
    "make_layout",
    "unique_bytes",
]

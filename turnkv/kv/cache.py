"""The contract every KV layout honours, so the model and the engine never know which one they hold.

A cache holds the K and V rows of every layer of one conversation, plus the token id of each row.
One forward pass over a *window* of ``m`` query rows goes:

    cache.reserve(m)                    # room for rows [n, n+m), n = cache.num_tokens
    for layer in layers:
        cache.write(layer, k, v)        # k, v: [Hkv, m, D] -> rows [n, n+m) of this layer
        views = cache.views(layer)      # [(k_i, v_i)], each [Hkv, T_i, D]; sum(T_i) == n + m
        ...attention of the window over views (causal only inside the window)...
    cache.commit(tokens)                # len(tokens) <= m; rows past n+len(tokens) are dropped

Invariants (pinned by tests):
- ``views`` returns zero-copy views, in row order; the last view ends with the window's rows.
- ``snapshot()`` is immutable: nothing done to the cache afterwards changes what it holds.
- ``trim(n)`` keeps the first ``n`` rows (rollback); it never copies rows.
- ``seal()`` ends a turn. For the segmented layout it freezes the tail into a segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class KVShape:
    """Geometry of one conversation's KV rows; one row is one token across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_row(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@runtime_checkable
class Snapshot(Protocol):
    """An immutable picture of a cache: token ids plus the rows behind them."""

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def num_tokens(self) -> int: ...

    def prefix(self, n: int) -> Snapshot:
        """The first ``n`` rows, as another snapshot (zero-copy for the segmented layout)."""
        ...


@runtime_checkable
class KVCache(Protocol):
    shape: KVShape

    @property
    def num_tokens(self) -> int: ...

    @property
    def tokens(self) -> list[int]: ...

    def plan(self, rows: int) -> None:
        """Hint: about ``rows`` more rows will come this turn; pre-size so growth does not copy."""
        ...

    def reserve(self, m: int) -> None: ...

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def views(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def commit(self, tokens: Sequence[int]) -> None: ...

    def trim(self, n: int) -> None: ...

    def seal(self) -> None: ...

    def snapshot(self) -> Snapshot: ...


class Layout(Protocol):
    """Makes caches of one layout: ``segmented`` or ``contiguous``."""

    name: str
    shape: KVShape

    def new(self) -> KVCache: ...

    def restore(self, snapshot: Snapshot) -> KVCache:
        """A live cache continuing from ``snapshot`` (a copy for the contiguous layout)."""
        ...

    def counters(self) -> dict[str, int]:
        """``seals``, ``merges``, ``max_segments`` of this layout's caches, for ``/health``."""
        ...


def common_prefix_len(a: Sequence[int], b: Sequence[int], start_b: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b[start_b:]``."""
    n = min(len(a), len(b) - start_b)
    i = 0
    while i < n and a[i] == b[start_b + i]:
        i += 1
    return i


def check_window_rows(shape: KVShape, m: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise unless a window is open (``m > 0``) and ``k``, ``v`` are its rows: ``[Hkv, m, D]``."""
    if m == 0:
        raise RuntimeError("write() without an open window (call reserve first)")
    want = (shape.num_kv_heads, m, shape.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"write expects k, v of {list(want)}; got {list(k.shape)}, {list(v.shape)}")

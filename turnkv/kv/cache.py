"""The contract every KV layout honours, so the model and the engine never know which one they hold.

A cache holds the K and V rows of every layer of one conversation, plus the token id of each row.
One forward step over a *window* of ``m`` query rows goes:

    win = cache.open_window(m)          # room for rows [n, n+m), n = cache.num_tokens
    ...the step's attention backend writes each layer's k, v into rows [n, n+m) of the window's
    last view (``win.write`` on any device, a store kernel on CUDA) and attends over
    ``win.views`` (causal only inside the window)...
    cache.commit(tokens)                # len(tokens) <= m; rows past n+len(tokens) are dropped

The window is built once per step for all layers: ``win.views`` are ``[L, Hkv, T_i, D]`` views of
every layer at once, so a backend reads layer ``l`` at a fixed stride from the same pointers.

Invariants (pinned by tests):
- ``views`` are zero-copy, in row order; the last one is the only writable buffer and ends with
  the window's rows; nothing but the open window's rows is ever written.
- ``snapshot()`` is immutable: nothing done to the cache afterwards changes what it holds.
- ``trim(n)`` keeps the first ``n`` rows (rollback); it never copies rows.
- ``seal()`` ends a turn. For the segmented layout it freezes the tail into a segment.
"""

from __future__ import annotations

import functools
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
        # dtype.itemsize, not ``torch.empty((), dtype).element_size()``: the bank and the caches
        # ask for this hundreds of times a step
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def kv_dtype(choice: str, compute: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype KV rows are stored in, for ``--kv-dtype choice`` and the model's compute dtype.

    ``auto`` is the compute dtype, except bfloat16 where a CPU computes in float32: decode reads
    every KV row once per token (at long contexts more bytes than the packed weights), so bf16
    halves what a token reads and the bank holds twice the rows. K and V are computed in fp32,
    rounded once when stored and read back as fp32, so a row's bits are the same whichever step
    reads it (cached == uncached still holds). float16 rows read slower than fp32 on a CPU
    (torch's upcast from float16), so auto does not take them (docs/BENCHMARKS.md, issue 11).

    Only a CPU may store another dtype than it computes in: the CUDA kernels read K/V in q's dtype.
    """
    if choice != "auto":
        want = getattr(torch, choice)
    elif device.type == "cpu" and compute == torch.float32:
        want = torch.bfloat16
    else:
        want = compute
    if want != compute and device.type != "cpu":
        c = str(compute).removeprefix("torch.")
        raise ValueError(
            f"--kv-dtype {choice} differs from the compute dtype {c} on {device}: only a CPU stores KV "
            f"in another dtype; use --kv-dtype auto (or --dtype {choice})"
        )
    return want


Views = list[tuple[torch.Tensor, torch.Tensor]]  # [(k, v)] of one layer, each [Hkv, T_i, D]


@dataclass(frozen=True)
class KVWindow:
    """An open window of rows ``[start, start + rows)`` of one cache, described for all layers.

    ``views``: ``(k, v)`` pairs, each ``[L, Hkv, T_i, D]``, zero-copy, in row order, covering rows
    ``[0, start + rows)``; the last pair is the cache's writable buffer and its last ``rows`` rows
    are the window. Valid until the cache is committed, trimmed or sealed.
    """

    views: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    start: int
    rows: int

    def layer_views(self, layer: int) -> Views:
        """``[(k, v)]`` of one layer, each ``[Hkv, T_i, D]`` (views, no copy)."""
        return [(k[layer], v[layer]) for k, v in self.views]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's window rows; ``k``, ``v``: ``[Hkv, rows, D]`` (any strides)."""
        tk, tv = self._rows
        if k.shape != tk.shape[1:] or v.shape != tk.shape[1:]:
            want = list(tk.shape[1:])
            raise ValueError(f"write expects k, v of {want}; got {list(k.shape)}, {list(v.shape)}")
        tk[layer].copy_(k)
        tv[layer].copy_(v)

    @functools.cached_property
    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's rows of every layer ``[L, Hkv, rows, D]`` in the last view, sliced once per
        step: a write then indexes one layer instead of slicing twice a layer."""
        tk, tv = self.views[-1]
        t = tk.shape[2]
        return tk[:, :, t - self.rows :], tv[:, :, t - self.rows :]


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

    def presize(self, rows: int) -> None:
        """Hint: about ``rows`` more rows will come this turn; pre-size so growth does not copy."""
        ...

    def open_window(self, m: int) -> KVWindow:
        """Reserve rows ``[n, n + m)`` (``m >= 1``) and describe them with every view (see ``KVWindow``)."""
        ...

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The committed rows' ``[L, Hkv, T_i, D]`` views in row order (for readers; no window)."""
        ...

    def commit(self, tokens: Sequence[int]) -> None: ...

    def trim(self, n: int) -> None: ...

    def seal(self) -> None: ...

    def share_prefix(self) -> None:
        """The rows held now are shared by other live caches (forks): merges must not copy them."""
        ...

    def snapshot(self) -> Snapshot: ...


class Layout(Protocol):
    """Makes caches of one layout: ``segmented`` or ``contiguous``."""

    name: str
    shape: KVShape
    copies_on_restore: bool  # a restore copies the snapshot's rows (admission prices them)

    def new(self) -> KVCache: ...

    def restore(self, snapshot: Snapshot) -> KVCache:
        """A live cache continuing from ``snapshot`` (a copy for the contiguous layout)."""
        ...

    def counters(self) -> dict[str, int]:
        """``seals``, ``merges``, ``max_segments`` of this layout's caches, for ``/health``."""
        ...


def common_prefix_len(a: Sequence[int], b: Sequence[int], start_b: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b[start_b:]``.

    Compares runs of ``_RUN`` tokens as slices (C speed) and walks only the run that differs: it
    runs over the whole history at every banked turn.
    """
    n = min(len(a), len(b) - start_b)
    i = 0
    same_type = type(a) is type(b)
    while i + _RUN <= n:
        run_a, run_b = a[i : i + _RUN], b[start_b + i : start_b + i + _RUN]
        if run_a != (run_b if same_type else type(run_a)(run_b)):
            break
        i += _RUN
    while i < n and a[i] == b[start_b + i]:
        i += 1
    return i


_RUN = 256

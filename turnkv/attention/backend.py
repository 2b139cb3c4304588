"""Attention backends: a *plan* built once per step, then a *run* per layer (store, attend).

The model never sees caches. Each step the engine opens one ``KVWindow`` per conversation and hands
the list to ``backend.plan(windows)``; the returned ``StepAttention`` is what every layer calls:

    att = backend.plan(windows)           # once per step: host work, one upload at most
    for layer in layers:
        q = att.rope_store(layer, qk, v, cos, sin)  # RoPE on q and k; k, v -> each window's rows
        o = att.attend(layer, q, scale)   # q [N, Hq, D] -> [N, Hq, D], window-causal per sequence

Rows are flat: window ``b`` owns rows ``[q_start_b, q_start_b + rows_b)`` of ``N``, in the order
of ``windows``. ``att.routes`` holds the route each window takes (``routes.Route``), chosen once
in ``plan``; its label (``fused_q1``, ``lse_prefill``...) is what a turn counts.

Everything the engine and the CUDA graphs need to know of a backend is asked of it here (as
mini-sglang's ``attention/base.py`` does): whether verify windows run as one-row windows, how
many rows a verify window may have, the attention's transient memory, and a decode step's launch
(``DecodeLaunch``), which a graph is keyed and planned by.

Invariants: nothing a layer calls touches the host beyond launching work (the fused backend's
plan is one table upload for all layers); a backend never reads or writes a row outside the
windows it was planned for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from turnkv.attention.routes import Route
from turnkv.attention.verdict import Verdict
from turnkv.kv.cache import KVWindow


class StepAttention(Protocol):
    """One step's attention, planned for its windows; called once per layer."""

    routes: list[Route]  # per window, in the order planned

    def rope_store(
        self, layer: int, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """RoPE on ``qk`` ``[N, Hq + Hkv, D]`` (q heads, then k heads; any row stride) at the rows'
        ``cos``, signed ``sin`` ``[N, D]``; stores k and ``v`` ``[N, Hkv, D]`` into every window of
        ``layer``; returns q ``[N, Hq, D]`` after RoPE."""
        ...

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new rows ``k``, ``v`` ``[N, Hkv, D]`` into every window of ``layer``."""
        ...

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[N, Hq, D]`` over each window's views of ``layer`` -> ``[N, Hq, D]`` in q's dtype."""
        ...


class DecodeLaunch(NamedTuple):
    """A decode step's attention launch: what a CUDA graph of the step bakes in. An eager step of
    the same windows launches the same, so a replay equals it bit for bit."""

    batch: int  # sequences the table is padded to: the graph's batch (segment_table.padded_batch)
    keys: int  # the key bucket the split count is chosen for (segment_table.key_bucket)
    splits: int  # flash-decoding splits, sized by the step's conversations (fused.conversations)


class TableLaunch(NamedTuple):
    """One table of a step captured with prompt rows (``MixedLaunch``): what its launches bake in."""

    batch: int  # sequences the table is padded to (segment_table.padded_batch)
    rows: int  # the grid's M: 1 or MAX_WINDOW_ROWS (narrow), the step's row bucket (wide)
    config: object  # triton_segments.LaunchConfig: tiles and splits (by the key bucket)


class MixedLaunch(NamedTuple):
    """The attention launch of a step with prompt rows, captured whole in a CUDA graph: the narrow
    table (decode and verify rows, short chunks) and the wide one (prefill chunks), either None
    when the step has no such window. An eager run of the same staged step launches the same."""

    narrow: TableLaunch | None
    wide: TableLaunch | None

    @property
    def batch(self) -> int:
        """Sequences of both tables (``graph_table``'s size, the padded logit rows)."""
        return sum(t.batch for t in self if t is not None)


class AttentionBackend(Protocol):
    """Chosen once at load (``selfcheck.make_backend``); ``verdict`` is what ``/health`` reports."""

    name: str
    verdict: Verdict
    cuts_verify_windows: bool  # verify windows run as one-row windows (``step.one_row_windows``)
    captures_graphs: bool  # decode steps may replay CUDA graphs (``engine.graphs``)

    def plan(
        self,
        windows: Sequence[KVWindow],
        launch: DecodeLaunch | MixedLaunch | None = None,
        out: torch.Tensor | None = None,
    ) -> StepAttention:
        """The step's attention for ``windows``; for a graph, with ``decode_launch``'s (or
        ``mixed_launch``'s) ``launch`` into the static table ``out`` (``graph_table``)."""
        ...

    def verify_rows(self, start: int) -> int:
        """The most rows a verify window whose first row is cache row ``start`` may have."""
        ...

    def scratch_bytes(self, heads: int, head_dim: int, rows: int, history: int) -> int:
        """Transient attention memory of a window of ``rows`` rows over ``history`` cached rows."""
        ...

    def decode_launch(self, windows: Sequence[KVWindow]) -> DecodeLaunch | None:
        """The launch of a decode step over one-row ``windows``; None: the step is not graphable."""
        ...

    def mixed_launch(self, windows: Sequence[KVWindow]) -> MixedLaunch | None:
        """The launch of a step with prompt rows over ``windows``; None: not graphable."""
        ...

    def graph_table(self, batch: int) -> torch.Tensor:
        """A static table buffer for the plans of a graph of ``batch`` sequences."""
        ...


def row_starts(windows: Sequence[KVWindow]) -> list[int]:
    """The first flat row of each window (windows back to back)."""
    out, n = [], 0
    for w in windows:
        out.append(n)
        n += w.rows
    return out

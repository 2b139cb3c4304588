"""The fused backend: one segment table per step for all layers, Triton store and attention kernels.

``plan`` packs every window's views (``segment_table.pack``) and uploads them in one copy; each
layer then launches ``store_kv`` and ``segment_attention`` at its layer index. A step that mixes
narrow windows (decode, verify: <= 32 rows) with wide ones (prefill chunks) gets two tables in the
same upload and two attention launches, so a one-row window keeps its flash-decoding split
instead of riding in a prefill launch's row blocks.

For a CUDA graph the plan is built into a static buffer (``out``) with padding sequences up to the
captured batch (``pad_to``) and a split count fixed by the graph (``max_keys``), so a replay
needs only the one upload; see ``turnkv.engine.graphs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turnkv.attention.backend import row_starts
from turnkv.attention.route import Verdict, window_label
from turnkv.attention.segment_table import TableMeta, pack, upload
from turnkv.kv.cache import KVWindow
from turnkv.limits import MAX_WINDOW_ROWS


@dataclass
class Launch:
    """One table inside the step's upload, and the tiles its attention launch uses."""

    offset: int  # first word of this table in the packed buffer
    meta: TableMeta
    config: object  # triton_segments.LaunchConfig


class FusedStep:
    """The fused kernels over one step's packed tables (see the module docstring)."""

    def __init__(self, packed: torch.Tensor, launches: list[Launch], labels: list[str]) -> None:
        from turnkv.attention import triton_segments, triton_store

        self._ts = triton_segments
        self._store = triton_store
        self.packed = packed
        self.launches = launches
        self.labels = labels
        self._tables = [packed[lc.offset : lc.offset + lc.meta.words] for lc in launches]

    def rope_store(self, layer, qk, v, cos, sin) -> torch.Tensor:
        n, heads, d = qk.shape
        q = torch.empty(n, heads - v.shape[1], d, device=qk.device, dtype=qk.dtype)
        for table, lc in zip(self._tables, self.launches, strict=True):
            self._store.rope_store(qk, v, cos, sin, table, lc.meta, layer, q)
        return q

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for table, lc in zip(self._tables, self.launches, strict=True):
            self._store.store_kv(k, v, table, lc.meta, layer)

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        out = None
        for table, lc in zip(self._tables, self.launches, strict=True):
            out = self._ts.segment_attention(q, table, lc.meta, layer, scale, lc.config, out=out)
        assert out is not None
        return out


def conversations(windows: Sequence[KVWindow]) -> int:
    """How many conversations ``windows`` belong to (their tails' buffers). A decode launch sizes
    its split count by this, not by its windows: a verify window that the engine runs as one-row
    windows (``step.one_row_windows``) then splits each row's keys as that row decoded alone
    would, so it comes out bit for bit the same."""
    return len({w.views[-1][0].data_ptr() for w in windows})


class FusedBackend:
    """The ``fused`` route (verdict ``ok`` only: the load-time self-check ran these kernels)."""

    name = "fused"

    def __init__(
        self,
        verdict: Verdict,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int = 128,
        device: torch.device | str = "cuda",
    ) -> None:
        self.verdict = verdict
        self.gqa = num_heads // num_kv_heads
        self.kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)

    def decode_splits(self, conversations: int, max_keys: int) -> int:
        """The split count of a decode launch of one-row windows of ``conversations``
        conversations over ``max_keys`` keys (what a CUDA graph of that step bakes in)."""
        from turnkv.attention import triton_segments as ts
        from turnkv.attention.segment_table import TableMeta

        meta = TableMeta(conversations, 1, max_keys, 1, self.kv_heads, self.head_dim, torch.bfloat16)
        return ts.pick_config(meta, self.gqa, self.device, max_keys).splits

    def plan(
        self,
        windows: Sequence[KVWindow],
        out: torch.Tensor | None = None,
        pad_to: int | None = None,
        max_keys: int | None = None,
    ) -> FusedStep:
        """Pack and upload the step's tables (into ``out`` for a graph; see the module docstring)."""
        from turnkv.attention import triton_segments as ts

        starts = row_starts(windows)
        narrow = [i for i, w in enumerate(windows) if w.rows <= MAX_WINDOW_ROWS]
        wide = [i for i, w in enumerate(windows) if w.rows > MAX_WINDOW_ROWS]
        words: list[int] = []
        launches = []
        for group in (narrow, wide):
            if not group:
                continue
            part, meta = pack(
                [windows[i].views for i in group],
                [windows[i].rows for i in group],
                q_starts=[starts[i] for i in group],
                pad_to=pad_to,
            )
            device = windows[group[0]].views[0][0].device
            convs = conversations([windows[i] for i in group])
            config = ts.pick_config(meta, self.gqa, device, max_keys, conversations=convs)
            launches.append(Launch(len(words), meta, config))
            words += part
        device = windows[0].views[0][0].device
        packed = upload(words, device, out)
        labels = [window_label("fused", w.rows) for w in windows]
        return FusedStep(packed, launches, labels)

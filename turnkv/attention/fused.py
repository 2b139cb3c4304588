"""The fused backend: one segment table per step for all layers, Triton store and attention kernels.

``plan`` packs every window's views (``segment_table.pack``) and uploads them in one copy; each
layer then launches ``store_kv`` and ``segment_attention`` at its layer index. A step that mixes
narrow windows (decode, verify: <= 32 rows) with wide ones (prefill chunks) gets two tables in the
same upload and two attention launches, so a one-row window keeps its flash-decoding split
instead of riding in a prefill launch's row blocks.

For a CUDA graph the plan is built into a static buffer (``out``, ``graph_table``) by the step's
``DecodeLaunch`` (``decode_launch``: padding sequences up to the captured batch, the split count
of its key bucket), so a replay needs only the one upload; see ``turnkv.engine.graphs``. A step
with prompt rows is captured whole the same way by its ``MixedLaunch`` (``mixed_launch``): per
table, its batch padded to a class (``segment_table.MIXED_BATCHES``), grid rows (1 or 32 narrow,
the step's row bucket wide), the tiles those give and a grid with room for the most splits any
context could ask (``table_launch``); the step's own
split count (by the key bucket of its longest context and its conversations) is written into
the table, where the kernels read it, so one graph serves every context. The same key bucket
bounds a verify window (``verify_rows``), whose rows must split as they would decoded alone: the
split-count invariant lives here and in ``triton_segments.decode_splits``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from turnkv.attention.backend import DecodeLaunch, MixedLaunch, TableLaunch, row_starts
from turnkv.attention.routes import Path, Route, narrow
from turnkv.attention.segment_table import (
    FIELDS,
    TableMeta,
    key_bucket,
    mixed_batch,
    mixed_fewest,
    pack,
    padded_batch,
    row_bucket,
    upload,
)
from turnkv.attention.verdict import Verdict
from turnkv.kv.cache import KVWindow
from turnkv.limits import MAX_SEGMENTS, MAX_WINDOW_ROWS

# the context a mixed table's room for splits is sized at: past every key bucket, so no bucket's
# split count (``pick_config``: at most 4 key tiles a split) is capped by it
SPLIT_ROOM_KEYS = 1 << 40


@dataclass
class Launch:
    """One table inside the step's upload, and the tiles its attention launch uses."""

    offset: int  # first word of this table in the packed buffer
    meta: TableMeta
    config: object  # triton_segments.LaunchConfig


class FusedStep:
    """The fused kernels over one step's packed tables (see the module docstring)."""

    def __init__(self, packed: torch.Tensor, launches: list[Launch], routes: list[Route]) -> None:
        from turnkv.attention import triton_segments, triton_store

        self._ts = triton_segments
        self._store = triton_store
        self.packed = packed
        self.launches = launches
        self.routes = routes
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
    cuts_verify_windows = True  # so that a decode graph replays them and each row splits as alone
    captures_graphs = True

    def __init__(
        self,
        verdict: Verdict,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int = 128,
        device: torch.device | str = "cuda",
        deterministic: bool = False,
    ) -> None:
        self.verdict = verdict
        self.fixed = deterministic  # fixed tiles and key pieces (triton_segments.fixed_config)
        self.gqa = num_heads // num_kv_heads
        self.kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)

    def plan(
        self,
        windows: Sequence[KVWindow],
        launch: DecodeLaunch | MixedLaunch | None = None,
        out: torch.Tensor | None = None,
    ) -> FusedStep:
        """Pack and upload the step's tables (into ``out`` by ``launch`` for a graph; see the
        module docstring)."""
        from turnkv.attention import triton_segments as ts

        starts = row_starts(windows)
        routes = [
            Route(Path.FUSED_NARROW if narrow(w.rows) else Path.FUSED_WIDE, "fused", w.rows) for w in windows
        ]
        mixed = launch if isinstance(launch, MixedLaunch) else None
        pad_to, max_keys = (None, None) if launch is None or mixed else (launch.batch, launch.keys)
        words: list[int] = []
        launches = []
        for t, path in enumerate((Path.FUSED_NARROW, Path.FUSED_WIDE)):
            group = [i for i, r in enumerate(routes) if r.path is path]
            if not group:
                continue
            if mixed is not None:  # what the graph bakes in: its batch, rows and tiles; the
                table = mixed[t]  # split count of this step's keys rides in the table
                kvs = [windows[i] for i in group]
                part, meta = pack(
                    [w.views for w in kvs],
                    [w.rows for w in kvs],
                    q_starts=[starts[i] for i in group],
                    pad_to=table.batch,
                    splits=self.table_splits(kvs, table),
                )
                launches.append(Launch(len(words), replace(meta, max_q=table.rows), table.config))
                words += part
                continue
            part, meta = pack(
                [windows[i].views for i in group],
                [windows[i].rows for i in group],
                q_starts=[starts[i] for i in group],
                pad_to=pad_to,
            )
            device = windows[group[0]].views[0][0].device
            convs = conversations([windows[i] for i in group])
            config = ts.pick_config(meta, self.gqa, device, max_keys, conversations=convs, fixed=self.fixed)
            if launch is not None:  # the splits the graph is keyed by (the same, by decode_splits)
                config = config._replace(splits=launch.splits)
            launches.append(Launch(len(words), meta, config))
            words += part
        device = windows[0].views[0][0].device
        packed = upload(words, device, out)
        return FusedStep(packed, launches, routes)

    def verify_rows(self, start: int) -> int:
        """Never past the key bucket of the window's first row: its rows run as one-row windows
        whose attention must split as their decode rows' would (``Engine.stage``), and a decode
        step is planned with the split count of its bucket (``decode_launch``)."""
        return max(1, min(MAX_WINDOW_ROWS, key_bucket(start + 1) - start))

    def scratch_bytes(self, heads: int, head_dim: int, rows: int, history: int) -> int:
        # the kernels keep scores in registers (flash) and need only their fp32 split partials
        return heads * rows * (head_dim + 1) * 4 * 2  # a few partials per row

    def decode_launch(self, windows: Sequence[KVWindow]) -> DecodeLaunch | None:
        """``DecodeLaunch`` of one-row ``windows`` (None past ``MAX_SEGMENTS`` views: two segment
        groups, which a graph's table has no room for)."""
        from turnkv.attention import triton_segments as ts

        if any(len(w.views) > MAX_SEGMENTS for w in windows):
            return None
        keys = key_bucket(max(w.start + 1 for w in windows))
        convs = conversations(windows)
        splits = ts.decode_splits(
            convs, keys, self.kv_heads, self.gqa, self.head_dim, self.device, fixed=self.fixed
        )
        return DecodeLaunch(padded_batch(len(windows)), keys, splits)

    def mixed_launch(self, windows: Sequence[KVWindow]) -> MixedLaunch | None:
        """``MixedLaunch`` of a step with prompt rows (None past ``MAX_SEGMENTS`` views or
        ``MIXED_BATCHES[-1]`` windows of one kind). A table's sequences are padded to their class
        (``mixed_batch``) and its grid sized for a bucket of its widest window: one-row windows 1,
        other narrow ones ``MAX_WINDOW_ROWS``, prefill chunks the step's row bucket (the graph's
        rows: so a chunk's size within the step is no part of the key either; the rows past a
        chunk's are programs that read nothing, and its splits are those of a chunk as wide as
        the step, at most 1.5x fewer where the chunk's own bucket is one below: 9 -> 6 at 64 ->
        96 rows, 8B shapes). Its tiles follow from those, and its room for splits is the most any
        context could ask (``table_launch``): the step's own split
        count is written into the table (``table_splits``), so neither the context nor the
        conversation count enters the key."""
        if any(len(w.views) > MAX_SEGMENTS for w in windows):
            return None
        step_rows = row_bucket(sum(w.rows for w in windows))
        tables: list[TableLaunch | None] = []
        for wide in (False, True):
            group = [w for w in windows if narrow(w.rows) != wide]
            if not group:
                tables.append(None)
                continue
            batch = mixed_batch(len(group))
            widest = max(w.rows for w in group)
            rows = step_rows if wide else (1 if widest == 1 else MAX_WINDOW_ROWS)
            if batch is None or rows is None:
                return None
            tables.append(self.table_launch(batch, rows, group[0].views[0][0].dtype))
        return MixedLaunch(*tables)

    def table_launch(self, batch: int, rows: int, dtype: torch.dtype) -> TableLaunch:
        """The launch of a mixed step's table of the class ``batch`` and a ``rows``-row grid: the
        tiles of ``pick_config`` and, as its room for splits, its split count at an unbounded
        context. A one-row grid's room is that of the class's smallest batch (its few
        conversations keep their flash-decoding splits; the combine pass of a padding sequence
        is one empty program a head); a wider grid's is the class's own (there the combine pass
        would run a program per head and grid row of every padding sequence)."""
        from turnkv.attention import triton_segments as ts

        # the tiles follow from the rows alone, so the config of the sizing batch is the table's
        sizing = mixed_fewest(batch) if rows == 1 else batch
        meta = TableMeta(sizing, 1, SPLIT_ROOM_KEYS, rows, self.kv_heads, self.head_dim, dtype)
        config = ts.pick_config(meta, self.gqa, self.device, conversations=sizing, fixed=self.fixed)
        return TableLaunch(batch, rows, config)

    def table_splits(self, group: Sequence[KVWindow], table: TableLaunch) -> int:
        """The split count of a mixed step's table over ``group`` (at most ``table``'s room): the
        one ``pick_config`` gives at the key bucket of its longest context, decode rows sized by
        their conversations (``decode_splits``) as in a decode step. A verify window's one-row
        windows beside few conversations may ask more than the room (sized for as many
        conversations as the batch); they get the room, which still fills the device: their
        rows are programs of their own."""
        from turnkv.attention import triton_segments as ts

        keys = key_bucket(max(w.start + w.rows for w in group))
        dtype = group[0].views[0][0].dtype
        meta = TableMeta(table.batch, 1, keys, table.rows, self.kv_heads, self.head_dim, dtype)
        config = ts.pick_config(
            meta, self.gqa, self.device, conversations=conversations(group), fixed=self.fixed
        )
        return min(config.splits, table.config.splits)

    def graph_table(self, batch: int) -> torch.Tensor:
        # the tables of ``batch`` sequences of one group (a decode step's one narrow launch, or a
        # mixed step's two: ``MixedLaunch.batch``)
        words = batch * (1 + MAX_SEGMENTS) * FIELDS + batch * FIELDS
        return torch.zeros(words, dtype=torch.int64, device=self.device)

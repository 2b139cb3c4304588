"""The segment table: one packed int64 description of a step's sequences and their KV views.

Built once per step on the host (plain integer work, no Triton import), uploaded in one copy, and
read by every layer's fused kernels: each view row carries a *layer stride*, so layer ``l`` of a
view starts at ``ptr + l * layer_stride`` and one table serves all layers.

Layout of ``words`` (int64), in this order:

- ``table [B, G, 1 + MAX_SEGMENTS, FIELDS]``: per sequence and group of up to ``MAX_SEGMENTS``
  views, a header row ``(n_views, group_start, group_len, window_start, q_len, q_start, splits, 0)``
  (``splits``: the split count of the sequence's keys, at most its launch's grid has room for; 0:
  as many as that room) and
  one row per view ``(k_ptr, v_ptr, layer_stride, head_stride, row_stride, length, start, 0)``
  (strides in elements; K and V of a view share their strides);
- ``dest [B, FIELDS]``: where the step's new K/V rows of each sequence go, the window rows of its
  last view: ``(k_ptr, v_ptr, layer_stride, head_stride, row_stride, first_row, q_start, q_len)``.

A sequence's keys are its views concatenated (``T`` rows); its window is ``q_len`` query rows at
flat rows ``[q_start, q_start + q_len)`` of the step; query row ``i`` sees key ``p`` iff
``p <= window_start + i`` (``window_start = T - q_len`` by default). A sequence with ``q_len == 0``
is padding (CUDA-graph batches): nothing is read or written for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turnkv.limits import MAX_SEGMENTS

FIELDS = 8  # int64 words per table row

Views4 = Sequence[tuple[torch.Tensor, torch.Tensor]]  # one sequence: (k, v) each [L, Hkv, T_i, D]


class UnsupportedViews(ValueError):
    """Views the kernel cannot read in place (dtype, device, alignment or a non-contiguous last dim)."""


@dataclass
class TableMeta:
    """Host-side facts of a packed table (what the launch needs to size its grid)."""

    batch: int
    groups: int
    max_keys: int  # the longest sequence's key count
    max_q: int  # the widest window
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def table_words(self) -> int:
        return self.batch * self.groups * (1 + MAX_SEGMENTS) * FIELDS

    @property
    def words(self) -> int:
        return self.table_words + self.batch * FIELDS


SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # batch sizes decode steps are captured (and planned) at


def padded_batch(b: int) -> int:
    """The batch a decode launch of ``b`` sequences is captured at (and sized for, when eager)."""
    return next((s for s in GRAPH_BATCHES if s >= b), b)


# sequences a table of a step with prompt rows is padded to (``FusedBackend.mixed_launch``): so few
# classes that the warm-up captures every key a step can take (``engine.mixed_keys``). The programs
# of padding sequences read and write nothing, so padding costs launches of empty programs; one
# chunk alone (the commonest wide table: a prompt beside decode rows) keeps a class of its own
MIXED_BATCHES = (1, 8, 64)


def mixed_batch(b: int) -> int | None:
    """The class a table of ``b`` sequences in a step with prompt rows is padded to (None: more
    than the largest, which runs eagerly)."""
    return next((s for s in MIXED_BATCHES if s >= b), None)


def mixed_fewest(batch: int) -> int:
    """The fewest sequences padded to the class ``batch`` (one more than the class below)."""
    i = MIXED_BATCHES.index(batch)
    return 1 if i == 0 else MIXED_BATCHES[i - 1] + 1


# total rows a step with prompt rows is captured at (``engine.graphs``): powers of two and the
# midpoints between them, so a step pads by at most half its rows
ROW_BUCKETS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def row_bucket(rows: int) -> int | None:
    """The captured row count of a step of ``rows`` rows, or None past the largest bucket."""
    return next((s for s in ROW_BUCKETS if s >= rows), None)


def key_bucket(keys: int) -> int:
    """The context a decode launch's split count is chosen for: the next power of two, >= 4096."""
    return max(4096, 1 << max(keys - 1, 1).bit_length())


def pack(
    seqs: Sequence[Views4],
    q_lens: Sequence[int],
    window_starts: Sequence[int] | None = None,
    q_starts: Sequence[int] | None = None,
    min_groups: int = 1,
    pad_to: int | None = None,
    splits: int = 0,
) -> tuple[list[int], TableMeta]:
    """The words of a table for ``seqs`` (each a list of ``[L, Hkv, T_i, D]`` views in row order) and
    its facts. ``q_starts`` are the windows' first flat rows (default: back to back from 0).

    ``pad_to`` appends padding sequences (``q_len`` 0) up to that batch size (CUDA-graph batches of
    a fixed shape; nothing is read or written for them). ``splits``: every sequence's split count
    (header word 6; 0: the launch's room, ``LaunchConfig.splits``). Checks each view in
    the same pass; raises ``UnsupportedViews`` for a view the kernel cannot read in place.
    """
    b = len(seqs)
    groups = max(min_groups, 1, *(math.ceil(len(v) / MAX_SEGMENTS) for v in seqs))
    k0 = seqs[0][0][0]
    dtype, dev, hkv, d = k0.dtype, k0.get_device(), k0.shape[1], k0.shape[-1]
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedViews(f"dtype {dtype} (the kernel takes bf16/fp16)")
    vec = 16 // k0.element_size()  # elements per 16 bytes
    words: list[int] = []
    dest: list[int] = []
    max_keys = 0
    next_start = 0
    empty_group = [0] * FIELDS * MAX_SEGMENTS
    for s, views in enumerate(seqs):
        rows = []
        start = 0
        for k, v in views:
            if k.dtype != dtype or v.dtype != dtype or k.get_device() != dev or v.get_device() != dev:
                raise UnsupportedViews(
                    f"view {k.dtype}/{v.dtype} on {k.device}, expected {dtype} like the first"
                )
            if k.dim() != 4 or k.shape != v.shape or k.shape[1] != hkv or k.shape[3] != d:
                raise UnsupportedViews(
                    f"views {tuple(k.shape)}/{tuple(v.shape)}, expected [L, {hkv}, T, {d}]"
                )
            n = k.shape[2]
            st = k.stride()
            kp, vp = k.data_ptr(), v.data_ptr()
            # 16-byte aligned rows (the kernel promises the compiler so, to get 128-bit loads) and
            # one set of strides for K and V
            if n and (st != v.stride() or st[3] != 1 or (kp | vp) & 15 or (st[0] | st[1] | st[2]) % vec):
                raise UnsupportedViews(f"view strides {st}/{v.stride()} or address not 16-byte aligned rows")
            rows.append((kp, vp, st[0], st[1], st[2], n, start, 0))
            start += n
        max_keys = max(max_keys, start)
        m = q_lens[s]
        q_start = next_start if q_starts is None else q_starts[s]
        next_start = q_start + m
        ws = start - m if window_starts is None else window_starts[s]
        for g in range(groups):
            chunk = rows[g * MAX_SEGMENTS : (g + 1) * MAX_SEGMENTS]
            g_start = chunk[0][6] if chunk else start
            words += (len(chunk), g_start, sum(r[5] for r in chunk), ws, m, q_start, splits, 0)
            for r in chunk:
                words += r
            words += empty_group[: FIELDS * (MAX_SEGMENTS - len(chunk))]
        last = rows[-1] if rows else (0, 0, 0, 0, 0, 0, 0, 0)
        dest += (last[0], last[1], last[2], last[3], last[4], last[5] - m, q_start, m)
    total = b if pad_to is None else max(b, pad_to)
    pad = total - b
    if pad:
        words += [0, 0, 0, 0, 0, 0, 0, 0, *empty_group] * (groups * pad)
        dest += [0] * (FIELDS * pad)
    meta = TableMeta(total, groups, max_keys, max(q_lens, default=0), hkv, d, dtype)
    return words + dest, meta


def upload(words: list[int], device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """One host-to-device copy of ``words`` (pinned, asynchronous); into ``out`` when given."""
    host = torch.tensor(words, dtype=torch.int64, pin_memory=device.type == "cuda")
    if out is None:
        return host.to(device, non_blocking=True)
    out[: host.numel()].copy_(host, non_blocking=True)
    return out

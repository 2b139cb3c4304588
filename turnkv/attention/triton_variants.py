"""Every variant of the fused attention kernels one model's launches can take, compiled before
ready (issue 30, item 3: nothing compiles after ``/health`` says ``ok``).

Triton compiles ``_segment_attn_kernel`` once per combination of its constexprs: the tiles, warps
and stages (``_tuned`` by the rows per KV head of a table's widest window, or ``fixed_config``
under ``--deterministic on``), ``PIECE`` and ``DIRECT`` (one partial a row: one group of views and
one split, so no combine pass). The counts that vary per step are not specialized. Which of these
a serving step meets depends on its company: the same decode tiles write directly for
conversations of up to 12 views at one split, and through the combine kernel for two groups or
two splits. The warm-up's turns met most of them; an H200 serve run still compiled one or two
``DIRECT`` variants after ready. So ``compile_all`` launches each variant once on a small table
of its own: the set is finite and known from the model's shape alone (``variants``).
"""

from __future__ import annotations

import torch

from turnkv.attention import triton_segments as ts
from turnkv.attention.segment_table import ROW_BUCKETS, pack, upload

MAX_ROWS_LOG2 = ROW_BUCKETS[-1].bit_length()  # a window's rows: at most the largest row bucket


def variants(gqa: int, head_dim: int, fixed: bool) -> list[ts.LaunchConfig]:
    """The launch configs of every kernel variant a model of ``gqa`` query heads per KV head and
    ``head_dim`` can launch: each tile choice at one split (``DIRECT``) and at two (the combine
    pass). ``fixed``: ``fixed_config``'s tiles and key pieces only."""
    if fixed:  # (its tiles and piece do not depend on the table: only its split count does)
        one = ts.fixed_config(1, 1, gqa, 1, 1, head_dim, 1, torch.device("cpu"))
        tiles, piece = [tuple(one[:4])], one.piece
    else:  # ``_tuned`` by the rows per KV head: gqa x a window's rows, up to its cap
        tiles = sorted({ts._tuned(gqa << k, head_dim)[:4] for k in range(MAX_ROWS_LOG2 + 1)})
        piece = 0
    return [ts.LaunchConfig(*t, splits=s, piece=piece) for t in tiles for s in (1, 2)]


def variant_of(config: ts.LaunchConfig, groups: int) -> tuple:
    """What a launch of ``config`` over a table of ``groups`` groups compiles (the constexprs that
    ``segment_attention`` passes): tiles, warps, stages, PIECE, DIRECT."""
    direct = ts.partials(config, groups) == 1
    return (config.block_m, config.block_n, config.num_warps, config.num_stages, config.piece, direct)


def compile_all(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device,
    fixed: bool,
) -> int:
    """Launch every config of ``variants`` once over a one-sequence table (8 query rows over 300
    keys in two views, values unused), so Triton has compiled (or loaded) each variant; returns
    how many launches ran. Runs outside any CUDA-graph capture."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows, keys = 8, (200, 100)
    views = [
        tuple(torch.randn(1, num_kv_heads, t, head_dim, generator=gen).to(device, kv_dtype) for _ in "kv")
        for t in keys
    ]  # [L=1, Hkv, T, D] each
    words, meta = pack([views], [rows])
    packed = upload(words, device)
    q = torch.randn(rows, num_heads, head_dim, generator=gen).to(device, dtype)  # [M, Hq, D]
    configs = variants(num_heads // num_kv_heads, head_dim, fixed)
    for config in configs:
        ts.segment_attention(q, packed, meta, 0, head_dim**-0.5, config)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return len(configs)

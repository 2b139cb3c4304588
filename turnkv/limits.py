"""The fused kernel's limits, in one import-free place (the KV merge policy, the table packer, the
kernel and the load-time verdict all read them from here)."""

from __future__ import annotations

MAX_SEGMENTS = 12  # views (segments + tail) one fused launch reads per group
MAX_WINDOW_ROWS = 32  # widest decode / verify window; wider windows are prefill chunks
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_GQA = 8  # query heads per KV head
SUPPORTED_DTYPE_NAMES = ("bfloat16", "float16")

"""Shared by the Triton kernels of attention, the model's matmuls and pointwise ops: whether they
run under Triton's CPU interpreter (``INTERPRET``) and the fp32 -> dtype cast that rounds the same
there as on the GPU (``downcast``).

Triton is imported at module import; import this module only where triton is known to exist.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as triton itself does


@triton.jit
def downcast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """fp32 -> dtype, rounding to nearest even. The CPU interpreter truncates fp32 -> bf16, so there
    the bits are rounded first (the cast is then exact); compiled code rounds in the cvt itself."""
    if INTERP:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)

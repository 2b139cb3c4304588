"""The grammar masks of a step applied to its logits in one Triton launch (CUDA).

``StepMasks`` uploads one int32 buffer per step: ``C`` bitmasks of ``W = ceil(V / 32)`` words, then
the ``C`` logit rows they belong to. One program per (constrained row, block of the vocabulary)
writes -inf where the token's bit is 0 and reads nothing of the logits: one launch instead of the
five elementwise torch ops over an expanded ``[C, W, 32]`` tensor, and cheaper (docs/BENCHMARKS.md
"Structured output").
``masks.apply_bitmask`` is the reference (and the path off CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per program


@triton.jit
def _mask_kernel(Logits, Packed, C, W, V, stride_l, BLOCK: tl.constexpr):
    i = tl.program_id(0)  # the i-th constrained row
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # token ids
    live = t < V
    row = tl.load(Packed + C * W + i).to(tl.int64)  # its logit row
    word = tl.load(Packed + i * W + t // 32, mask=live, other=-1)
    allowed = (word >> (t % 32)) & 1  # an arithmetic shift still leaves bit k in bit 0
    tl.store(Logits + row * stride_l + t, float("-inf"), mask=live & (allowed == 0))


def mask_logits(logits: torch.Tensor, packed: torch.Tensor, count: int) -> None:
    """Set ``logits[rows[i], t]`` (fp32 ``[R, V]``, rows contiguous, in place) to -inf wherever bit
    ``t`` of mask ``i`` is 0; ``packed`` (int32, on the logits' device) holds ``count`` masks of
    ``ceil(V / 32)`` words, then ``rows``."""
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    assert logits.stride(1) == 1 and packed.numel() >= count * (words + 1)
    grid = (count, triton.cdiv(vocab, BLOCK))
    _mask_kernel[grid](logits, packed, count, words, vocab, logits.stride(0), BLOCK=BLOCK)

"""The grammar-mask kernel (turnkv/engine/mask_kernel.py) against the torch reference
(``grammar.apply_bitmask``): the same logits bit for bit, for constrained rows in any order, a
vocabulary that is not a multiple of 32 or of the kernel's block, and untouched free rows. CI runs
it under TRITON_INTERPRET=1 on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

from turnkv.engine.mask_kernel import BLOCK, mask_logits  # noqa: E402
from turnkv.engine.masks import apply_bitmask  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.mark.parametrize(
    ("n", "vocab", "rows"),
    [(1, 77, [0]), (5, 4097 + 64, [3, 0, 4]), (4, 2 * BLOCK, [0, 1, 2, 3]), (3, 1000, [2])],
)
def test_kernel_masks_as_the_reference(n, vocab, rows):
    g = torch.Generator().manual_seed(n * vocab)
    words = (vocab + 31) // 32
    logits = torch.randn(n, vocab, generator=g)
    masks = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int32)
    masks[0, 0] = 0  # a word with no allowed token
    masks[-1, -1] = -1  # every token allowed (the last word's bits past the vocabulary are ignored)
    ref = logits.clone()
    apply_bitmask(ref, masks, rows)
    out = logits.to(DEVICE)
    packed = torch.cat([masks.view(-1), torch.tensor(rows, dtype=torch.int32)]).to(DEVICE)
    mask_logits(out, packed, len(rows))
    assert torch.equal(out.cpu(), ref)
    free = [r for r in range(n) if r not in rows]
    assert torch.equal(out.cpu()[free], logits[free])  # unconstrained rows untouched
    assert torch.isinf(ref[rows[0], :32]).all()  # the empty word masked its 32 tokens

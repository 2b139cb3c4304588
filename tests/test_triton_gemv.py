"""The decode GEMV (turnkv/models/triton_gemv.py) against the fp32 product, rounded once; each
of several rows bit for bit as alone.

CI runs it through Triton's CPU interpreter (TRITON_INTERPRET=1) at small shapes; on a CUDA
machine the same tests run compiled, and ``matmul.linear`` is checked to route one row through it.
Widths and depths are chosen so that both of ``pick``'s tiles run, with ragged last tiles: under
the interpreter the wide tile runs at a small width through ``config`` (its real widths, 12K
outputs and up, are ~10^4 programs a call, minutes each in Python); compiled, at its own width too.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

from turnkv.models import matmul  # noqa: E402
from turnkv.models.triton_gemv import MAX_ROWS, WIDE_N, gemv, pick, takes  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
WIDE = pick(WIDE_N, 72)  # the wide tile, forced at a width the interpreter runs in seconds
# (n, k, tile): None is pick's own choice for the shape
SHAPES = [(37, 200, None), (64, 96, None), (45, 72, WIDE), (5, 2100, None)]
SHAPES += [(WIDE_N + 5, 72, None)] if CUDA else []


def rounded_once(x, w, bias=None, residual=None) -> torch.Tensor:
    y = x.float() @ w.float().T
    y = y if bias is None else y + bias.float()
    y = y if residual is None else y + residual.float()
    return y.to(x.dtype)


@pytest.mark.parametrize(("n", "k", "tile"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_is_the_fp32_product_rounded_once(n, k, tile, dtype):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    b, r = torch.randn(n, generator=gen), torch.randn(1, n, generator=gen)
    x, w, b, r = (t.to(DEVICE, dtype) for t in (x, w, b, r))
    for bias, res in ((None, None), (b, None), (None, r), (b, r)):
        got = gemv(x, w, bias, res, config=tile)
        want = rounded_once(x, w, bias, res)
        assert got.shape == (1, n) and got.dtype == dtype
        # fp32 sums in another order than the oracle's: equal, or one rounding apart where they
        # straddle a rounding boundary
        ulp = 2**-7 if dtype == torch.bfloat16 else 2**-20
        assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-4 * k**0.5).all()


def test_pick_gives_narrow_outputs_long_slices_and_wide_outputs_many_programs():
    assert pick(4096, 4096)[:2] == (4, 2048)
    assert pick(4096, 1000)[:2] == (4, 1024)  # never longer than K rounded up
    assert pick(128256, 4096)[:2] == (16, 256)
    # the tile the interpreter forces at width 45 is the one pick gives from WIDE_N on
    assert pick(WIDE_N + 5, 72) == WIDE != pick(WIDE_N - 1, 72)


def test_takes_up_to_max_rows_contiguous_rows_of_the_weights_dtype():
    w = torch.zeros(8, 16, device=DEVICE, dtype=torch.bfloat16)
    assert takes(torch.zeros(1, 16, device=DEVICE, dtype=torch.bfloat16), w)
    assert takes(torch.zeros(MAX_ROWS, 16, device=DEVICE, dtype=torch.bfloat16), w)
    assert not takes(torch.zeros(MAX_ROWS + 1, 16, device=DEVICE, dtype=torch.bfloat16), w)
    assert not takes(torch.zeros(1, 16, device=DEVICE), w)  # another dtype
    assert not takes(torch.zeros(1, 16, device=DEVICE, dtype=torch.bfloat16), w.T.contiguous().T)


@pytest.mark.parametrize(("n", "k", "tile"), [s for s in SHAPES if s[0] in (37, 45, WIDE_N + 5)])
def test_each_row_of_many_is_the_row_alone_bit_for_bit(n, k, tile):
    """A verify window's rows through the GEMV round as the same rows decoded one by one: each
    row's bits never depend on how many rows the call has, or which (bias and residual too)."""
    gen = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(MAX_ROWS, k, generator=gen), torch.randn(n, k, generator=gen)
    b, r = torch.randn(n, generator=gen), torch.randn(MAX_ROWS, n, generator=gen)
    x, w, b, r = (t.to(DEVICE, torch.bfloat16) for t in (x, w, b, r))
    alone = torch.cat([gemv(x[i : i + 1], w, b, r[i : i + 1], config=tile) for i in range(MAX_ROWS)])
    for m in (2, 3, 8, MAX_ROWS):
        assert torch.equal(gemv(x[:m], w, b, r[:m], config=tile), alone[:m]), m
    flipped = gemv(x[:5].flip(0), w, b, r[:5].flip(0), config=tile)
    assert torch.equal(flipped, alone[:5].flip(0))


@pytest.mark.skipif(not CUDA, reason="the route to the GEMV is CUDA's")
def test_linear_layers_take_the_gemv_for_one_row_and_for_solo_rows_on_cuda():
    w = torch.randn(300, 256, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(1, 256, device=DEVICE, dtype=torch.bfloat16)
    res = torch.randn(1, 300, device=DEVICE, dtype=torch.bfloat16)
    assert torch.equal(matmul.linear(x, w), gemv(x, w))
    assert torch.equal(matmul.residual_linear(res, x, w, None), gemv(x, w, residual=res))
    two = torch.randn(2, 256, device=DEVICE, dtype=torch.bfloat16)
    assert torch.equal(matmul.linear(two, w), torch.nn.functional.linear(two, w))  # cuBLAS
    assert torch.equal(
        matmul.linear(two, w, None, matmul.MatmulPlan(solo=True)), gemv(two, w)
    )  # one conversation's rows

"""The row-invariant GEMM of ``--deterministic on`` (turnkv/models/triton_rowinv.py): a row's bits
are the same whatever rows share its launch (how many, which, in which order), and the result is the
fp32 product (+ bias + residual) rounded once, within bf16 rounding.

CI runs it through Triton's CPU interpreter (TRITON_INTERPRET=1) at small shapes; on a CUDA machine
the same tests run compiled, and ``matmul.linear`` is checked to route a deterministic plan to it."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

from turnkv.models import matmul  # noqa: E402
from turnkv.models.triton_rowinv import Cfg, rowinv_linear, tiles_m  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
N, K = 40, 100  # ragged against every tile below
# swap at 32 columns: its accumulator [BN, BM] is not square (at 16 a wrong branch still fits)
CFGS = [
    None,
    Cfg(16, 32, 1),
    Cfg(16, 32, 3),
    Cfg(16, 32, 3, swap=True, fused=True),
    Cfg(32, 32, 1, swap=True),
]


def rounded_once(x, w, bias=None, residual=None) -> torch.Tensor:
    y = x.float() @ w.float().T
    y = y if bias is None else y + bias.float()
    y = y if residual is None else y + residual.float()
    return y.to(x.dtype)


def _data(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).bfloat16().to(DEVICE)
    b = torch.randn(N, generator=g).bfloat16().to(DEVICE)
    x = torch.randn(rows, K, generator=g).bfloat16().to(DEVICE)
    r = torch.randn(rows, N, generator=g).bfloat16().to(DEVICE)
    return w, b, x, r


@pytest.mark.parametrize("cfg", CFGS)
def test_bias_and_residual_are_the_fp32_sum_rounded_once(cfg):
    w, b, x, r = _data(0, 5)
    got = rowinv_linear(x, w, b, r, cfg=cfg)
    ref = rounded_once(x, w, b, r)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=2e-2)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(0, 2**16),
    st.integers(1, 40),
    st.lists(st.integers(0, 39), min_size=0, max_size=39),
    st.sampled_from(CFGS),
)
def test_a_rows_bits_do_not_depend_on_its_company(seed, m, company, cfg):
    """Row 0 alone, and row 0 beside 0-39 other rows at any place (so in any of a program's 1, 2
    or 4 row tiles, ``tiles_m``): the same bits (bias, residual); and the first m rows of a launch
    of 40 are the launch of m rows."""
    w, b, x, r = _data(seed, 40)
    alone = rowinv_linear(x[:1], w, b, r[:1], cfg=cfg)
    at = len(company) // 2
    idx = [*company[:at], 0, *company[at:]]
    ys = rowinv_linear(x[idx].contiguous(), w, b, r[idx].contiguous(), cfg=cfg)
    assert torch.equal(ys[at], alone[0])
    prefix = rowinv_linear(x[:m], w, cfg=cfg)
    assert torch.equal(prefix, rowinv_linear(x, w, cfg=cfg)[:m])
    torch.testing.assert_close(prefix.float(), rounded_once(x[:m], w).float(), rtol=1.6e-2, atol=2e-2)


def test_a_program_carries_every_row_tile_up_to_four():
    assert [tiles_m(m) for m in (1, 16, 17, 32, 33, 48, 64, 65, 2048)] == [1, 1, 2, 2, 4, 4, 4, 4, 4]


def test_zero_rows():
    w, _, x, _ = _data(1, 1)
    assert rowinv_linear(x[:0], w).shape == (0, N)


def test_the_deterministic_plan_carries_to_the_lm_head():
    plan = matmul.plan_matmul([3, 1], rowinv=True)
    assert plan.rowinv and plan.head().rowinv
    assert not matmul.plan_matmul([3, 1]).rowinv


def test_the_route_is_cuda_only():
    assert matmul.rowinv_route(torch.device("cpu"), "on")[0] is False
    assert matmul.rowinv_route(torch.device("cpu"), "off") == (False, "off")


@pytest.mark.skipif(not CUDA, reason="the route to the row-invariant GEMM is CUDA's")
def test_a_deterministic_plan_routes_every_row_count_to_it():
    w = torch.randn(300, 256, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(9, 256, device=DEVICE, dtype=torch.bfloat16)
    res = torch.randn(9, 300, device=DEVICE, dtype=torch.bfloat16)
    plan = matmul.MatmulPlan(rowinv=True)
    for m in (1, 2, 9):
        assert torch.equal(matmul.linear(x[:m], w, None, plan), rowinv_linear(x[:m], w))
        assert torch.equal(
            matmul.residual_linear(res[:m], x[:m], w, None, plan), rowinv_linear(x[:m], w, residual=res[:m])
        )

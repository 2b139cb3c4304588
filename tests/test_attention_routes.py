"""The portable routes against the fp32 oracle (reference.py).

Tolerances: the lse route must equal the fp32 reference rounded once to the query dtype, up to
fp32 summation-order noise (we allow 1 ulp of the output dtype on at most 2 % of elements, and
compare fp32 inputs at 1e-5). One segment takes ``single`` and is bit-identical to SDPA on the
same rows as one contiguous buffer.
"""

from __future__ import annotations

import pytest
import torch

from turnkv.attention.lse import lse_attention
from turnkv.attention.reference import reference_attention
from turnkv.attention.route import AttentionRouter, single_attention


def _views(hkv: int, lengths: list[int], d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    views = []
    for n in lengths:
        # a strided view, as a segment of all layers sliced at one layer and its first n rows
        base_k = torch.randn(3, hkv, n + 5, d, generator=g).to(dtype)
        base_v = torch.randn(3, hkv, n + 5, d, generator=g).to(dtype)
        views.append((base_k[1, :, :n], base_v[1, :, :n]))
    return views


def _ulp_diff_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).float().mean().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", [[7], [5, 9], [1, 0, 13, 3], [4] * 13])
@pytest.mark.parametrize("m", [1, 4, 17, 40])  # 40: a prefill window (CPU flash kernel in fp32)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (9, 3)])
def test_lse_equals_fp32_reference_rounded_once(dtype, lengths, m, hq, hkv):
    d = 16
    lengths = [*lengths[:-1], lengths[-1] + m]  # the window's own rows end the last view
    views = _views(hkv, lengths, d, dtype)
    q = torch.randn(hq, m, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = reference_attention(q, views, d**-0.5)
    out = lse_attention(q, views, d**-0.5)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        rounded = ref.to(dtype)
        # within one ulp everywhere, identical almost everywhere
        ulp = torch.finfo(dtype).eps * rounded.float().abs().clamp_min(1e-3)
        assert ((out.float() - rounded.float()).abs() <= ulp * 1.01).all()
        assert _ulp_diff_fraction(out, rounded) < 0.02  # double rounding puts ~25 % off


def test_one_segment_is_bit_identical_to_contiguous_single():
    hq, hkv, d, m = 8, 2, 32, 5
    views = _views(hkv, [40], d, torch.bfloat16)
    q = torch.randn(hq, m, d).to(torch.bfloat16)
    router = AttentionRouter()
    out = router.attend(q, views, d**-0.5)
    k, v = (t.contiguous().clone() for t in views[0])
    assert torch.equal(out, single_attention(q, k, v, d**-0.5))
    assert router.route_counts == {"single_q5": 1}


@pytest.mark.parametrize("m", [6, 40])
def test_fully_masked_rows_are_zero_not_nan(m):
    hq, hkv, d = 4, 2, 16
    views = _views(hkv, [3, 0, 4], d, torch.float32)
    q = torch.randn(hq, m, d)
    # window_start -3: rows 0..2 see no key at all, row 3 sees key 0 only
    out = lse_attention(q, views, d**-0.5, window_start=-3)
    ref = reference_attention(q, views, d**-0.5, window_start=-3)
    assert not torch.isnan(out).any()
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    k, v = views[0]
    single = single_attention(q, k, v, d**-0.5, window_start=-3)
    assert not torch.isnan(single).any()
    assert torch.equal(single[:, :3], torch.zeros_like(single[:, :3]))


def test_normal_paths_never_gather():
    hq, hkv, d = 4, 2, 16
    router = AttentionRouter()
    for lengths, m in [([8], 1), ([8, 3], 1), ([8, 3, 9], 4), ([2] * 12, 33)]:
        views = _views(hkv, lengths, d, torch.float32)
        router.attend(torch.randn(hq, m, d), views, d**-0.5)
    assert not any(k.startswith("gather") for k in router.route_counts)
    assert router.route_counts["lse_prefill"] == 1 and router.route_counts["single_q1"] == 1


def test_mixed_dtypes_gather_and_are_counted():
    hq, hkv, d = 4, 2, 16
    views = _views(hkv, [5], d, torch.float32) + _views(hkv, [6], d, torch.float16)
    router = AttentionRouter()
    q = torch.randn(hq, 2, d)
    out = router.attend(q, views, d**-0.5)
    assert router.route_counts == {"gather_q2": 1}
    torch.testing.assert_close(out, reference_attention(q, views, d**-0.5), atol=2e-3, rtol=2e-3)

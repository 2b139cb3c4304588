"""The portable routes against the fp32 oracle (reference.py), and which route a window takes.

Tolerances: the ``concat`` and ``lse`` paths must equal the fp32 reference rounded once to the
query dtype, up to fp32 summation-order noise (we allow 1 ulp of the output dtype on at most 2 %
of elements, and compare fp32 inputs at 1e-5). One segment is bit-identical to the same rows as
one contiguous buffer.
"""

from __future__ import annotations

import pytest
import torch

from turnkv.attention import cpu_native
from turnkv.attention.lse import concat_segments, lse_attention
from turnkv.attention.portable import PortableBackend, PortableStep, attend_window, portable_route
from turnkv.attention.reference import reference_attention
from turnkv.attention.routes import Path, narrow
from turnkv.attention.sdpa import single_attention
from turnkv.attention.verdict import Verdict
from turnkv.kv.cache import KVWindow

F32 = torch.float32


def _views(hkv: int, lengths: list[int], d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    views = []
    for n in lengths:
        # a strided view, as a segment of all layers sliced at one layer and its first n rows
        base_k = torch.randn(3, hkv, n + 5, d, generator=g).to(dtype)
        base_v = torch.randn(3, hkv, n + 5, d, generator=g).to(dtype)
        views.append((base_k[1, :, :n], base_v[1, :, :n]))
    return views


def _window(hkv: int, lengths: list[int], m: int, d: int, seed: int) -> KVWindow:
    """A KV window over all-layer views ``[L=2, Hkv, T_i, D]``; the last view holds the m window rows."""
    g = torch.Generator().manual_seed(seed)
    views = []
    for n in [*lengths[:-1], lengths[-1] + m]:
        k, v = torch.randn(2, 2, hkv, n + 3, d, generator=g)
        views.append((k[:, :, :n], v[:, :, :n]))
    return KVWindow(tuple(views), sum(lengths), m)


@pytest.fixture
def torch_ops(monkeypatch):
    """The CPU decode windows on torch ops, as where no C compiler is found (``cpu_native``)."""
    monkeypatch.setattr(cpu_native.KERNEL, "lib", None)
    monkeypatch.setattr(cpu_native.KERNEL, "why", "off (test)")


def _ulp_diff_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).float().mean().item()


@pytest.mark.parametrize("path", ["concat", "lse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", [[7], [5, 9], [1, 0, 13, 3], [4] * 13])
@pytest.mark.parametrize("m", [1, 4, 17, 40])  # 40: a prefill window (CPU flash kernel in fp32)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (9, 3)])
def test_concat_and_lse_equal_fp32_reference_rounded_once(path, dtype, lengths, m, hq, hkv):
    d = 16
    lengths = [*lengths[:-1], lengths[-1] + m]  # the window's own rows end the last view
    views = _views(hkv, lengths, d, dtype)
    q = torch.randn(hq, m, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = reference_attention(q, views, d**-0.5)
    if path == "concat":
        out = concat_segments(q, views, d**-0.5, sum(lengths) - m).to(dtype)
    else:  # through torch's flash kernel where a route takes it: a CPU's fp32 prefill window
        out = lse_attention(q, views, d**-0.5, flash=dtype == F32 and not narrow(m))
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        rounded = ref.to(dtype)
        # within one ulp everywhere, identical almost everywhere
        ulp = torch.finfo(dtype).eps * rounded.float().abs().clamp_min(1e-3)
        assert ((out.float() - rounded.float()).abs() <= ulp * 1.01).all()
        assert _ulp_diff_fraction(out, rounded) < 0.02  # double rounding puts ~25 % off


def test_one_segment_is_bit_identical_to_contiguous_single(torch_ops):
    """The torch-ops route (the C kernel's own equivalence is in tests/test_cpu_native.py)."""
    hq, hkv, d, m = 8, 2, 32, 5
    w = _window(hkv, [35], m, d, seed=0)  # one strided view of all layers
    q = torch.randn(m, hq, d).to(torch.bfloat16)
    w = KVWindow(tuple((k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in w.views), w.start, m)
    step = PortableBackend(Verdict(), torch.bfloat16).plan([w])
    out = step.attend(1, q, d**-0.5)
    k, v = (t[1].contiguous().clone() for t in w.views[0])
    route = step.routes[0]
    alone = attend_window(route, q.transpose(0, 1), [(k, v)], d**-0.5, w.start).transpose(0, 1)
    assert torch.equal(out, alone)
    assert (route.path, route.label) == (Path.CONCAT, "single_q5")


@pytest.mark.parametrize("m", [6, 40])
def test_fully_masked_rows_are_zero_not_nan(m):
    hq, hkv, d = 4, 2, 16
    views = _views(hkv, [3, 0, 4], d, torch.float32)
    q = torch.randn(hq, m, d)
    # window_start -3: rows 0..2 see no key at all, row 3 sees key 0 only
    out = lse_attention(q, views, d**-0.5, window_start=-3, flash=not narrow(m))
    ref = reference_attention(q, views, d**-0.5, window_start=-3)
    assert not torch.isnan(out).any()
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    k, v = views[0]
    single = single_attention(q, k, v, d**-0.5, window_start=-3)
    assert not torch.isnan(single).any()
    assert torch.equal(single[:, :3], torch.zeros_like(single[:, :3]))


def test_a_ragged_step_equals_each_window_alone_and_labels_its_routes():
    hq, hkv, d = 4, 2, 16
    shapes = [([8], 1), ([8, 3], 1), ([8, 3, 9], 4), ([2] * 12, 33)]
    windows = [_window(hkv, lengths, m, d, seed) for seed, (lengths, m) in enumerate(shapes)]
    n = sum(w.rows for w in windows)
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(hq, n, d, generator=g), *torch.randn(2, n, hkv, d, generator=g)
    q = q.transpose(0, 1)  # [N, Hq, D] with strides like the model's
    step = PortableBackend(Verdict(), F32).plan(windows)
    assert [r.label for r in step.routes] == ["single_q1", "lse_q1", "lse_q4", "lse_prefill"]
    step.store(1, k, v)
    out = step.attend(1, q, d**-0.5)
    start = 0
    for w in windows:
        rows = slice(start, start + w.rows)
        assert torch.equal(w.views[-1][0][1, :, -w.rows :], k[rows].transpose(0, 1))  # stored in place
        alone = PortableBackend(Verdict(), F32).plan([w]).attend(1, q[rows], d**-0.5)
        assert torch.equal(out[rows], alone)
        ref = reference_attention(q[rows].transpose(0, 1), w.layer_views(1), d**-0.5).transpose(0, 1)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)
        start += w.rows


@pytest.mark.parametrize("threads", [2, 3])
def test_decode_windows_split_over_threads_equal_each_window_alone(threads, torch_ops):
    """Without the C kernel a CPU step of narrow windows runs them in slices on the attention
    pool, one torch thread each (portable.PortableStep): the same bits as each window alone, in
    the step's row order."""
    hq, hkv, d = 4, 2, 16
    shapes = [([8], 1), ([8, 3], 1), ([8, 3, 9], 4), ([5, 7], 1), ([2] * 12, 32)]
    windows = [_window(hkv, lengths, m, d, seed) for seed, (lengths, m) in enumerate(shapes)]
    n = sum(w.rows for w in windows)
    q = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = PortableBackend(Verdict(), F32).plan(windows)
        assert step.native is None and step.threads == threads  # the split path
        out = step.attend(1, q, d**-0.5)
        assert torch.get_num_threads() == threads  # restored after the layer
    finally:
        torch.set_num_threads(before)
    start = 0
    for w, r in zip(windows, step.routes, strict=True):
        rows = slice(start, start + w.rows)
        alone = PortableStep._attend(1, q, d**-0.5, [start], [w], [r])
        assert torch.equal(out[rows], alone)
        start += w.rows


def _truncated(views, n: int):
    """The first ``n`` rows of the concatenated ``views`` (what a decode step at row n-1 sees)."""
    out, left = [], n
    for k, v in views:
        take = min(left, k.shape[1])
        out.append((k[:, :take], v[:, :take]))
        left -= take
    return [(k, v) for k, v in out if k.shape[1]] or out[:1]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("m", [2, 9, 32])
@pytest.mark.parametrize("lengths", [[223], [700, 190, 90]])
def test_a_verify_window_row_is_the_same_bits_as_that_row_decoded_alone(threads, hq, hkv, m, lengths):
    """Speculation's exactness on CPU: row i of a window of m rows (a verify window) equals, bit
    for bit, a one-row decode window over the keys up to it (``lse.concat_segments``, the route of
    both: rows padded to ``MIN_GEMM_ROWS``, the last view's values summed per row over the keys it
    sees)."""
    d = 64
    views = _views(hkv, [*lengths[:-1], lengths[-1] + m], d, torch.float32)
    q = torch.randn(hq, m, d, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = sum(k.shape[1] for k, _ in views)
        window = concat_segments(q, views, d**-0.5, t - m)
        for i in range(m):
            alone = concat_segments(q[:, i : i + 1], _truncated(views, t - m + i + 1), d**-0.5, t - m + i)
            assert torch.equal(window[:, i : i + 1], alone), i
    finally:
        torch.set_num_threads(before)


def _shaped(device: str, views: int, start: int, rows: int) -> KVWindow:
    """A window of ``rows`` rows after ``start`` over ``views`` views (contents unused)."""
    lengths = [start // views] * (views - 1) + [start - start // views * (views - 1) + rows]
    return KVWindow(tuple((torch.empty(1, 1, n, 16, device=device),) * 2 for n in lengths), start, rows)


@pytest.mark.parametrize(
    "device, views, start, rows, dtype, path",
    [
        ("cpu", 1, 0, 1, F32, Path.SINGLE),  # a first chunk: SDPA, causal without a mask
        ("cpu", 1, 0, 40, torch.bfloat16, Path.SINGLE),
        ("cpu", 1, 9, 1, F32, Path.CONCAT),  # decode and verify windows: two matmuls
        ("cpu", 3, 9, 32, torch.bfloat16, Path.CONCAT),
        ("cpu", 1, 9, 33, F32, Path.LSE),  # a later fp32 prefill chunk: torch's flash kernel
        ("cpu", 3, 9, 40, F32, Path.LSE),
        ("cpu", 1, 9, 40, torch.bfloat16, Path.SINGLE),  # ... in bf16: SDPA with a mask
        ("cpu", 3, 9, 40, torch.bfloat16, Path.CONCAT),
        ("meta", 1, 9, 1, torch.bfloat16, Path.SINGLE),  # off a CPU: SDPA on one view
        ("meta", 3, 9, 40, torch.bfloat16, Path.CONCAT),  # and the scores side by side on several
    ],
)
def test_a_window_takes_the_route_of_its_views_rows_and_dtype(device, views, start, rows, dtype, path):
    w = _shaped(device, views, start, rows)
    route = portable_route(w, dtype, native=False)
    assert route.path is path and route.rows == rows
    assert route.name == ("single" if views == 1 else "lse")
    assert portable_route(w, dtype, native=True).path is Path.NATIVE  # wherever the C kernel reads it

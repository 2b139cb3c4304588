"""The fused segment kernel (turnkv/attention/triton_segments.py) against the fp32 oracle.

CI runs it through Triton's CPU interpreter (TRITON_INTERPRET=1) at small shapes; on a CUDA machine
the same tests run compiled at real shapes (head counts x4, lengths x64, so splits, row blocks and
view boundaries fall inside tiles). Tolerance (selfcheck.tolerance, per element):
``|out - ref| <= u * (|ref| + A) + 2**-16 * A`` with ``u`` the dtype's unit roundoff (2**-8 bf16)
and ``A`` the attention over ``|v|``: one final rounding plus the rounding of the probabilities to
the input dtype before P·V. A one-key error or an off-by-one mask is far outside it.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

from turnkv.attention import triton_segments as ts  # noqa: E402
from turnkv.attention.reference import reference_attention  # noqa: E402
from turnkv.attention.route import AttentionRouter, Verdict  # noqa: E402
from turnkv.attention.selfcheck import error_ratio, tolerance  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
HEADS = 4 if CUDA else 1  # head-count multiplier
LEN = 64 if CUDA else 1  # length multiplier (0 and 1 stay 0 and 1: empty and one-row views)


def _len(n: int) -> int:
    return n if n <= 1 else n * LEN + (3 if CUDA else 0)


def make_views(hkv: int, lengths: list[int], d: int, dtype=torch.bfloat16, seed: int = 0):
    """Strided views, as a segment tensor [L, Hkv, cap, D] sliced at one layer and its first n rows."""
    g = torch.Generator().manual_seed(seed)
    views = []
    for i, n in enumerate(lengths):
        cap = n + 8 * (i % 3 + 1)
        k = torch.randn(2, hkv, cap, d, generator=g).to(DEVICE, dtype)
        v = torch.randn(2, hkv, cap, d, generator=g).to(DEVICE, dtype)
        views.append((k[1, :, :n], v[1, :, :n]))
    return views


def make_q(hq: int, m: int, d: int, dtype=torch.bfloat16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hq, m, d, generator=g).to(DEVICE, dtype)


def assert_within(out: torch.Tensor, q, views, scale, window_start=None) -> float:
    ref = reference_attention(q, views, scale, window_start)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    ratio = error_ratio(out, ref, tolerance(q, views, scale, ref, window_start))
    assert ratio <= 1.0, f"error {ratio:.3f}x the tolerance"
    return ratio


def run(q, views, splits=None, window_start=None):
    """The kernel over one sequence; ``splits`` forces the split count (exercises the combine pass)."""
    hq, m, d = q.shape
    table = ts.build_table([views], m, None if window_start is None else [window_start])
    cfg = None
    if splits is not None:
        hkv = views[0][0].shape[0]
        cfg = ts.pick_config(1, hkv, hq // hkv, m, d, table.max_keys, table.groups, q.device)
        cfg = cfg._replace(splits=splits)
    return ts.segment_attention(q.unsqueeze(0), table, d**-0.5, cfg)[0]


# (view lengths before the window, rows, GQA group, head_dim, dtype): covers 1/3/12/13 views with
# empty and one-row views, 1/5/9/32 rows, GQA 1/2/4/8, head_dim 64/128, bf16 and fp16.
CASES = [
    ([], 1, 1, 64, torch.bfloat16),
    ([], 32, 8, 128, torch.bfloat16),
    ([0, 1], 5, 2, 64, torch.bfloat16),
    ([9, 0], 9, 4, 128, torch.float16),
    ([1, 7, 0, 1, 5, 2, 0, 3, 4, 1, 6], 1, 4, 64, torch.bfloat16),
    ([2, 0, 5, 1, 3, 1, 4, 0, 2, 6, 1], 32, 2, 64, torch.bfloat16),
    ([3, 1, 0, 4, 2, 1, 5, 0, 1, 2, 3, 1], 9, 8, 64, torch.bfloat16),
    ([1] * 12, 5, 1, 128, torch.float16),
]


@pytest.mark.parametrize(("lengths", "m", "gqa", "d", "dtype"), CASES)
def test_matches_reference(lengths, m, gqa, d, dtype):
    hkv = 2 * HEADS
    lengths = [_len(n) for n in lengths] + [_len(5) + m]  # the last view ends with the window's rows
    views = make_views(hkv, lengths, d, dtype)
    q = make_q(hkv * gqa, m, d, dtype)
    assert_within(run(q, views), q, views, d**-0.5)
    assert_within(run(q, views, splits=3), q, views, d**-0.5)


def test_one_view_is_bit_identical_to_one_contiguous_buffer():
    hkv, d, m = 2 * HEADS, 64, 5
    views = make_views(hkv, [_len(40)], d)
    contiguous = [(k.contiguous(), v.contiguous()) for k, v in views]
    assert views[0][0].stride() != contiguous[0][0].stride()  # a genuinely strided view
    q = make_q(4 * hkv, m, d)
    for splits in (None, 1, 3):
        assert torch.equal(run(q, views, splits), run(q, contiguous, splits))


def test_thirteen_views_form_two_groups_merged_by_the_combine():
    hkv, d, m = HEADS, 64, 4
    lengths = [_len(n) for n in [3, 0, 1, 4, 2, 5, 1, 3, 2, 0, 6, 1, 2]] + [m]
    views = make_views(hkv, lengths, d)
    table = ts.build_table([views], m)
    assert table.groups == 2 and table.packed.shape == (1, 2, ts.MAX_SEGMENTS + 1, ts.FIELDS)
    q = make_q(4 * hkv, m, d)
    assert_within(run(q, views), q, views, d**-0.5)


def test_batch_of_three_with_different_views_and_window_rows():
    hkv, gqa, d, m = 2 * HEADS, 4, 64, 9
    q_lens = [9, 1, 5]  # rows past a sequence's q_len are batch padding and come out zero
    seqs = [
        make_views(hkv, [_len(n) for n in [7, 0, 3]] + [q_lens[0]], d, seed=10),
        make_views(hkv, [_len(20) + q_lens[1]], d, seed=11),
        make_views(hkv, [_len(n) for n in [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2]] + [q_lens[2]], d, seed=12),
    ]
    q = torch.stack([make_q(hkv * gqa, m, d, seed=20 + b) for b in range(3)])  # [B, Hq, M, D]
    table = ts.build_table(seqs, q_lens)
    assert table.groups == 2  # the 14-view sequence sets the group count for the batch
    out = ts.segment_attention(q, table, d**-0.5)
    for b, views in enumerate(seqs):
        n = q_lens[b]
        assert_within(out[b, :, :n], q[b, :, :n], views, d**-0.5)
        assert (out[b, :, n:] == 0).all()


@pytest.mark.parametrize("splits", [None, 4])
def test_rows_that_see_no_key_are_zero_not_nan(splits):
    hkv, d, m = HEADS, 64, 9
    views = make_views(hkv, [0, _len(3), 1], d)  # 3*LEN + ... keys in all
    ws = -4  # rows 0..3 see nothing; row 4 sees key 0 only
    q = make_q(2 * hkv, m, d)
    out = run(q, views, splits, window_start=ws)
    assert torch.isfinite(out).all()
    assert (out[:, :4] == 0).all()
    assert_within(out, q, views, d**-0.5, window_start=ws)
    # a window with no keys at all
    empty = make_views(hkv, [0, 0], d)
    assert (run(q, empty, splits, window_start=-m) == 0).all()


def test_prefill_window_is_tiled_over_rows():
    # 3 heads x 40 rows = 120 rows; with 64-row blocks a block straddles two query heads
    hkv, gqa, d, m = HEADS, 3, 64, 40
    views = make_views(hkv, [_len(30), 0, _len(7) + m], d)
    q = make_q(hkv * gqa, m, d)
    hq = hkv * gqa
    table = ts.build_table([views], m)
    cfg = ts.pick_config(1, hkv, gqa, m, d, table.max_keys, table.groups, q.device)._replace(block_m=64)
    out = ts.segment_attention(q.unsqueeze(0), table, d**-0.5, cfg)[0]
    assert out.shape == (hq, m, d)
    assert_within(out, q, views, d**-0.5)


def test_table_update_in_place_matches_a_fresh_table():
    hkv, d, m = HEADS, 64, 1
    views = make_views(hkv, [_len(10), 1, _len(4) + m], d)
    q = make_q(4 * hkv, m, d)
    table = ts.build_table([views[:2]], m)  # one decode step earlier: a shorter history
    buffer = table.packed
    table.update_([views], m)
    assert table.packed is buffer and table.max_keys == sum(k.shape[1] for k, _ in views)
    out = ts.segment_attention(q.unsqueeze(0), table, d**-0.5)[0]
    assert torch.equal(out, run(q, views))


def test_router_takes_the_fused_route_and_counts_it():
    hkv, d, m = HEADS, 128, 5
    views = make_views(hkv, [_len(6), 0, _len(3) + m], d)
    q = make_q(4 * hkv, m, d)
    router = AttentionRouter(Verdict("fused", "ok", "test"), ts.fused_attention)
    out = router.attend(q, views, d**-0.5)
    assert router.route_counts == {"fused_q5": 1}
    assert_within(out, q, views, d**-0.5)


def test_unaligned_views_fall_back_to_lse(caplog):
    hkv, d, m = HEADS, 64, 2
    views = make_views(hkv, [_len(5), _len(3) + m], d)
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(hkv, _len(4), d + 1, generator=g).to(DEVICE, torch.bfloat16)
    odd = (raw[:, :, 1:], raw[:, :, 1:])  # last dim contiguous, but rows start off a 16-byte boundary
    with pytest.raises(ts.UnsupportedViews):
        ts.build_table([[*views, odd]], m)
    q = make_q(2 * hkv, m, d)
    with caplog.at_level(logging.WARNING):
        out = ts.fused_attention(q, [views[0], odd, views[1]], d**-0.5)
    assert "lse route" in caplog.text
    assert_within(out, q, [views[0], odd, views[1]], d**-0.5)


def test_shapes_outside_the_kernel_are_refused():
    views = make_views(1, [4], 64)
    table = ts.build_table([views], 1)
    with pytest.raises(ValueError):
        ts.segment_attention(make_q(9, 1, 64).unsqueeze(0), table, 0.125)  # GQA 9
    with pytest.raises(ts.UnsupportedViews):
        ts.build_table([make_views(1, [4], 64, dtype=torch.float32)], 1)


def test_causal_edge_on_tile_boundaries():
    # windows whose diagonal ends exactly on, just before and just after a key tile: the kernel
    # skips the mask on whole tiles every row sees, so an off-by-one there shows up only here
    hkv, d = HEADS, 64
    bn = ts.pick_config(1, hkv, 2, 1, d, 1, 1, DEVICE).block_n
    for m in (2, 3):
        for first in (0, 5):  # the last view starts at key 0 or 5; tiles are counted from there
            for delta in (-1, 0, 1):  # row 0's last visible key ends a tile, or one before/after
                t = first + bn + m - 1 + delta
                views = make_views(hkv, [first, t - first], d, seed=t + m)
                q = make_q(2 * hkv, m, d, seed=m)
                assert_within(run(q, views), q, views, d**-0.5)


def test_custom_op_matches_the_eager_path():
    hkv, d, m = HEADS, 64, 3
    views = make_views(hkv, [_len(7), 0, _len(2) + m], d)
    q = make_q(2 * hkv, m, d)
    ks, vs = [k for k, _ in views], [v for _, v in views]
    assert torch.equal(
        torch.ops.turnkv.segment_attention(q, ks, vs, d**-0.5), ts.fused_attention(q, views, d**-0.5)
    )


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_cuda_graph_replays_a_decode_step_after_the_table_is_rewritten():
    hkv, gqa, d = 8, 4, 128
    views = make_views(hkv, [_len(50), _len(9)], d) + make_views(hkv, [_len(20)], d, seed=5)  # last: the tail
    tail_k, tail_v = views[-1][0]._base[1], views[-1][1]._base[1]  # [Hkv, cap, D]: room to grow
    q = make_q(hkv * gqa, 1, d).unsqueeze(0)
    table = ts.build_table([views], 1)
    cfg = ts.pick_config(1, hkv, gqa, 1, d, 4 * table.max_keys, table.groups, q.device)  # fixed grid
    out = ts.segment_attention(q, table, d**-0.5, cfg)  # warm up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ts.segment_attention(q, table, d**-0.5, cfg, out=out)
    for grow in (1, 2, 7):  # decode steps: the tail grows, the table is rewritten in place
        n = views[-1][0].shape[1] + grow
        grown = [*views[:-1], (tail_k[:, :n], tail_v[:, :n])]
        table.update_([grown], 1)
        q.normal_()
        graph.replay()
        assert torch.equal(out, ts.segment_attention(q, ts.build_table([grown], 1), d**-0.5, cfg))
        assert_within(out[0], q[0], grown, d**-0.5)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_the_router_callable_refuses_a_graph_capture():
    views = make_views(2, [_len(9), _len(3)], 64)
    q = make_q(4, 1, 64)
    ts.fused_attention(q, views, 0.125)
    with pytest.raises(RuntimeError, match="capture"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        ts.fused_attention(q, views, 0.125)

"""The fused kernels (turnkv/attention/triton_segments.py, fused.py) against the fp32 oracle.

CI runs it through Triton's CPU interpreter (TRITON_INTERPRET=1) at small shapes; on a CUDA machine
the same tests run compiled at real shapes (head counts x4, lengths x64, so splits, row blocks and
view boundaries fall inside tiles). Tolerance (selfcheck.tolerance, per element):
``|out - ref| <= u * (|ref| + A) + 2**-16 * A`` with ``u`` the dtype's unit roundoff (2**-8 bf16)
and ``A`` the attention over ``|v|``: one final rounding plus the rounding of the probabilities to
the input dtype before P·V. A one-key error or an off-by-one mask is far outside it.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

from turnkv.attention import triton_segments as ts  # noqa: E402
from turnkv.attention.fused import FusedBackend  # noqa: E402
from turnkv.attention.reference import reference_attention  # noqa: E402
from turnkv.attention.routes import Path  # noqa: E402
from turnkv.attention.segment_table import (  # noqa: E402
    UnsupportedViews,
    key_bucket,
    mixed_batch,
    pack,
    padded_batch,
    row_bucket,
    upload,
)
from turnkv.attention.selfcheck import error_ratio, tolerance  # noqa: E402
from turnkv.attention.verdict import Verdict  # noqa: E402
from turnkv.kv.cache import KVWindow  # noqa: E402
from turnkv.limits import MAX_SEGMENTS  # noqa: E402

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
    return ts.fused_attention(q, views, q.shape[-1] ** -0.5, window_start, splits)


def window4(hkv: int, lengths: list[int], m: int, d: int, seed: int, layers: int = 3) -> KVWindow:
    """A KV window over all-layer views ``[L, Hkv, T_i, D]`` (strided slices of bigger buffers);
    the last view ends with the window's ``m`` rows."""
    g = torch.Generator().manual_seed(seed)
    views = []
    for i, n in enumerate([*lengths[:-1], lengths[-1] + m]):
        kv = torch.randn(2, layers, hkv, n + 8 * (i % 3 + 1), d, generator=g).to(DEVICE, torch.bfloat16)
        views.append((kv[0, :, :, :n], kv[1, :, :, :n]))
    return KVWindow(tuple(views), sum(lengths), m)


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
    _, meta = pack([[(k[None], v[None]) for k, v in views]], [m])
    assert meta.groups == 2 and meta.table_words == 2 * (MAX_SEGMENTS + 1) * 8
    q = make_q(4 * hkv, m, d)
    assert_within(run(q, views), q, views, d**-0.5)


@pytest.mark.parametrize("layer", [0, 2])
def test_a_ragged_step_stores_and_attends_every_window_at_its_layer(layer):
    # one plan for a decode row, a verify window and a prefill chunk (two launches: narrow, wide),
    # one of them over 14 views (two groups); every layer reads the same table at its stride
    hkv, gqa, d = 2 * HEADS, 4, 64
    shapes = [([_len(n) for n in [7, 0, 3]], 1), ([_len(20)], 5), ([_len(1)] * 13, 40)]
    windows = [window4(hkv, lengths, m, d, seed=10 + i) for i, (lengths, m) in enumerate(shapes)]
    n = sum(w.rows for w in windows)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n, hkv * gqa, d, generator=g).to(DEVICE, torch.bfloat16)
    k, v = torch.randn(2, n, hkv, d, generator=g).to(DEVICE, torch.bfloat16)
    step = FusedBackend(Verdict(), hkv * gqa, hkv).plan(windows)
    assert len(step.launches) == 2
    assert [r.label for r in step.routes] == ["fused_q1", "fused_q5", "fused_prefill"]
    assert [r.path for r in step.routes] == [Path.FUSED_NARROW] * 2 + [Path.FUSED_WIDE]
    step.store(layer, k, v)
    out = step.attend(layer, q, d**-0.5)
    start = 0
    for w in windows:
        rows = slice(start, start + w.rows)
        views = w.layer_views(layer)
        assert torch.equal(views[-1][0][:, -w.rows :], k[rows].transpose(0, 1))
        assert torch.equal(views[-1][1][:, -w.rows :], v[rows].transpose(0, 1))
        assert_within(out[rows].transpose(0, 1), q[rows].transpose(0, 1), views, d**-0.5)
        start += w.rows
    other = (layer + 1) % 3  # nothing was stored into another layer
    assert not torch.equal(windows[0].layer_views(other)[-1][0][:, -1:], k[:1].transpose(0, 1))


def test_padding_sequences_are_neither_read_nor_written():
    # a graph-style plan: padded to 4 sequences, into a static buffer; padding rows keep their bits
    hkv, gqa, d = HEADS, 2, 64
    windows = [window4(hkv, [_len(9), 2], 1, d, seed=s) for s in (1, 2)]
    backend = FusedBackend(Verdict(), hkv * gqa, hkv, d, DEVICE)
    static = backend.graph_table(4)
    assert static.numel() == 4 * (MAX_SEGMENTS + 2) * 8
    launch = backend.decode_launch(windows)._replace(batch=4, keys=8192)
    step = backend.plan(windows, launch, out=static)
    assert step.packed.data_ptr() == static.data_ptr()
    q = torch.randn(4, hkv * gqa, d).to(DEVICE, torch.bfloat16)
    k, v = torch.randn(2, 4, hkv, d).to(DEVICE, torch.bfloat16)
    step.store(1, k, v)
    out = torch.full_like(q, 3.0)
    ts.segment_attention(q, step.packed, step.launches[0].meta, 1, d**-0.5, step.launches[0].config, out=out)
    assert (out[2:] == 3.0).all()
    fresh = FusedBackend(Verdict(), hkv * gqa, hkv).plan(windows)
    assert torch.equal(out[:2], fresh.attend(1, q[:2], d**-0.5))


def test_a_mixed_launch_pads_rows_and_sequences_and_attends_the_real_rows_alike():
    # a step with prompt rows captured whole (engine.graphs): each table padded to its batch, its
    # grid sized for 32 rows (narrow) or the step's row bucket (wide), the step's rows padded to
    # that bucket; the real rows store and attend as the oracle says, and no padding row is written
    hkv, gqa, d, layer = HEADS, 4, 64, 1
    shapes = [([_len(7), 0], 1), ([_len(3)], 1), ([_len(20)], 40), ([_len(2)], 3), ([_len(5)], 33)]
    windows = [window4(hkv, lengths, m, d, seed=20 + i) for i, (lengths, m) in enumerate(shapes)]
    backend = FusedBackend(Verdict(), hkv * gqa, hkv, d, DEVICE)
    launch = backend.mixed_launch(windows)
    assert (launch.narrow.batch, launch.narrow.rows) == (mixed_batch(3), 32)
    n = sum(w.rows for w in windows)
    np_ = row_bucket(n)
    assert (launch.wide.batch, launch.wide.rows) == (
        mixed_batch(2),
        np_,
    )  # the step's rows, not its widest chunk's
    assert np_ > row_bucket(40)
    step = backend.plan(windows, launch, out=backend.graph_table(launch.batch))
    assert [lc.meta.batch for lc in step.launches] == [launch.narrow.batch, launch.wide.batch]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(np_, hkv * gqa, d, generator=g).to(DEVICE, torch.bfloat16)
    k, v = torch.randn(2, np_, hkv, d, generator=g).to(DEVICE, torch.bfloat16)
    step.store(layer, k, v)
    out = torch.full_like(q, 3.0)
    for table, lc in zip(step._tables, step.launches, strict=True):
        ts.segment_attention(q, table, lc.meta, layer, d**-0.5, lc.config, out=out)
    assert (out[n:] == 3.0).all()
    start = 0
    for w in windows:
        rows = slice(start, start + w.rows)
        views = w.layer_views(layer)
        assert torch.equal(views[-1][0][:, -w.rows :], k[rows].transpose(0, 1))
        assert_within(out[rows].transpose(0, 1), q[rows].transpose(0, 1), views, d**-0.5)
        start += w.rows
    many = window4(hkv, [1] * (MAX_SEGMENTS + 1), 40, d, seed=4)  # two segment groups: eager
    assert backend.mixed_launch([*windows, many]) is None


@pytest.mark.parametrize("count", [1, 3, 8])
def test_a_tables_split_count_below_its_grids_room_attends_as_a_launch_sized_for_it(count):
    # a CUDA graph's grid has room for the most splits any context could ask (``table_launch``);
    # the step's own count rides in the table (header word 6) and the programs past it read and
    # write nothing: the rows come out as the oracle says, and (the interpreter sums partials in
    # order, so the unused ones add exact zeros) as a launch sized for that count, bit for bit
    hkv, gqa, d, m = HEADS, 2, 64, 5
    views = make_views(hkv, [_len(40), _len(9), 1], d, seed=count)
    q = make_q(gqa * hkv, m, d, seed=count)
    views4 = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in views]
    flat = q.transpose(0, 1)
    outs = {}
    for room, written in ((8, count), (count, 0)):
        words, meta = pack([views4], [m], splits=written)
        cfg = ts.pick_config(meta, gqa, q.device)._replace(splits=room)
        outs[room] = ts.segment_attention(flat, upload(words, q.device), meta, 0, d**-0.5, cfg)
        assert_within(outs[room].transpose(0, 1), q, views, d**-0.5)
    if not CUDA:
        assert torch.equal(outs[8], outs[count])


def test_a_mixed_launch_is_one_at_every_context_and_its_table_carries_the_split_count():
    # the graph key of a mixed step (``MixedLaunch``) holds no context: a short and a long
    # history give the same launch, and each plan writes its own split count into the table
    hkv, gqa, d, layer = HEADS, 4, 64, 1
    backend = FusedBackend(Verdict(), hkv * gqa, hkv, d, DEVICE)
    steps = {}
    for history in (_len(30), 9000):
        windows = [window4(hkv, [history], 1, d, seed=1), window4(hkv, [_len(3)], 40, d, seed=2)]
        launch = backend.mixed_launch(windows)
        step = backend.plan(windows, launch, out=backend.graph_table(launch.batch))
        steps[history] = (windows, launch, step)
    (short, a, sa), (long, b, sb) = steps.values()
    assert a == b
    rooms = [t.config.splits for t in a]
    counts = [[backend.table_splits([w], t)] for w, t in zip((short[0], short[1]), a, strict=True)]
    counts_long = [[backend.table_splits([w], t)] for w, t in zip((long[0], long[1]), a, strict=True)]
    assert all(c[0] <= r for c, r in zip(counts + counts_long, rooms * 2, strict=True))
    assert counts[0] != counts_long[0]  # the decode row's count follows its key bucket
    for windows, step, want in ((short, sa, counts), (long, sb, counts_long)):
        headers = [int(step.packed[lc.offset + 6]) for lc in step.launches]
        assert headers == [c[0] for c in want]
        n = sum(w.rows for w in windows)
        g = torch.Generator().manual_seed(5)
        q = torch.randn(row_bucket(n), hkv * gqa, d, generator=g).to(DEVICE, torch.bfloat16)
        k, v = torch.randn(2, row_bucket(n), hkv, d, generator=g).to(DEVICE, torch.bfloat16)
        step.store(layer, k, v)
        out = step.attend(layer, q, d**-0.5)
        start = 0
        for w in windows:
            rows = slice(start, start + w.rows)
            assert_within(out[rows].transpose(0, 1), q[rows].transpose(0, 1), w.layer_views(layer), d**-0.5)
            start += w.rows


def _rows_of(hkv: int, d: int, history: int, rows: int, seed: int) -> list[KVWindow]:
    """``rows`` one-row windows of one conversation after ``history`` rows: a verify window as
    ``step.one_row_windows`` cuts it (every row over the same tail buffer)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 2, hkv, history + rows + 8, d, generator=g).to(DEVICE, torch.bfloat16)
    n = [history + i + 1 for i in range(rows)]
    return [KVWindow(((k[:, :, :t], v[:, :, :t]),), t - 1, 1) for t in n]


def test_a_decode_launch_is_what_the_eager_step_launches():
    # the split-count invariant's one owner: a graph's key and table (``decode_launch``) and an
    # eager step of the same one-row windows split alike, sized by conversations, not windows
    hkv, gqa, d = HEADS, 4, 64
    backend = FusedBackend(Verdict(), hkv * gqa, hkv, d, DEVICE)
    windows = _rows_of(hkv, d, 9, 3, 0) + _rows_of(hkv, d, 4100, 1, 1) + _rows_of(hkv, d, 30, 2, 2)
    launch = backend.decode_launch(windows)
    assert (launch.batch, launch.keys) == (padded_batch(6), key_bucket(4101))
    assert launch.splits == ts.decode_splits(3, launch.keys, hkv, gqa, d, DEVICE)
    eager = backend.plan(windows)
    assert [lc.config.splits for lc in eager.launches] == [launch.splits]
    graph = backend.plan(windows, launch, out=backend.graph_table(launch.batch))
    assert graph.launches[0].config == eager.launches[0].config
    assert graph.launches[0].meta.batch == launch.batch
    many = window4(hkv, [1] * (MAX_SEGMENTS + 1), 1, d, seed=4)  # two segment groups: no graph
    assert len(many.views) == MAX_SEGMENTS + 1 and backend.decode_launch([many]) is None


@pytest.mark.parametrize("start", [0, 100, 4064, 4090, 4095, 4096, 8190])
def test_a_verify_window_stays_within_its_first_rows_key_bucket(start):
    n = FusedBackend(Verdict(), 4, 1, 64, DEVICE).verify_rows(start)
    assert 1 <= n <= 32
    assert all(key_bucket(start + i + 1) == key_bucket(start + 1) for i in range(n))
    assert n == 32 or key_bucket(start + n + 1) != key_bucket(start + 1)  # as many as fit


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
    words, meta = pack([[(k[None], vv[None]) for k, vv in views]], [m])
    cfg = ts.pick_config(meta, gqa, q.device)._replace(block_m=64)
    out = ts.segment_attention(q.transpose(0, 1), upload(words, q.device), meta, 0, d**-0.5, cfg)
    out = out.transpose(0, 1)
    assert out.shape == (hq, m, d)
    assert_within(out, q, views, d**-0.5)


def test_unaligned_views_are_refused():
    hkv, d, m = HEADS, 64, 2
    views = make_views(hkv, [_len(5), _len(3) + m], d)
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(hkv, _len(4), d + 1, generator=g).to(DEVICE, torch.bfloat16)
    odd = (raw[:, :, 1:], raw[:, :, 1:])  # last dim contiguous, but rows start off a 16-byte boundary
    with pytest.raises(UnsupportedViews):
        pack([[(k[None], v[None]) for k, v in [*views, odd]]], [m])


def test_shapes_outside_the_kernel_are_refused():
    views = make_views(1, [4], 64)
    with pytest.raises(ValueError):
        ts.fused_attention(make_q(9, 1, 64), views, 0.125)  # GQA 9
    with pytest.raises(UnsupportedViews):
        pack([[(k[None], v[None]) for k, v in make_views(1, [4], 64, dtype=torch.float32)]], [1])


def test_causal_edge_on_tile_boundaries():
    # windows whose diagonal ends exactly on, just before and just after a key tile: the kernel
    # skips the mask on whole tiles every row sees, so an off-by-one there shows up only here
    hkv, d = HEADS, 64
    _, meta = pack([[(k[None], v[None]) for k, v in make_views(hkv, [1], d)]], [1])
    bn = ts.pick_config(meta, 2, DEVICE).block_n
    for m in (2, 3):
        for first in (0, 5):  # the last view starts at key 0 or 5; tiles are counted from there
            for delta in (-1, 0, 1):  # row 0's last visible key ends a tile, or one before/after
                t = first + bn + m - 1 + delta
                views = make_views(hkv, [first, t - first], d, seed=t + m)
                q = make_q(2 * hkv, m, d, seed=m)
                assert_within(run(q, views), q, views, d**-0.5)


def test_rope_store_equals_rope_then_store_bit_for_bit():
    # the fused RoPE + store kernel against the portable backend's torch RoPE and per-window store
    from turnkv.attention.portable import PortableBackend

    hkv, gqa, d = HEADS, 4, 64
    shapes = [([_len(9)], 1), ([_len(3), 2], 7)]
    fused_w = [window4(hkv, lengths, m, d, seed=40 + i) for i, (lengths, m) in enumerate(shapes)]
    plain_w = [window4(hkv, lengths, m, d, seed=40 + i) for i, (lengths, m) in enumerate(shapes)]
    n = sum(w.rows for w in fused_w)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(n, hkv * gqa + 2 * hkv, d, generator=g).to(DEVICE, torch.bfloat16)
    qk, v = qkv[:, : hkv * (gqa + 1)], qkv[:, hkv * (gqa + 1) :]  # strided views, as the model has
    angles = torch.randn(n, d // 2, generator=g)
    cos = torch.cat([angles.cos()] * 2, -1).to(DEVICE, torch.bfloat16)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(DEVICE, torch.bfloat16)
    q1 = FusedBackend(Verdict(), hkv * gqa, hkv).plan(fused_w).rope_store(2, qk, v, cos, sin)
    q2 = PortableBackend(Verdict(), torch.bfloat16).plan(plain_w).rope_store(2, qk, v, cos, sin)
    assert torch.equal(q1, q2)
    for a, b in zip(fused_w, plain_w, strict=True):
        for (ka, va), (kb, vb) in zip(a.views, b.views, strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)  # the same rows, written in place


def test_silu_mul_kernel_rounds_as_torch_does():
    from turnkv.models.triton_pointwise import silu_mul

    x = torch.randn(5, 2 * 300).to(DEVICE, torch.bfloat16)
    gate, up = x.chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_mul(x)
    assert got.shape == (5, 300)
    assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()


def test_rms_norm_kernel_matches_torch_within_one_rounding():
    from turnkv.models.triton_pointwise import rms_norm

    x = torch.randn(3, 576).to(DEVICE, torch.bfloat16)
    w = torch.randn(576).to(DEVICE, torch.bfloat16)
    want = torch.nn.functional.rms_norm(x.float(), (576,), w.float(), 1e-5)
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()  # one bf16 rounding

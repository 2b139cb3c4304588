"""``--deterministic on``'s attention pieces (turnkv/attention/triton_segments.py ``fixed_config``):
a row's keys are cut at the fixed positions 0, PIECE_KEYS, 2 * PIECE_KEYS, ... of its own sequence
and the pieces merged in order, so its output is the same bits whether the launch runs one piece a
program (the combine kernel merging, over a grid of any size: pieces past the row's keys are
empty) or one program per row block merging them all itself; whether the row is decoded or sits in
a prefill window; and whatever padding sequences share the table. And it is attention (the fp32
oracle's tolerance). Bits, not a tolerance: ``torch.equal``.

CI runs it through Triton's CPU interpreter (TRITON_INTERPRET=1), which proves the arithmetic and
the piece bookkeeping but not the GPU's bits (its ``tl.dot`` is numpy); on a CUDA device the same
tests run compiled, and prove both.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

from test_triton_segments import DEVICE, HEADS, assert_within, make_q, make_views  # noqa: E402

from turnkv.attention import triton_segments as ts  # noqa: E402
from turnkv.attention.segment_table import TableMeta, key_bucket, pack, padded_batch, upload  # noqa: E402
from turnkv.limits import MAX_SEGMENTS  # noqa: E402

P = ts.PIECE_KEYS
HKV, GQA, D = HEADS, 2, 64


def attend(q, views, splits: int, window_start=None, pad_to=None) -> torch.Tensor:
    """q ``[Hq, M, D]`` over one sequence's views with the deterministic tiles and ``splits``
    programs per group (1: one program per row block merges every piece)."""
    _, m, d = q.shape
    words, meta = pack(
        [[(k.unsqueeze(0), v.unsqueeze(0)) for k, v in views]],
        [m],
        None if window_start is None else [window_start],
        pad_to=pad_to,
    )
    cfg = ts.fixed_config(1, HKV, GQA, m, meta.max_keys, d, meta.groups, DEVICE)._replace(splits=splits)
    out = ts.segment_attention(q.transpose(0, 1), upload(words, q.device), meta, 0, d**-0.5, cfg)
    return out.transpose(0, 1)


def views_of(lengths: list[int], seed: int):
    return make_views(HKV, lengths, D, seed=seed)


# views whose bounds fall before, on and across piece boundaries; the last: two segment groups
LENGTHS = st.one_of(
    st.lists(st.integers(0, 2 * P + 40), min_size=1, max_size=3),
    st.just([P - 3, 7, P + 1]),
    st.just([30] * (MAX_SEGMENTS + 1)),
)


@settings(max_examples=4 if not CUDA else 40, deadline=None, suppress_health_check=list(HealthCheck))
@given(LENGTHS, st.sampled_from([1, 3, 20]), st.integers(0, 2**16), st.integers(1, 5))
def test_a_rows_bits_do_not_depend_on_where_its_pieces_run(lengths, m, seed, extra):
    views = views_of([*lengths[:-1], lengths[-1] + m], seed)
    keys = sum(k.shape[1] for k, _ in views)
    q = make_q(HKV * GQA, m, D, seed=seed)
    pieces = -(-keys // P)
    walked = attend(q, views, 1)  # one program per row block, merging in the kernel
    assert_within(walked, q, views, D**-0.5)
    if pieces > 1:
        assert torch.equal(attend(q, views, pieces), walked)  # a program a piece, the combine merging
    assert torch.equal(attend(q, views, pieces + extra), walked)  # a grid past the keys: empty pieces
    assert torch.equal(attend(q, views, pieces + extra, pad_to=padded_batch(2) + extra), walked)


@settings(max_examples=3 if not CUDA else 20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(2, 3 * P), st.integers(2, 40), st.integers(0, 2**16))
def test_a_prefill_rows_bits_are_its_decode_rows(history, m, seed):
    """Row i of a prefill window (keys up to its own position) is the same bits as that row decoded
    over the same keys: the window's launch walks every piece in one program (``splits`` 1), the
    decode row's runs a program a piece and the combine kernel."""
    views = views_of([history, m], seed)
    q = make_q(HKV * GQA, m, D, seed=seed)
    prefill = attend(q, views, 1)
    for i in sorted({0, m // 2, m - 1}):
        seen = history + i + 1  # keys row i sees: the first view and i + 1 rows of the second
        row_views = [views[0], (views[1][0][:, : i + 1], views[1][1][:, : i + 1])]
        decoded = attend(q[:, i : i + 1].contiguous(), row_views, -(-seen // P) + 1)
        assert torch.equal(decoded[:, 0], prefill[:, i]), (i, seen)


def test_rows_that_see_no_key_are_zero_in_both_launches():
    views = views_of([0, P + 5, 3], 0)
    q = make_q(HKV * GQA, 9, D)
    for splits in (1, 2, 4):
        out = attend(q, views, splits, window_start=-4)  # rows 0..3 see nothing
        assert torch.isfinite(out).all() and (out[:, :4] == 0).all()
        assert_within(out, q, views, D**-0.5, window_start=-4)


@pytest.mark.parametrize("batch", [1, 2, 8, 32, 64])
@pytest.mark.parametrize("keys", [1, P, P + 1, 2048, 32768, 131072])
@pytest.mark.parametrize(("max_q", "groups"), [(1, 1), (1, 2), (32, 1), (512, 1)])
def test_a_deterministic_launch_is_a_program_a_piece_or_a_program_a_row_block(batch, keys, max_q, groups):
    """The grid is the launch's choice (a row's bits are not): one program a piece while the row
    blocks alone would not fill the SMs and the partials fit ``PARTIAL_BYTES``, else one a row
    block; the tiles and the piece never change. A decode graph's split count is the same rule
    at its padded batch and key bucket."""
    meta = TableMeta(batch, groups, keys, max_q, 8, 128, torch.bfloat16)
    cfg = ts.pick_config(meta, 4, DEVICE, conversations=batch, fixed=True)
    assert (cfg.block_m, cfg.piece, cfg.block_n) == (16, P, ts._TUNED[(16, 128)][0])
    pieces = -(-keys // P)
    programs = batch * 8 * -(-4 * max_q // 16)
    partials = batch * 32 * max_q * groups * pieces * 129 * 4
    want = pieces if programs < ts._num_sms(DEVICE) and partials <= ts.PARTIAL_BYTES else 1
    assert cfg.splits == want
    got = ts.decode_splits(batch, keys, 8, 4, 128, DEVICE, groups, fixed=True)
    assert got == ts.fixed_config(padded_batch(batch), 8, 4, 1, key_bucket(keys), 128, groups, DEVICE).splits

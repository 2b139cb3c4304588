"""The attention kernel variants compiled before ready (``attention/triton_variants.py``): every
launch config the planner can give a table (any batch, rows, keys, groups, and the split counts
graphs and decode steps put in) compiles a variant of that list, and each variant computes the
attention (Triton's interpreter in CI, compiled on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from turnkv.attention import triton_segments as ts
from turnkv.attention.reference import reference_attention
from turnkv.attention.segment_table import TableMeta, pack, upload
from turnkv.attention.selfcheck import error_ratio, tolerance
from turnkv.attention.triton_variants import variant_of, variants
from turnkv.limits import MAX_GQA, SUPPORTED_HEAD_DIMS

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


@settings(max_examples=300, deadline=None)
@given(
    gqa=st.integers(1, MAX_GQA),
    head_dim=st.sampled_from(SUPPORTED_HEAD_DIMS),
    fixed=st.booleans(),
    batch=st.integers(1, 64),
    groups=st.integers(1, 4),
    max_q=st.integers(1, 8192),
    keys=st.integers(1, 70000),
    conversations=st.integers(0, 64),
    splits=st.one_of(st.none(), st.integers(1, 128)),
)
def test_every_planned_launch_compiles_a_listed_variant(
    gqa, head_dim, fixed, batch, groups, max_q, keys, conversations, splits
):
    meta = TableMeta(batch, groups, keys, max_q, 8, head_dim, torch.bfloat16)
    config = ts.pick_config(meta, gqa, torch.device("cpu"), conversations=conversations, fixed=fixed)
    if splits is not None:  # a graph's room for splits, or the decode split count put in
        config = config._replace(splits=splits)
    listed = {variant_of(c, 1) for c in variants(gqa, head_dim, fixed)}
    assert variant_of(config, groups) in listed


def test_the_list_is_each_tile_choice_direct_and_combined():
    got = variants(4, 128, fixed=False)
    assert [(c.block_m, c.splits) for c in got] == [
        (16, 1),
        (16, 2),
        (32, 1),
        (32, 2),
        (64, 1),
        (64, 2),
        (128, 1),
        (128, 2),
    ]
    assert {variant_of(c, 1)[-1] for c in got} == {True, False}
    assert [(c.block_m, c.piece, c.splits) for c in variants(4, 128, fixed=True)] == [
        (16, ts.PIECE_KEYS, 1),
        (16, ts.PIECE_KEYS, 2),
    ]


@pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no CUDA, no interpreter")
@pytest.mark.parametrize("fixed", [False, True])
def test_each_variant_computes_the_attention(fixed):
    """The launch ``compile_all`` makes for each variant, checked against the fp32 reference."""
    hq, hkv, d, rows = 4, 2, 64, 8
    gen = torch.Generator().manual_seed(1)
    bf16 = torch.bfloat16
    views = [
        tuple(torch.randn(1, hkv, t, d, generator=gen).to(DEVICE, bf16) for _ in "kv") for t in (200, 100)
    ]
    words, meta = pack([views], [rows])
    packed = upload(words, DEVICE)
    q = torch.randn(rows, hq, d, generator=gen).to(DEVICE, bf16)  # [M, Hq, D]
    # causal over its own rows: the window's rows are the last ``rows`` keys
    views3 = [(k[0], v[0]) for k, v in views]
    ref = reference_attention(q.transpose(0, 1), views3, d**-0.5)
    tol = tolerance(q.transpose(0, 1), views3, d**-0.5, ref)
    for config in variants(hq // hkv, d, fixed):
        out = ts.segment_attention(q, packed, meta, 0, d**-0.5, config)
        assert error_ratio(out.transpose(0, 1).float(), ref, tol) <= 1.0, config

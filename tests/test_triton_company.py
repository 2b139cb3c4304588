"""``--deterministic on``'s fused attention (issue 33): every window's output is the same bits
alone in its step or beside any company, eager or planned as a CUDA graph's padded tables.

The company: decode rows over 0, 1 or several segments, one over more than ``MAX_SEGMENTS``
views (two segment groups, so the launch takes the partials-and-combine path and every one-group
row with it), verify windows and prefill chunks. The window under test is a decode row, a narrow
prompt window (it shares the narrow launch with the decode rows) or a prefill chunk, over views of
its own. Bits, not a tolerance: ``torch.equal``. Runs under TRITON_INTERPRET=1 on a CPU (small
shapes) and compiled on a GPU.
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

from test_triton_segments import DEVICE, HEADS, window4  # noqa: E402

from turnkv.attention.fused import FusedBackend  # noqa: E402
from turnkv.attention.verdict import Verdict  # noqa: E402
from turnkv.limits import MAX_SEGMENTS  # noqa: E402

HKV, GQA, D, LAYER = HEADS, 2, 64, 1

# (views before the window, rows): the kinds of windows a step holds
KINDS = {
    "decode-fresh": ([0], 1),
    "decode-one-segment": ([37, 0], 1),
    "decode-segments": ([5, 1, 300, 2], 1),  # keys over several key tiles: splits would cut them
    "decode-two-groups": ([3] * (MAX_SEGMENTS + 1), 1),
    "verify": ([20, 3], 6),
    "prompt-narrow": ([0], 17),
    "prompt-after-history": ([260, 150], 17),
    "prefill": ([9, 0], 40),
}


def _windows(kinds: list[str], seed: int):
    return [window4(HKV, *KINDS[k], D, seed=seed + i, layers=2) for i, k in enumerate(kinds)]


def _attend(backend: FusedBackend, windows, graph: bool) -> list[torch.Tensor]:
    """Each window's attention output rows in one step; ``graph``: planned as a CUDA graph of the
    step would be (tables padded to their batch, grids sized for their widest-window bucket)."""
    n = sum(w.rows for w in windows)
    q = torch.empty(n, HKV * GQA, D, dtype=torch.bfloat16, device=DEVICE)
    at = 0
    for w in windows:  # each window's queries the same wherever it sits
        g = torch.Generator().manual_seed(w.start * 31 + w.rows)
        q[at : at + w.rows] = torch.randn(w.rows, HKV * GQA, D, generator=g).to(DEVICE, torch.bfloat16)
        at += w.rows
    launch = backend.mixed_launch(windows) if graph else None
    if launch is None:
        step = backend.plan(windows)
    else:
        step = backend.plan(windows, launch, out=backend.graph_table(launch.batch))
    out = step.attend(LAYER, q, D**-0.5)
    rows, at = [], 0
    for w in windows:
        rows.append(out[at : at + w.rows])
        at += w.rows
    return rows


@settings(max_examples=6 if not CUDA else 40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from(["decode-fresh", "decode-segments", "prompt-narrow", "prompt-after-history", "prefill"]),
    st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=7),
    st.integers(0, 8),
    st.booleans(),
)
def test_every_windows_bits_are_its_own_in_any_company(own, company, place, graph):
    backend = FusedBackend(Verdict(), HKV * GQA, HKV, D, DEVICE, deterministic=True)
    windows = _windows([*company, own], seed=100)
    windows.insert(min(place, len(company)), windows.pop())  # the window under test, anywhere
    together = _attend(backend, windows, graph)
    for w, got in zip(windows, together, strict=True):  # every window: the tested one and company
        assert torch.equal(got, _attend(backend, [w], graph)[0])


def test_a_narrow_prompt_beside_seven_decode_rows_is_the_same_bits():
    """The lead's H200 case (a 17-row prompt among 7 decode rows with 0-90 rows of history), with
    a two-group companion besides: the narrow launch then merges partials for every row."""
    backend = FusedBackend(Verdict(), HKV * GQA, HKV, D, DEVICE, deterministic=True)
    kinds = ["prompt-narrow", "decode-fresh", "decode-one-segment", "decode-segments"] * 2
    for company in (kinds[:8], [*kinds[:7], "decode-two-groups"]):
        windows = _windows(company, seed=7)
        for graph in (False, True):
            together = _attend(backend, windows, graph)
            for w, got in zip(windows, together, strict=True):
                assert torch.equal(got, _attend(backend, [w], graph)[0])

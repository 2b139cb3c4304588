"""Stop strings and the sampler, without a model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnkv.engine.sampling import Sampler, SamplingParams
from turnkv.engine.stops import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out, hit = [], False
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit


def test_stop_string_split_across_pieces_is_cut_and_never_emitted():
    m = StopMatcher(["END"])
    assert m.push("hello E") == ("hello ", False)  # "E" could start "END": held back
    assert m.push("N") == ("", False)
    assert m.push("D and more") == ("", True)


def test_held_text_is_released_when_it_cannot_be_a_stop():
    m = StopMatcher(["END"])
    assert m.push("E") == ("", False)
    assert m.push("x") == ("Ex", False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="abEND ", max_size=4), max_size=12), st.sampled_from(["END", "ab", "b E"]))
def test_stop_matcher_equals_cutting_the_joined_text(pieces, stop):
    whole = "".join(pieces)
    text, hit = run([stop], pieces)
    if stop in whole:
        assert hit and text == whole[: whole.index(stop)]
    else:
        assert not hit and text == whole


def test_greedy_takes_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams())(logits) == 1


def test_seeded_sampling_repeats_and_top_k_top_p_restrict():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7)
    a = [Sampler(p)(logits) for _ in range(3)]
    s = Sampler(p)
    b = [s(logits) for _ in range(20)]
    assert a == [b[0]] * 3  # a fresh sampler with the same seed draws the same first token
    top3 = set(torch.topk(logits, 3).indices.tolist())
    s = Sampler(SamplingParams(temperature=2.0, top_k=3, seed=1))
    assert {s(logits) for _ in range(200)} <= top3
    s = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=1))
    assert {s(logits) for _ in range(50)} == {int(torch.argmax(logits))}


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}])
def test_invalid_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)

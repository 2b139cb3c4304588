"""The sampler at its limits and OpenAI's logit_bias (issue 7, items 6 and 7), without a model.

Before: temperature <= ~1e-38 divided the maximum logit to ``inf`` and top_p <= ~1e-45 dropped every
token; both made NaN probabilities and ``torch.multinomial`` raised (HTTP 500, or HTTP 200 and an
error event when streaming). A seed outside [-2**63, 2**64) raised in ``manual_seed``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnkv.engine.sampling import (
    SEED_MAX,
    SEED_MIN,
    Sampler,
    SamplingError,
    SamplingParams,
    processed_rows,
)

V = 64
TINY = [1e-38, 1e-40, 1e-45, 5e-324, 1e-300, 1e-30]


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 5


@pytest.mark.parametrize("temperature", TINY)
def test_a_tiny_temperature_is_exactly_greedy(temperature):
    logits = _logits()
    s = Sampler(SamplingParams(temperature=temperature, seed=1))
    assert {s(logits) for _ in range(20)} == {int(torch.argmax(logits))}


@pytest.mark.parametrize("top_p", TINY)
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    logits = _logits(1)
    s = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=1))
    assert {s(logits) for _ in range(20)} == {int(torch.argmax(logits))}


@settings(max_examples=200, deadline=None)
@given(
    temperature=st.one_of(st.floats(0, 2), st.sampled_from([0.0, *TINY])),
    top_p=st.one_of(st.floats(1e-320, 1, exclude_min=False), st.sampled_from(TINY)).filter(lambda p: p > 0),
    top_k=st.integers(0, V + 5),
    seed=st.one_of(st.none(), st.integers(SEED_MIN, SEED_MAX)),
    masked=st.integers(0, V - 1),
)
def test_any_allowed_parameters_draw_a_valid_token(temperature, top_p, top_k, seed, masked):
    logits = _logits(3)
    logits[:masked] = float("-inf")  # some rows of a logit vector may be -inf (a ban)
    tok = Sampler(SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed))(logits)
    assert masked <= tok < V


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, 2**63, SEED_MAX])
def test_seeds_at_the_ends_of_the_range_repeat(seed):
    logits = _logits(2)
    p = SamplingParams(temperature=1.0, seed=seed)
    assert Sampler(p)(logits) == Sampler(p)(logits)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("seed", {"seed": SEED_MIN - 1}),
        ("seed", {"seed": SEED_MAX + 1}),
        ("temperature", {"temperature": float("inf")}),
        ("temperature", {"temperature": float("nan")}),
        ("top_p", {"top_p": float("nan")}),
        ("logit_bias", {"logit_bias": ((1, 101.0),)}),
        ("logit_bias", {"logit_bias": ((-1, 1.0),)}),
    ],
)
def test_out_of_range_parameters_name_their_field(field, bad):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**bad)
    assert e.value.field == field


# -- logit_bias ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=8), min_size=1, max_size=5)
)
def test_logit_bias_adds_each_rows_bias_to_its_logits_only(biases):
    """A step's rows, each under its own ``logit_bias`` (some none): each row's logits plus its own
    bias, no other row's; the logits it was given are not changed."""
    logits = torch.stack([_logits(i) for i in range(len(biases))])  # [S, V]
    want = logits.clone()
    for row, bias in enumerate(biases):
        for tid, b in bias.items():
            want[row, tid] += b
    samplers = [Sampler(SamplingParams(logit_bias=tuple(bias.items()))) for bias in biases]
    got = processed_rows(samplers, logits)
    assert torch.equal(got, want)
    assert torch.equal(logits, torch.stack([_logits(i) for i in range(len(biases))]))


def test_logit_bias_bans_and_forces_tokens_greedy_and_sampled():
    logits = _logits(5)
    top = int(torch.argmax(logits))
    banned = Sampler(SamplingParams(logit_bias=((top, -100.0),)))(logits)
    assert banned != top
    forced = Sampler(SamplingParams(temperature=1.0, seed=3, logit_bias=((7, 100.0),)))
    assert {forced(logits) for _ in range(30)} == {7}


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_a_row_draws_the_same_token_alone_and_among_others(device):
    """draw_rows over a step's sampled rows gives each row what its sampler gives it alone (one
    seed, one token, whatever else the step samples), for mixed parameters and a greedy row."""
    from turnkv.engine.sampling import draw_rows

    v = 4099
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s)
              for s, (t, p, k) in enumerate([(0.7, 1.0, 0), (1.3, 0.9, 0), (1.0, 1.0, 40), (0.5, 0.5, 7),
                                             (2.0, 0.999, 0), (1e-3, 1.0, 0)])]  # fmt: skip
    params.append(SamplingParams(logit_bias=((3, 50.0),)))  # greedy, but needs a draw
    gen = torch.Generator().manual_seed(20)
    logits = (torch.randn(len(params), v, generator=gen) * 5).to(device)
    for _ in range(5):
        alone = [Sampler(p, device) for p in params]
        together = [Sampler(p, device) for p in params]
        want = [int(sp.draw(row)) for sp, row in zip(alone, logits, strict=True)]
        got = draw_rows(together, logits).tolist()
        assert got == want
        assert got[-1] == 3  # the bias forced it
        logits = logits.roll(1, dims=1)

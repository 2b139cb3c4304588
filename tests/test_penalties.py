"""Penalties and ``min_p`` (``engine.penalties``, ``sampling.draw_rows``): against a plain-python
oracle, per row in a batch, and in verify windows (speculation on and off draw the same tokens)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_context_copy import PROMPT as CHAIN_PROMPT
from test_context_copy import TABLE, markov_source, speculation
from test_logprobs import engine, run  # noqa: F401 (the module's engine fixture)

from turnkv.engine.events import TurnRequest
from turnkv.engine.sampling import Sampler, SamplingError, SamplingParams, draw_rows

V = 10


def oracle_row(logits: list[float], prompt: list[int], answer: list[int], p: SamplingParams) -> list[float]:
    """The penalized row as HF (repetition) and OpenAI (presence, frequency) define it."""
    out = []
    for t, x in enumerate(logits):
        if p.repetition_penalty != 1.0 and (t in prompt or t in answer):
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        c = answer.count(t)
        x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        out.append(x)
    return out


def sampler_after(p: SamplingParams, prompt: list[int], answer: list[int]) -> Sampler:
    """A sampler whose turn has drawn ``answer`` (observed as draws observe them)."""
    s = Sampler(p, prompt=prompt)
    if s.penalties is not None:
        s.penalties.ready(V, torch.device("cpu"))
        for t in answer:
            s.penalties.observe(torch.tensor(t))
    return s


params_st = st.builds(
    SamplingParams,
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.1, 3.0),
)
tokens_st = st.lists(st.integers(0, V - 1), max_size=12)
logits_st = st.lists(st.floats(-8, 8).map(lambda v: round(v, 2)), min_size=V, max_size=V)


@settings(max_examples=200, deadline=None)
@given(params_st, tokens_st, tokens_st, logits_st)
def test_a_penalized_greedy_draw_is_the_oracles_argmax(p, prompt, answer, logits):
    want = oracle_row(logits, prompt, answer, p)
    got = sampler_after(p, prompt, answer)
    row = got.penalties.apply(torch.tensor(logits))
    assert row.tolist() == pytest.approx(want, abs=1e-4)
    best = sorted(want, reverse=True)
    tok = int(draw_rows([got], torch.tensor([logits]))[0])
    if best[0] - best[1] > 1e-3:  # not a near-tie that fp32 may round either way
        assert tok == max(range(V), key=want.__getitem__)
    # the draw joined the answer: the next row is penalized for it too
    assert got.penalties.apply(torch.tensor(logits)).tolist() == pytest.approx(
        oracle_row(logits, prompt, [*answer, tok], p), abs=1e-4
    )


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9, 1.0])
def test_min_p_keeps_the_tokens_at_least_min_p_times_the_most_likely(min_p):
    logits = torch.tensor([2.0, 1.5, 0.0, -1.0, 1.9, -3.0, 0.5, 1.0, -0.5, 0.2])
    temp = 0.8
    probs = torch.softmax(logits.double() / temp, -1)
    allowed = {t for t in range(V) if probs[t] >= min_p * probs.max()}
    p = SamplingParams(temperature=temp, min_p=min_p)
    drawn = {int(Sampler(replace(p, seed=s)).draw(logits)) for s in range(600)}
    assert drawn == allowed  # every allowed token drawn (the least likely has p > 0.5 % here)


def test_rows_are_penalized_each_by_its_own_turn_in_a_batch():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    ps = [SamplingParams(frequency_penalty=2.0), SamplingParams(), SamplingParams(repetition_penalty=2.0),
          SamplingParams(temperature=1.0, presence_penalty=1.5, min_p=0.1, seed=4)]  # fmt: skip
    prompts = [[1, 2], [], [3], [4, 5]]
    alone = [Sampler(p, prompt=q) for p, q in zip(ps, prompts, strict=True)]
    together = [Sampler(p, prompt=q) for p, q in zip(ps, prompts, strict=True)]
    for _ in range(6):
        want = [int(s.draw(row)) for s, row in zip(alone, logits, strict=True)]
        assert draw_rows(together, logits).tolist() == want


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("min_p", 1.5),
        ("min_p", -0.1),
    ],
)
def test_out_of_range_is_refused_naming_the_field(field, value):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(frequency_penalty=1.5, ignore_eos=True),  # greedy: drawn, not the argmax
        SamplingParams(repetition_penalty=1.8, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0.9, frequency_penalty=1.0, min_p=0.2, ignore_eos=True),
    ],
)
def test_verify_windows_draw_penalized_rows_as_decode_steps(engine, monkeypatch, params):  # noqa: F811
    monkeypatch.setattr(engine, "run_step", markov_source(engine, TABLE))
    runs = {}
    for mode in ("off", "auto"):
        monkeypatch.setattr(engine, "speculation", speculation(mode))
        reqs = [TurnRequest(CHAIN_PROMPT, replace(params, seed=i), max_tokens=16) for i in range(8)]
        runs[mode] = [[e.token_id for e in events] for events in run(engine, reqs)]
        alone = [[e.token_id for e in run(engine, [req])[0]] for req in reqs[:2]]
        assert alone == runs[mode][:2]  # a row's draw is the same row decoded alone
    assert runs["auto"] == runs["off"]
    assert engine.speculation.stats.windows > 0
    plain = run(engine, [TurnRequest(CHAIN_PROMPT, SamplingParams(ignore_eos=True), max_tokens=16)])[0]
    assert [e.token_id for e in plain] != runs["off"][0] or params.temperature  # the penalty told

"""Logprobs of the answer tokens (``engine.logprobs``): the log-softmax of the logits the step
computed (recomputed here through ``Engine.run_step``), the same with speculation on and off, the
same sampled or greedy, and nothing for a turn that did not ask."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_context_copy import PROMPT as CHAIN_PROMPT
from test_context_copy import TABLE, markov_source, speculation

from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.engine.step import Window
from turnkv.runtime import load_engine, new_bank

PROMPT = [256, *range(40, 70)]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", prefill_chunk=64))


def run(engine: Engine, requests: list[TurnRequest]) -> list[list[GenEvent]]:
    """The answer events of ``requests``, run together on one scheduler."""
    out: list[list[GenEvent]] = [[] for _ in requests]
    sched = Scheduler(engine, new_bank(engine, "64M"))
    for i, req in enumerate(requests):
        sched.submit(req, lambda ev, i=i: out[i].append(ev) if isinstance(ev, GenEvent) else None)
    while sched.busy:
        sched.step()
    return [[e for e in o if e.token_id is not None] for o in out]


def recomputed(engine: Engine, prompt: list[int], answer: list[int], bias=()) -> torch.Tensor:
    """The log-softmax rows ``[len(answer), V]`` the answer was chosen from: the prompt in one
    window, then one decode row per token, as the turn ran them (``logit_bias`` added)."""
    cache = engine.new_cache()
    rows = [engine.run_step([Window(cache, prompt, logits=1)]).logits[-1]]
    cache.commit(prompt)
    for tok in answer[:-1]:
        rows.append(engine.run_step([Window(cache, [tok])]).logits[-1])
        cache.commit([tok])
    x = torch.stack(rows).float()
    for tid, b in bias:
        x[:, tid] += b
    return torch.log_softmax(x, -1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),  # before temperature
        SamplingParams(logit_bias=((45, 3.0), (46, -100.0)), ignore_eos=True),  # after the bias
    ],
)
def test_logprobs_are_the_log_softmax_of_the_steps_logits(engine, monkeypatch, params):
    monkeypatch.setattr(engine.speculation, "enabled", False)
    other = TurnRequest([256, 7, 8, 9], SamplingParams(temperature=1.0, seed=3), max_tokens=6)  # not asking
    asked, plain = run(engine, [TurnRequest(PROMPT, params, max_tokens=6, logprobs=4), other])
    assert all(e.logprob is None for e in plain)
    answer = [e.token_id for e in asked]
    want = recomputed(engine, PROMPT, answer, params.logit_bias)
    for j, e in enumerate(asked):
        assert e.logprob.token == e.token_id
        torch.testing.assert_close(e.logprob.logprob, want[j, e.token_id].item(), rtol=0, atol=1e-5)
        top = torch.topk(want[j], 4)
        assert [t for t, _ in e.logprob.top] == top.indices.tolist()
        torch.testing.assert_close([v for _, v in e.logprob.top], top.values.tolist(), rtol=0, atol=1e-5)


def test_zero_top_logprobs_reports_the_chosen_token_only(engine):
    (events,) = run(engine, [TurnRequest(PROMPT, SamplingParams(ignore_eos=True), max_tokens=3, logprobs=0)])
    assert all(e.logprob is not None and e.logprob.top == () for e in events)


@pytest.mark.parametrize(
    "params", [SamplingParams(ignore_eos=True), SamplingParams(temperature=0.9, ignore_eos=True)]
)
def test_verify_windows_report_the_logprobs_of_decode_steps(engine, monkeypatch, params):
    monkeypatch.setattr(engine, "run_step", markov_source(engine, TABLE))
    runs = {}
    for mode in ("off", "auto"):
        monkeypatch.setattr(engine, "speculation", speculation(mode))
        reqs = [
            TurnRequest(CHAIN_PROMPT, replace(params, seed=i), max_tokens=16, logprobs=2) for i in range(8)
        ]
        runs[mode] = [[(e.token_id, e.logprob) for e in events] for events in run(engine, reqs)]
    assert runs["auto"] == runs["off"]  # tokens and logprobs, bit for bit
    assert engine.speculation.stats.accepted > 10  # drafts were verified and kept
    lp = torch.log_softmax(TABLE, -1)
    tok, first = runs["off"][0][0]
    # (the step's row is the vocabulary wide, -inf off the chain: the same value up to rounding)
    torch.testing.assert_close(first.logprob, lp[CHAIN_PROMPT[-1], tok].item(), rtol=0, atol=1e-6)

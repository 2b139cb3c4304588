"""The prompt's logprobs (``TurnRequest.prompt_logprobs``, completions' ``echo`` with ``logprobs``):
prompt token ``j`` (``j >= 1``) gets the log-softmax of the logits of row ``j - 1``, as one uncached
forward over the whole prompt computes them (the oracle), whatever the prefill chunks, the other
turns in the step or the choices; the turn reads no cached prefix (break ``not_read``), and
``max_tokens`` 0 answers nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import Admitted, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.engine.step import Window
from turnkv.runtime import load_engine, new_bank

CHUNK = 16  # prefill chunk: the prompts below span several


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", prefill_chunk=CHUNK))


def run(engine: Engine, requests: list[TurnRequest], bank=None) -> list[list]:
    """Every event of each of ``requests``, run together on one scheduler."""
    out: list[list] = [[] for _ in requests]
    sched = Scheduler(engine, bank if bank is not None else new_bank(engine, "64M"))
    for i, req in enumerate(requests):
        sched.submit(req, lambda ev, i=i: out[i].append(ev))
    while sched.busy:
        sched.step()
    return out


def oracle(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """``[P, V]`` log-softmax of every prompt row's logits, one uncached window over the prompt."""
    cache = engine.new_cache()
    logits = engine.run_step([Window(cache, prompt, logits=len(prompt))]).logits
    return torch.log_softmax(logits.float(), -1)


def scored(events: list, choice: int = 0):
    [lps] = [e.prompt_logprobs for e in events if isinstance(e, GenEvent) and e.prompt_logprobs is not None
             and e.choice == choice]  # fmt: skip
    return lps


def check(want: torch.Tensor, prompt: list[int], lps, top: int) -> None:
    assert [lp.token for lp in lps] == prompt[1:]
    for j, lp in enumerate(lps, 1):
        torch.testing.assert_close(lp.logprob, want[j - 1, prompt[j]].item(), rtol=0, atol=1e-5)
        k = torch.topk(want[j - 1], top)
        assert [t for t, _ in lp.top] == k.indices.tolist()
        torch.testing.assert_close([v for _, v in lp.top], k.values.tolist(), rtol=0, atol=1e-5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(3, 250), min_size=1, max_size=3 * CHUNK + 5),
    top=st.integers(0, 5),
    max_tokens=st.sampled_from([0, 1, 4]),
    company=st.booleans(),
)
def test_prompt_logprobs_are_the_log_softmax_of_an_uncached_forward(engine, prompt, top, max_tokens, company):
    req = TurnRequest(prompt, SamplingParams(ignore_eos=True), max_tokens=max_tokens, logprobs=top,
                      prompt_logprobs=top)  # fmt: skip
    others = [TurnRequest([256, *range(40, 70)], SamplingParams(ignore_eos=True), max_tokens=5)] * company
    events, *rest = run(engine, [req, *others])
    check(oracle(engine, prompt), prompt, scored(events), top)
    answer = [e for e in events if isinstance(e, GenEvent) and e.token_id is not None]
    assert len(answer) == max_tokens
    assert events[-2].finish_reason == "length" if max_tokens == 0 else True
    assert all(e.prompt_logprobs is None for o in rest for e in o if isinstance(e, GenEvent))


def test_a_banked_prompt_is_not_read_and_scores_the_same(engine):
    prompt = [256, *range(40, 40 + 2 * CHUNK + 3)]
    bank = new_bank(engine, "64M")
    run(engine, [TurnRequest(prompt, SamplingParams(ignore_eos=True), max_tokens=2)], bank)  # banked
    warm = run(engine, [TurnRequest(prompt, SamplingParams(ignore_eos=True), max_tokens=2)], bank)[0]
    assert warm[0].cached_tokens == len(prompt) - 1  # the bank holds it
    (events,) = run(engine, [TurnRequest(prompt, max_tokens=2, logprobs=1, prompt_logprobs=2)], bank)
    admitted = events[0]
    assert isinstance(admitted, Admitted) and admitted.cached_tokens == 0
    assert admitted.cache_break.reason == "not_read"
    check(oracle(engine, prompt), prompt, scored(events), 2)


def test_every_choice_carries_the_prompts_logprobs(engine):
    prompt = [256, *range(60, 60 + CHUNK + 7)]
    params = SamplingParams(temperature=0.9, seed=4, ignore_eos=True)
    (events,) = run(engine, [TurnRequest(prompt, params, max_tokens=3, logprobs=1, prompt_logprobs=1, n=3)])
    want = oracle(engine, prompt)
    for choice in range(3):
        check(want, prompt, scored(events, choice), 1)


def test_a_window_cannot_score_the_row_that_starts_the_answer(engine):
    with pytest.raises(ValueError):
        Window(engine.new_cache(), [5, 6], logits=1, scores=[7, 8])

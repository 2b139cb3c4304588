"""The per-step plan: a step of ragged windows from several conversations equals each window run
alone, and greedy text does not depend on the company.

On ``random:test`` (fp32, fast) and on the default model. A window's logits in a batched step
differ from the same window alone only by the rounding of batched matmuls (different blocking), so
fp32 logits agree within 1e-5; greedy text is compared exactly.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler, run_turn
from turnkv.engine.step import Window
from turnkv.runtime import load_engine, new_bank


@pytest.fixture(scope="module")
def tiny() -> Engine:
    engine = load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32"))
    with torch.no_grad():  # larger weights than the default 0.02: logits with clear maxima
        engine.model.init_random(seed=1, std=0.2)
    return engine


def history(engine: Engine, turns: list[list[int]]):
    """A cache holding ``turns`` as sealed segments (one per turn), built through steps."""
    cache = engine.new_cache()
    for ids in turns:
        engine.run_step([Window(cache, ids, logits=0)])
        cache.commit(ids)
        cache.seal()
    return cache


HISTORIES = [[[5, 6, 7, 8, 9] * 4, [30, 31, 32]], [[40 + i for i in range(50)]], [[7] * 9, [8] * 7, [9] * 5]]
WINDOWS = [list(range(100, 120)), [77], [60, 61, 62, 63, 64]]  # prefill chunk, decode, verify


def test_a_ragged_step_equals_each_window_alone(tiny):
    together = [history(tiny, h) for h in HISTORIES]
    res = tiny.run_step([Window(c, w, logits=len(w)) for c, w in zip(together, WINDOWS, strict=True)])
    assert res.plan.rows == sum(len(w) for w in WINDOWS)
    assert res.plan.labels == ["lse_q20", "lse_q1", "lse_q5"]
    for i, (h, w) in enumerate(zip(HISTORIES, WINDOWS, strict=True)):
        alone = tiny.run_step([Window(history(tiny, h), w, logits=len(w))])
        # not bit for bit: fp32 GEMMs round by their row count (on some CPUs' BLAS the more), and
        # these large weights' attention scores amplify that; a misplaced row is off by ~scale
        scale = alone.logits.abs().max().item()
        torch.testing.assert_close(res.of(i), alone.logits, atol=1e-3 * scale, rtol=0)
        assert torch.equal(res.of(i).argmax(-1), alone.logits.argmax(-1))


def test_logits_of_the_last_rows_only(tiny):
    cache = history(tiny, HISTORIES[0])
    full = tiny.run_step([Window(cache, WINDOWS[0], logits=len(WINDOWS[0]))]).logits
    cache = history(tiny, HISTORIES[0])
    last = tiny.run_step([Window(cache, WINDOWS[0], logits=3)]).logits
    assert last.shape == (3, tiny.loaded.config.vocab_size)
    torch.testing.assert_close(last, full[-3:], atol=1e-5 * full.abs().max().item(), rtol=0)


def generate(engine: Engine, prompts: list[list[int]], together: bool, max_tokens: int = 12) -> list[str]:
    """Greedy answers to ``prompts``: all in one scheduler (batched steps) or one at a time."""
    params = SamplingParams(ignore_eos=True)
    texts: list[list[str]] = [[] for _ in prompts]
    if together:
        sched = Scheduler(engine, new_bank(engine, "1G"), max_running=8, max_batch_tokens=64)
        for i, p in enumerate(prompts):
            sched.submit(
                TurnRequest(p, params, max_tokens=max_tokens), lambda ev, i=i: _collect(texts[i], ev)
            )
        steps = 0
        while sched.busy:
            sched.step()
            steps += 1
        stats = sched.pipeline.stats
        assert stats.rows / stats.steps > 1.5  # decode rows of several turns shared steps
    else:
        for i, p in enumerate(prompts):
            for ev in run_turn(
                Scheduler(engine, new_bank(engine, "1G"), max_running=1),
                TurnRequest(p, params, max_tokens=max_tokens),
            ):
                _collect(texts[i], ev)
    return ["".join(t) for t in texts]


def _collect(out: list[str], ev) -> None:
    if isinstance(ev, GenEvent):
        out.append(ev.text)


def test_greedy_text_is_the_same_alone_and_in_company(tiny):
    prompts = [[256, *range(40, 40 + n)] for n in (3, 30, 90, 7, 150)]  # ragged prompts
    assert generate(tiny, prompts, together=True) == generate(tiny, prompts, together=False)


@pytest.mark.slow
def test_default_model_greedy_text_alone_and_in_company():
    # fp32 weights: the packed CPU path rounds activations to bf16 before each matmul, so a turn
    # whose prompt is prefilled in other chunks beside others can part at a bf16 near-tie
    # (docs/SCHEDULER.md says what holds where)
    engine = load_engine(EngineConfig(device="cpu", weights="dequant"), progress=False)
    tok = engine.tokenizer
    questions = ["What is the capital of France?", "Name three colours.", "Count to five.", "Say hi."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    alone = generate(engine, prompts, together=False, max_tokens=10)
    assert generate(engine, prompts, together=True, max_tokens=10) == alone
    assert "Paris" in alone[0]
    con = Engine(engine.loaded, replace(engine.cfg, kv_layout="contiguous"))
    assert generate(con, prompts, together=True, max_tokens=10) == alone

"""Context-copy speculation on the default model (SmolLM2-135M, CPU, its default packed Q4 weights,
fp32 activations and KV): greedy text is the same
with speculation on and off -- for an edit (copy an email with one change), a list revision and
free text, alone, in a batch of concurrent turns, and in a follow-up turn that revises the model's
own earlier answer from the bank.

The governor prices rows with fixed costs here (``FixedCost``: verify rows free), so it drafts as
much as the index offers and the verify windows are the same on every machine; the real governor
only ever drafts less.
"""

from __future__ import annotations

import pytest
from test_context_copy import speculation

from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.runtime import load_engine, new_bank

pytestmark = pytest.mark.slow

EMAIL = (
    "Hi Anna,\n\nThanks for sending the report. Could we meet on Monday at 10am to go through the "
    "budget section? I will bring the notes from last week.\n\nBest regards,\nTom"
)
TODO = "1. Call the bank\n2. Buy groceries\n3. Pay the electricity bill\n4. Water the plants"
QUESTIONS = {
    "edit": f"Copy this email, but change the day from Monday to Tuesday:\n\n{EMAIL}",
    "list": f'My to-do list:\n\n{TODO}\n\nRewrite the whole list, but replace item 2 with "Buy milk".',
    "free": "Write two sentences about the sea.",
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(EngineConfig(device="cpu"), progress=False)


def answers(
    engine: Engine, mode: str, prompts: list[list[int]], bank=None, max_tokens: int = 32, budget: int = 512
):
    """Greedy answers to ``prompts`` as concurrent turns of one scheduler (``budget``: its
    ``max_batch_tokens``); texts and stats."""
    engine.speculation = speculation(mode)
    texts = [""] * len(prompts)
    stats: list = [None] * len(prompts)

    def emit(i, ev):
        if isinstance(ev, GenEvent):
            texts[i] += ev.text
            stats[i] = ev.stats or stats[i]

    bank = bank if bank is not None else new_bank(engine, "1G")
    sched = Scheduler(engine, bank, max_running=8, max_batch_tokens=budget)
    for i, p in enumerate(prompts):
        sched.submit(TurnRequest(p, SamplingParams(), max_tokens=max_tokens), lambda ev, i=i: emit(i, ev))
    while sched.busy:
        sched.step()
    return texts, stats


def test_greedy_text_is_the_same_with_speculation_on_and_off_alone_and_in_a_batch(engine):
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS.values()]
    alone_off = [answers(engine, "off", [p])[0][0] for p in prompts]
    [edit], [stats] = answers(engine, "auto", prompts[:1])
    assert edit == alone_off[0] and "Monday at 10am" in edit
    assert stats.accepted >= 20 and stats.decode_forwards < stats.completion_tokens / 2  # it copied
    batch_on, batch_stats = answers(engine, "auto", prompts)
    assert batch_on == alone_off
    assert sum(s.drafted for s in batch_stats) > sum(s.accepted for s in batch_stats)  # rejections too


def test_a_follow_up_that_revises_the_banked_answer_is_the_same_with_speculation(engine):
    tok = engine.tokenizer
    first = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    bank = new_bank(engine, "1G")
    [answer], _ = answers(engine, "off", [tok.apply_chat_template(first)], bank, max_tokens=72)
    follow = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Show the same code again, but call the function `fib`."},
    ]
    ids = tok.apply_chat_template(follow)
    off, _ = answers(engine, "off", [ids], bank, max_tokens=48)
    on, [stats] = answers(engine, "auto", [ids], bank, max_tokens=48)
    assert on == off and "def fib" in on[0]
    assert stats.cached_tokens > 0 and stats.accepted >= 20  # restored from the bank, then copied


def test_prefill_beside_verify_windows_is_chunked_as_without_speculation(engine, monkeypatch):
    """A long prompt prefills in small chunks while the others decode (and draft): drafts only
    take what prefill leaves of the token budget, so the long prompt is cut into the same chunks
    on and off (a row's bits depend on its own window), and every text is the same."""
    tok = engine.tokenizer
    long = "Summarize these notes in one line.\n\n" + "\n\n".join([EMAIL] * 6)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in [*QUESTIONS.values(), long]]
    chunks: list[int] = []
    run_step = engine.run_step

    def recording(windows, prev=None):
        chunks.extend(len(w.tokens) for w in windows if len(w.tokens) > 1 and w.logits <= 1)
        return run_step(windows, prev)

    monkeypatch.setattr(engine, "run_step", recording)
    off, _ = answers(engine, "off", prompts, budget=48)
    chunks_off, chunks[:] = list(chunks), []
    on, stats = answers(engine, "auto", prompts, budget=48)
    assert sum(s.accepted for s in stats) >= 10  # the others did speculate meanwhile
    prefill_on = [n for n in chunks if n > 1]
    assert prefill_on == chunks_off and sum(chunks_off) >= len(prompts[-1])
    assert on == off

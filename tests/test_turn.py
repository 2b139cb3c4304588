"""The turn owner without HTTP, on ``random:test`` (fast): begin, steps, finish, cancel, rebase,
refusals, a failing step. Each test drives ``Turn`` the way the scheduler does."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import Admitted, Banked, Failed, GenEvent, TurnRequest, WindowOutput
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler, run_turn
from turnkv.engine.turn import Turn
from turnkv.runtime import load_engine, new_bank


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", prefill_chunk=16))


def drive(engine: Engine, turn: Turn, cancel_after: int | None = None) -> list:
    """Run one turn window by window; ``cancel_after`` sets its cancel flag after that many tokens."""
    events = turn.begin()
    while not turn.done:
        w = turn.window(1000)
        out = None
        if w is not None:
            res = engine.run_step([w])
            layers = engine.shape.num_layers
            out = WindowOutput(res.logits.argmax(-1).tolist(), res.plan.labels[0], layers)  # greedy
        events += turn.advance(out)
        if (
            cancel_after is not None
            and sum(isinstance(e, GenEvent) and e.token_id is not None for e in events) >= cancel_after
        ):
            turn.request.cancel.set()
    return events


PROMPT = [256, *range(40, 90)]  # 51 tokens: four prefill windows of 16 rows and one of 3


def test_begin_steps_finish_in_order_and_bank_the_turn(engine, monkeypatch):
    monkeypatch.setattr(engine.speculation, "enabled", False)  # one row per decode step
    bank = new_bank(engine, "64M")
    turn = Turn(
        engine.turn_context(), bank, TurnRequest(PROMPT, SamplingParams(ignore_eos=True), max_tokens=5)
    )
    events = drive(engine, turn)
    assert isinstance(events[0], Admitted) and events[0].cached_tokens == 0
    gens = [e for e in events if isinstance(e, GenEvent)]
    assert len([g for g in gens if g.token_id is not None]) == 5
    assert gens[-1].finish_reason == "length" and gens[-1].stats.completion_tokens == 5
    assert isinstance(events[-1], Banked) and events[-1].banked_tokens == len(PROMPT) + 4
    stats = gens[-1].stats
    assert stats.prefilled_tokens == len(PROMPT) and stats.forwards == 4 + 4  # 4 prefill windows, 4 decodes
    assert stats.route_counts == {"single_q16": 6, "single_q3": 2, "single_q1": 8}  # x2 layers
    assert len(bank) == 1 and bank.stats.misses == 1


def test_a_follow_up_restores_the_banked_rows(engine):
    bank = new_bank(engine, "64M")
    first = drive(
        engine,
        Turn(engine.turn_context(), bank, TurnRequest(PROMPT, SamplingParams(ignore_eos=True), max_tokens=3)),
    )
    answer = [e.token_id for e in first if isinstance(e, GenEvent) and e.token_id is not None]
    follow = [*PROMPT, *answer[:-1], 300, 301, 302]
    events = drive(
        engine, Turn(engine.turn_context(), bank, TurnRequest(follow, SamplingParams(), max_tokens=2))
    )
    assert isinstance(events[0], Admitted), events[0]
    assert events[0].cached_tokens == len(PROMPT) + len(answer) - 1
    last = [e for e in events if isinstance(e, GenEvent)][-1]
    assert last.stats.prefilled_tokens == 3 and "lse_q3" in last.stats.route_counts  # segment + tail


def test_rebase_banks_the_rows_of_the_re_rendered_history(engine):
    bank = new_bank(engine, "64M")
    tail = [258, 10, 11]  # what the "template" appends after the answer (end of turn, newlines)

    def render(answer: str) -> list[int]:
        return [*PROMPT, *answer.encode(), *tail]

    req = TurnRequest(PROMPT, SamplingParams(ignore_eos=True), max_tokens=4, render_history=render)
    events = drive(engine, Turn(engine.turn_context(), bank, req))
    banked = events[-1]
    text = "".join(e.text for e in events if isinstance(e, GenEvent))
    want = render(text)
    assert isinstance(banked, Banked) and banked.banked_tokens == len(want)
    assert bank.entries()[0].tokens == tuple(want)
    assert 0 < banked.rebase_rows <= len(tail) + 4


def test_cancel_stops_the_answer_and_still_banks_what_was_computed(engine):
    bank = new_bank(engine, "64M")
    req = TurnRequest(PROMPT, SamplingParams(ignore_eos=True), max_tokens=50, render_history=lambda a: PROMPT)
    events = drive(engine, Turn(engine.turn_context(), bank, req), cancel_after=3)
    last = [e for e in events if isinstance(e, GenEvent)][-1]
    n = last.stats.completion_tokens  # 3, or more where a verify window's tokens crossed 3
    assert last.finish_reason == "cancelled" and 3 <= n <= 3 + last.stats.accepted
    assert isinstance(events[-1], Banked) and events[-1].rebase_rows == 0  # banked as generated
    assert events[-1].banked_tokens == len(PROMPT) + n - 1  # the last sampled token was never fed


def test_context_and_memory_refusals_do_nothing(engine):
    bank = new_bank(engine, "64M")
    too_long = Turn(engine.turn_context(), bank, TurnRequest([256] * 4096, SamplingParams()))
    [failed] = too_long.begin()
    assert isinstance(failed, Failed) and failed.code == "context_length_exceeded" and too_long.done
    over = Turn(engine.turn_context(), bank, TurnRequest(PROMPT, SamplingParams(), max_tokens=4050))
    [failed] = over.begin()
    assert failed.code == "context_length_exceeded" and "4101 tokens" in failed.message
    tiny = new_bank(engine, 64 * 1024)  # 64 KiB: not even the prompt's rows
    [refused] = Turn(engine.turn_context(), tiny, TurnRequest(PROMPT, SamplingParams(), max_tokens=8)).begin()
    assert refused.code == "kv_memory_exhausted" and refused.needed_bytes > refused.available_bytes
    assert bank.stats.refusals == 0 and tiny.stats.refusals == 1


def test_a_failing_step_fails_its_turns_and_keeps_the_bank(engine, monkeypatch):
    bank = new_bank(engine, "64M")
    list(
        run_turn(
            Scheduler(engine, bank, max_running=1),
            TurnRequest(PROMPT, SamplingParams(ignore_eos=True), max_tokens=2),
        )
    )
    before = {e.id for e in bank.entries()}
    sched = Scheduler(engine, bank)
    events: list = []
    sched.submit(TurnRequest([*PROMPT, 5, 6], SamplingParams(), max_tokens=4), events.append)

    def boom(windows, prev=None):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "run_step", boom)
    sched.step()
    assert isinstance(events[0], Admitted) and isinstance(events[-1], Failed)
    assert events[-1].code == "internal_error" and "device lost" in events[-1].message
    assert not sched.busy and {e.id for e in bank.entries()} == before  # nothing banked was lost
    assert bank.unique_bytes(live=True) == bank.unique_bytes(live=False)  # the lease was released


def test_sampled_turns_draw_their_own_stream(engine):
    bank = new_bank(engine, "64M")
    params = SamplingParams(temperature=1.0, seed=11, ignore_eos=True)

    def tokens(ev_list):
        return [e.token_id for e in ev_list if isinstance(e, GenEvent) and e.token_id is not None]

    alone = tokens(
        run_turn(Scheduler(engine, bank, max_running=1), TurnRequest(PROMPT, params, max_tokens=6))
    )
    sched = Scheduler(engine, new_bank(engine, "64M"))
    a, b = [], []
    sched.submit(TurnRequest(PROMPT, params, max_tokens=6), a.append)
    sched.submit(TurnRequest([256, 7, 8, 9], SamplingParams(temperature=1.0, seed=3), max_tokens=6), b.append)
    while sched.busy:
        sched.step()
    assert tokens(a) == alone  # the same seed draws the same tokens beside another sampled turn
    torch.manual_seed(0)  # the global generator plays no part


def test_a_turn_runs_on_its_context_alone_without_a_model():
    """``Turn`` sees only its ``TurnContext``: a byte tokenizer, a KV layout and the limits drive
    it end to end, the step's logits made up by the test (a one-hot row: the "model" answers
    ``ANSWER``), and the bank holds the prompt plus the answer."""
    from turnkv.attention.portable import PortableBackend
    from turnkv.attention.verdict import Verdict
    from turnkv.bank.session_bank import SessionBank
    from turnkv.engine.admission import Footprint
    from turnkv.engine.context import TurnContext
    from turnkv.engine.context_copy import SpeculationStats
    from turnkv.kv import make_layout
    from turnkv.kv.cache import KVShape
    from turnkv.kv.segments import unique_bytes
    from turnkv.limits import MAX_WINDOW_ROWS
    from turnkv.tokenizer import byte_level

    tok = byte_level()
    shape = KVShape(1, 1, 8, torch.float32, torch.device("cpu"))
    vocab = tok.vocab_size
    ctx = TurnContext(
        max_context=256,
        vocab=vocab,
        default_max_tokens=16,
        prefill_chunk=8,
        device=shape.device,
        tokenizer=tok,
        layout=make_layout("segmented", shape),
        footprint=Footprint(
            8, 16, 4, vocab, 8, partial(PortableBackend(Verdict(), torch.float32).scratch_bytes, 1, 8)
        ),
        drafts=lambda prompt: None,
        draft_stats=SpeculationStats("off", "off: a test"),
        verify_rows=lambda start: MAX_WINDOW_ROWS,
    )
    bank = SessionBank(1 << 20, shape.bytes_per_row, lambda held: unique_bytes(*held))
    answer = list(b"ok")
    prompt = list(b"hello there")
    turn = Turn(ctx, bank, TurnRequest(prompt, SamplingParams(ignore_eos=True), max_tokens=len(answer)))
    events, windows = turn.begin(), []
    while not turn.done:
        w = turn.window(1000)
        out = None
        if w is not None:
            windows.append(len(w.tokens))
            n = sum(isinstance(e, GenEvent) and e.token_id is not None for e in events)
            nxt = answer[min(n, len(answer) - 1)]
            w.cache.open_window(len(w.tokens))  # the rows a forward would have written
            out = WindowOutput([nxt] * w.logits, "test_q1", 1)  # the tokens a chooser would give
        events += turn.advance(out)
    text = "".join(e.text for e in events if isinstance(e, GenEvent))
    assert isinstance(events[0], Admitted) and text == "ok"
    assert windows == [8, 3, 1]  # two prefill chunks of at most prefill_chunk rows, one decode row
    assert isinstance(events[-1], Banked) and events[-1].banked_tokens == len(prompt) + len(answer) - 1
    assert len(bank) == 1 and bank.stats.misses == 1

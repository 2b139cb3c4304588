"""The scheduler's run-ahead (a decode step launched before the previous one's tokens are taken)
against the plain step loop, on ``random:test`` on the CPU, where it is forced on: the same events
for every turn (tokens, text, finish reasons), the same rows banked, follow-ups that reuse them
alike -- with answers ending at different steps, by length and by a stop string, a rebase, a turn
arriving mid-answer and a cancellation."""

from __future__ import annotations

import json

import pytest
import torch

from turnkv.config import EngineConfig
from turnkv.engine import governor
from turnkv.engine.engine import Engine
from turnkv.engine.events import Banked, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.runtime import build, load_engine, new_bank


@pytest.fixture(scope="module")
def engine() -> Engine:
    # no drafts: the two loops then run the same steps (drafting turns run ahead too: the test
    # test_turns_that_draft_run_ahead_and_drop_windows_planned_after_a_rejected_draft)
    return load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", speculate="off"))


def prompt(n: int, start: int) -> list[int]:
    return [256, *((start + 7 * i) % 250 for i in range(n - 1))]


class Run:
    """One scheduler (run-ahead on or off) over its own bank; every turn's events by name."""

    def __init__(self, engine: Engine, ahead: bool, max_batch_tokens: int = 0) -> None:
        bank = new_bank(engine, "256M")
        self.sched = Scheduler(
            engine, bank, max_running=8, max_batch_tokens=max_batch_tokens, run_ahead=ahead
        )
        self.events: dict[str, list] = {}

    def submit(self, name: str, req: TurnRequest, on_token=None) -> None:
        got = self.events.setdefault(name, [])

        def emit(ev):
            got.append(ev)
            if on_token is not None and isinstance(ev, GenEvent) and ev.token_id is not None:
                on_token(req, sum(isinstance(e, GenEvent) and e.token_id is not None for e in got))

        self.sched.submit(req, emit)

    def drain(self, steps: int = 10_000) -> None:
        while self.sched.busy and steps:
            self.sched.step()
            steps -= 1

    def answer(self, name: str) -> list[tuple]:
        return [(e.token_id, e.text, e.finish_reason) for e in self.events[name] if isinstance(e, GenEvent)]

    def banked(self, name: str) -> int:
        return next(e.banked_tokens for e in self.events[name] if isinstance(e, Banked))


def rows_of(sched: Scheduler, namespace: str) -> tuple[list[int], torch.Tensor]:
    """The token ids and the K and V rows (every layer) of the latest entry banked in ``namespace``."""
    entry = max((e for e in sched.bank.entries() if e.namespace == namespace), key=lambda e: e.id)
    snap = entry.snapshot
    k, v = snap.read_rows(0, snap.num_tokens)
    return list(snap.tokens), torch.cat([k, v])


def both(engine: Engine, script, max_batch_tokens: int = 0) -> tuple[Run, Run]:
    runs = Run(engine, False, max_batch_tokens), Run(engine, True, max_batch_tokens)
    for run in runs:
        script(run)
    return runs


@pytest.fixture(scope="module")
def cuda_engine() -> Engine:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # no drafts either: with them a step's rows (and so cuBLAS's kernel) differ between the loops
    return load_engine(EngineConfig(model="random:test", device="cuda", dtype="bfloat16", speculate="off"))


def test_on_cuda_run_ahead_is_on_by_default_and_changes_no_bit(cuda_engine):
    assert build(cuda_engine.cfg, "bench", engine=cuda_engine).effective.run_ahead  # graphs on: auto is on
    test_run_ahead_answers_and_banks_what_the_plain_loop_does(cuda_engine)
    test_seeded_sampled_turns_run_ahead_and_draw_the_same_tokens(cuda_engine)


def test_run_ahead_answers_and_banks_what_the_plain_loop_does(engine):
    def script(run: Run) -> None:
        for i, n in enumerate((5, 9, 14, 2)):  # answers end at different steps
            run.submit(f"t{i}", TurnRequest(prompt(20 + 3 * i, i), SamplingParams(ignore_eos=True), n,
                                            namespace=f"c{i}"))  # fmt: skip
        for _ in range(4):
            run.sched.step()
        # a turn arriving while the others decode: admitted at the next step, never starved
        run.submit("late", TurnRequest(prompt(30, 99), SamplingParams(ignore_eos=True), 6, namespace="late"))
        run.drain()

    off, on = both(engine, script)
    assert on.sched.pipeline.stats.ahead_steps > 0 and off.sched.pipeline.stats.ahead_steps == 0
    for name in ("t0", "t1", "t2", "t3", "late"):
        assert on.answer(name) == off.answer(name), name
        assert on.banked(name) == off.banked(name)
    for ns in ("c0", "c1", "c2", "c3", "late"):
        (ids_off, k_off), (ids_on, k_on) = rows_of(off.sched, ns), rows_of(on.sched, ns)
        assert ids_on == ids_off and torch.equal(k_on, k_off), ns


def test_prompt_chunks_run_ahead_beside_decode_rows_and_change_no_answer(engine, monkeypatch):
    """Mixed steps run ahead too: a prompt's next chunk is known before the step in flight
    completes, and so is the first decode row after its last chunk (its id: that step's argmax,
    on the device). With a 24-row budget, long prompts prefill in chunks beside the others'
    decode rows, turns arrive and finish mid-run; answers and banked rows are the plain loop's."""
    launched: list[list[tuple[int, int, bool]]] = []  # per step: (rows, ahead, fed) per window
    run_step = engine.run_step

    def recording(windows, prev=None):
        launched.append([(len(w.tokens), w.ahead, w.feed is not None) for w in windows])
        return run_step(windows, prev)

    def script(run: Run) -> None:
        for i, (n, m) in enumerate(((70, 6), (9, 12), (45, 3), (33, 1))):
            run.submit(
                f"p{i}", TurnRequest(prompt(n, 3 * i), SamplingParams(ignore_eos=True), m, namespace=f"p{i}")
            )
        for _ in range(3):
            run.sched.step()
        run.submit("late", TurnRequest(prompt(52, 41), SamplingParams(ignore_eos=True), 5, namespace="late"))
        run.drain()

    monkeypatch.setattr(engine, "run_step", recording)
    off, on = both(engine, script, max_batch_tokens=24)
    names = ("p0", "p1", "p2", "p3", "late")
    for name in names:
        assert on.answer(name) == off.answer(name), name
        assert on.banked(name) == off.banked(name)
        (ids_off, kv_off), (ids_on, kv_on) = rows_of(off.sched, name), rows_of(on.sched, name)
        assert ids_on == ids_off
        torch.testing.assert_close(kv_on, kv_off, rtol=1e-5, atol=1e-5)  # steps of other sizes
    ahead = [w for step in launched for w in step if w[1]]
    assert any(rows > 1 for rows, _, fed in ahead if not fed)  # a prompt chunk after one in flight
    assert any(rows == 1 and fed for rows, _, fed in ahead)  # decode rows fed on the device
    mixed = [step for step in launched if any(w[1] for w in step) and len({w[0] > 1 for w in step}) == 2]
    assert mixed  # chunks and decode rows in one step launched ahead


def test_seeded_sampled_turns_run_ahead_and_draw_the_same_tokens(engine):
    def script(run: Run) -> None:
        for i, (temp, top_p, top_k) in enumerate(((0.8, 1.0, 0), (1.3, 0.9, 0), (0.7, 1.0, 20))):
            params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, seed=100 + i, ignore_eos=True)
            run.submit(f"s{i}", TurnRequest(prompt(16 + i, 60 + i), params, 12 + 5 * i, namespace=f"s{i}"))
        run.submit("g", TurnRequest(prompt(14, 90), SamplingParams(ignore_eos=True), 10, namespace="g"))
        run.drain()

    off, on = both(engine, script)
    assert on.sched.pipeline.stats.ahead_steps > 0
    for name in ("s0", "s1", "s2", "g"):
        assert on.answer(name) == off.answer(name), name
    assert len({t for t, _, _ in on.answer("s1") if t is not None}) > 1  # it did sample


def test_a_stop_string_and_a_rebase_end_the_answer_at_the_same_token(engine):
    # this prompt's greedy answer on random:test starts with two control characters, then "$"s
    stop = "$"

    def script(run: Run) -> None:
        params = SamplingParams(ignore_eos=True, stop=[stop])
        render = lambda answer: [*prompt(25, 91), 300, *range(40, 40 + len(answer) % 7)]  # noqa: E731
        run.submit("s", TurnRequest(prompt(25, 91), params, 24, namespace="s", render_history=render))
        run.submit("o", TurnRequest(prompt(18, 5), SamplingParams(ignore_eos=True), 20, namespace="o"))
        run.drain()
        # the follow-ups reuse what each banked
        run.submit("s2", TurnRequest([*render("x" * 3), 17, 18], SamplingParams(ignore_eos=True), 6,
                                     namespace="s"))  # fmt: skip
        run.drain()

    off, on = both(engine, script)
    assert on.answer("s")[-1][2] == "stop" and len(on.answer("s")) == 4  # 3 tokens and the end
    for name in ("s", "o", "s2"):
        assert on.answer(name) == off.answer(name), name
    for ns in ("s", "o"):
        (ids_off, kv_off), (ids_on, kv_on) = rows_of(off.sched, ns), rows_of(on.sched, ns)
        assert ids_on == ids_off
        # same values; not always the same bits: the row computed ahead for "s" after its stop
        # puts the rows that follow in steps of other sizes, and a CPU GEMM's rounding of a row
        # depends on how many rows it multiplies (lse.MIN_GEMM_ROWS)
        torch.testing.assert_close(kv_on, kv_off, rtol=1e-5, atol=1e-5)


def test_turns_under_a_grammar_run_ahead_and_answer_alike(engine):
    pytest.importorskip("llguidance")  # a project dependency; absent on the bare GPU machine
    from turnkv.chat_format.grammar import Grammars

    grammars = Grammars(engine.tokenizer, engine.loaded.config.vocab_size)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "string", "maxLength": 5}, "c": {"enum": ["x", "yz"]}},
        "required": ["a", "b", "c"],
    }  # fmt: skip
    grammar = grammars.json_schema(schema)

    def script(run: Run) -> None:
        for i in range(3):  # the grammar ends each answer (an end-of-sequence token) at its own step
            run.submit(f"g{i}", TurnRequest(prompt(15 + i, 40 + i), SamplingParams(), 60, namespace=f"g{i}",
                                            grammar=grammar))  # fmt: skip
        run.submit("free", TurnRequest(prompt(12, 77), SamplingParams(ignore_eos=True), 30, namespace="f"))
        run.drain()

    staged = []
    run_staged = engine.run_staged
    engine.run_staged = lambda st, prev=None: (staged.append(len(st.windows)), run_staged(st, prev))[1]
    try:
        off, on = both(engine, script)
    finally:
        del engine.run_staged
    # the steps after a constrained step in flight were built while its masks were being filled
    assert staged and on.sched.pipeline.stats.ahead_steps > 0 and on.sched.pipeline.masks.rows > 0
    for name in ("g0", "g1", "g2", "free"):
        assert on.answer(name) == off.answer(name), name
    for i in range(3):
        text = "".join(t for _, t, _ in on.answer(f"g{i}"))
        assert on.answer(f"g{i}")[-1][2] == "stop" and json.loads(text)["c"] in ("x", "yz")


def test_a_cancelled_turn_ends_cancelled_and_banks_the_rows_of_its_tokens(engine):
    run = Run(engine, ahead=True)

    def cancel_at_five(req: TurnRequest, tokens: int) -> None:
        if tokens == 5:
            req.cancel.set()

    run.submit("c", TurnRequest(prompt(20, 8), SamplingParams(ignore_eos=True), 40, namespace="c"),
               on_token=cancel_at_five)  # fmt: skip
    run.submit("k", TurnRequest(prompt(20, 9), SamplingParams(ignore_eos=True), 12, namespace="k"))
    run.drain()
    answer = run.answer("c")
    assert answer[-1][2] == "cancelled"
    tokens = [t for t, _, _ in answer if t is not None]
    # the row launched ahead when the cancel came is computed and may add its token (a client's
    # cancel reaches a running turn at a step boundary); the rows banked are exactly the answer's
    assert len(tokens) in (5, 6)
    ids, _ = rows_of(run.sched, "c")
    assert ids[20:] == tokens[:-1] and len(ids) == run.banked("c")
    assert len([t for t, _, _ in run.answer("k") if t is not None]) == 12


def test_run_ahead_is_on_only_where_decode_steps_replay_cuda_graphs(engine):
    sched = build(engine.cfg, "bench", engine=engine).scheduler(new_bank(engine, "64M"))
    assert not sched.pipeline.run_ahead  # a CPU engine: graphs are off, so auto is off
    assert sched.snapshot["run_ahead"] == {"enabled": False, "steps": 0}


def test_a_step_that_breaks_while_another_is_in_flight_fails_only_its_turns(engine, monkeypatch):
    """The step launched ahead raises: its turns fail at once (nothing of them banked, their
    leases released; the step still in flight then completes without them, its tokens dropped),
    the loop goes on, and a turn submitted afterwards answers as it would have."""
    run = Run(engine, ahead=True)
    run.submit("a", TurnRequest(prompt(20, 1), SamplingParams(ignore_eos=True), 8, namespace="a"))
    run.submit("b", TurnRequest(prompt(22, 2), SamplingParams(ignore_eos=True), 8, namespace="b"))
    run_step, calls = engine.run_step, []

    def third_breaks(windows, prev=None):
        calls.append(len(windows))
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return run_step(windows, prev)

    monkeypatch.setattr(engine, "run_step", third_breaks)
    run.drain()
    for name in ("a", "b"):
        events = run.events[name]
        tokens = [e for e in events if isinstance(e, GenEvent) and e.token_id is not None]
        assert events[-1].code == "internal_error" and "device lost" in events[-1].message
        assert len(tokens) == 1  # the prompt step's; the step in flight's came after the failure
    bank = run.sched.bank
    assert len(bank) == 0 and bank.unique_bytes(live=True) == 0  # no lease left behind
    monkeypatch.setattr(engine, "run_step", run_step)
    run.submit("c", TurnRequest(prompt(20, 1), SamplingParams(ignore_eos=True), 8, namespace="c"))
    run.drain()
    alone = Run(engine, ahead=False)
    alone.submit("c", TurnRequest(prompt(20, 1), SamplingParams(ignore_eos=True), 8, namespace="c"))
    alone.drain()
    assert run.answer("c") == alone.answer("c")


def test_masks_that_break_after_the_next_step_was_staged_fail_only_that_steps_turns(engine):
    """The step in flight's masks raise after the next step was built (``Engine.stage``): the turns
    of the step in flight fail (their staged windows are dropped with them, nothing banked, no
    lease left), a turn that was only in the staged step runs on, and the loop serves afterwards."""
    pytest.importorskip("llguidance")
    from turnkv.chat_format.grammar import Grammars

    grammar = Grammars(engine.tokenizer, engine.loaded.config.vocab_size).json_schema({"type": "object"})
    run = Run(engine, ahead=True)
    run.submit("g", TurnRequest(prompt(15, 3), SamplingParams(), 40, namespace="g", grammar=grammar))
    run.submit("f", TurnRequest(prompt(12, 5), SamplingParams(ignore_eos=True), 40, namespace="f"))
    masks, apply, calls = run.sched.pipeline.masks, run.sched.pipeline.masks.apply, []

    def third_breaks(logits, rows):
        calls.append(len(rows))
        if len(calls) == 2:  # admitted at the next step, its prefill staged beside g's and f's rows
            run.submit(
                "late", TurnRequest(prompt(20, 9), SamplingParams(ignore_eos=True), 6, namespace="late")
            )
        if len(calls) == 3:
            assert gathered[-1] == [1, 1, 20]  # the step staged meanwhile: g's, f's and late's rows
            raise RuntimeError("mask upload failed")
        return apply(logits, rows)

    gather, gathered = run.sched._gather, []
    run.sched._gather = lambda r: (w := gather(r), gathered.append([len(x.tokens) for _, x in w]))[0]
    masks.apply = third_breaks
    run.drain()
    for name in ("g", "f"):
        assert run.events[name][-1].code == "internal_error", name
        assert "mask upload failed" in run.events[name][-1].message
    assert run.banked("late") > 0
    alone = Run(engine, ahead=False)
    alone.submit("late", TurnRequest(prompt(20, 9), SamplingParams(ignore_eos=True), 6, namespace="late"))
    alone.drain()
    assert run.answer("late") == alone.answer("late")
    bank = run.sched.bank
    assert len(bank) == 1  # only the late turn's rows: the failed turns banked nothing
    assert bank.unique_bytes(live=True) == bank.unique_bytes(live=False)  # no lease left behind
    bank.check_integrity()


def test_turns_that_draft_run_ahead_and_drop_windows_planned_after_a_rejected_draft(monkeypatch):
    """With speculation drafting (a CPU engine drafts by default), a greedy turn runs ahead too:
    the window after its window in flight carries drafts that follow the copy's guess of that
    window's last token. Where a draft in flight is rejected, that window was planned after rows
    that are not kept: it is dropped (computed, never committed) and the next step starts from
    the kept rows. The answers, and the rows banked, are the plain loop's; every step holds a
    window of every turn still running. (One engine per loop: the drafts' governor learns from
    the step times it sees, so the two loops' draft lengths may differ. The governor's cap on
    what a draft may cost the other turn is lifted, so the turns draft in company.)"""
    monkeypatch.setattr(governor, "OTHERS_LOSS", float("inf"))
    runs, calls, steps = [], {}, {}
    for ahead in (False, True):
        engine = load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32"))
        run_step, seen = engine.run_step, []
        engine.run_step = lambda windows, prev=None, f=run_step, seen=seen: (
            seen.append([(w.cache, len(w.tokens)) for w in windows]) or f(windows, prev)
        )
        run = Run(engine, ahead)
        loop = [256, *([40, 41, 42, 43, 44, 45] * 6)]  # a repetitive prompt: drafts find it
        run.submit("d", TurnRequest(loop, SamplingParams(ignore_eos=True), 24, namespace="d"))
        run.submit("p", TurnRequest(prompt(18, 3), SamplingParams(ignore_eos=True), 24, namespace="p"))
        n = 0
        while run.sched.busy:
            run.sched.step()
            n += 1
        assert engine.speculation.stats.drafted > 0  # the turns did draft
        runs.append(run)
        calls[ahead], steps[ahead] = n, seen
    off, on = runs
    for name in ("d", "p"):
        assert on.answer(name) == off.answer(name), name
        want_ids, want_rows = rows_of(off.sched, name)
        got_ids, got_rows = rows_of(on.sched, name)
        # (the dense fp32 CPU matmul rounds by its row count, and the loops' steps differ in rows)
        assert got_ids == want_ids and torch.allclose(got_rows.float(), want_rows.float(), atol=2e-2), name
    for ahead in (False, True):
        sizes = [len(step) for step in steps[ahead]]
        assert sizes == sorted(sizes, reverse=True), (ahead, sizes)  # 2 windows, then 1 once one ended
    assert calls[False] == len(steps[False])  # every step() call ran a step
    assert on.sched.pipeline.stats.ahead_steps > len(steps[True]) // 2  # most steps were launched ahead
    # windows launched against windows a turn advanced through: the difference was dropped
    launched = sum(1 for step in steps[True] for _ in step)
    forwards = sum(e.stats.forwards for run in (on,) for evs in run.events.values() for e in evs
                   if isinstance(e, GenEvent) and e.stats is not None)  # fmt: skip
    assert launched > forwards, "no run-ahead window was dropped: the test no longer covers that path"
    # those dropped after a rejected draft are counted (the rest: a row after an answer's end)
    assert 0 < on.sched.engine.speculation.stats.dropped <= launched - forwards
    assert off.sched.engine.speculation.stats.dropped == 0  # the plain loop runs nothing ahead

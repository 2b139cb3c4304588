"""Context-copy speculation, fast parts: the draft index against a brute-force oracle, the governor,
and exact acceptance on a hand-built logits source (a Markov chain over a few tokens) where the
sampled output distribution is known exactly.

The Markov source replaces the model's logits (the step's windows are still planned and committed
through the real cache), so every row's distribution depends only on its token: the same in a
verify window as in a one-row decode step. That makes two checks exact: a seeded turn emits the
same tokens with speculation on and off, and the sampled sequences follow the chain's
distribution (chi-square over all sequences, fixed seeds).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from turnkv.config import EngineConfig
from turnkv.engine.context_copy import CHAIN, MAX_MATCH, ContextIndex, Speculation
from turnkv.engine.engine import Engine
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.governor import MAX_PAUSE, Governor, StepCost
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.engine.step import StepResult, plan_step
from turnkv.runtime import load_engine, new_bank


class FixedCost(StepCost):
    """Step costs that do not depend on the clock: ``1 + per_row * rows`` for a verify step."""

    def __init__(self, per_row: float = 0.0) -> None:
        super().__init__()
        self.per_row = per_row

    def cost(self, n: int, verify: bool) -> float:
        return 1.0 + (self.per_row * n if verify else 0.0)


def speculation(mode: str = "auto", per_row: float = 0.0) -> Speculation:
    s = Speculation(mode)
    s.cost = FixedCost(per_row)
    return s


# -- the index ----------------------------------------------------------------------------------
def oracle_draft(tokens: list[int], limit: int) -> tuple[list[int], int]:
    """Brute force: among the ``CHAIN`` latest earlier ends of the newest bigram, the longest
    backward match (capped at ``MAX_MATCH``; the latest among equals) and what followed it."""
    end = len(tokens) - 1
    if end < 1 or limit <= 0:
        return [], 0
    ends = [p for p in range(end - 1, 0, -1) if tokens[p - 1 : p + 1] == tokens[end - 1 : end + 1]]
    best, best_len = -1, 0
    for p in ends[:CHAIN]:
        m = 0
        while m < MAX_MATCH and p - m >= 0 and tokens[p - m] == tokens[end - m]:
            m += 1
        if m > best_len:
            best, best_len = p, m
    if best < 0:
        return [], 0
    out = list(tokens)
    while len(out) < best + 1 + limit:  # the copy goes on from the tokens it copied
        out.append(out[len(out) - (end - best)])
    return out[best + 1 : best + 1 + limit], best_len


TOKENS = st.integers(0, 3) | st.sampled_from([49151, 262143, 2**31 - 1])  # repeats, and ids of every width


@settings(max_examples=200, deadline=None)
@given(st.lists(TOKENS, max_size=80), st.integers(0, 80), st.integers(0, 12))
def test_the_index_finds_the_longest_recent_match_incrementally(tokens, split, limit):
    built = ContextIndex(tokens)
    grown = ContextIndex(tokens[:split])
    for t in tokens[split:]:
        grown.push(t)
    assert grown.prev == built.prev and grown.heads() == built.heads()  # vectorised build == pushes
    assert built.draft(limit) == oracle_draft(tokens, limit)


@settings(max_examples=200, deadline=None)
@given(st.lists(TOKENS, max_size=60), st.lists(TOKENS, max_size=8), st.integers(0, 12))
def test_a_draft_after_tokens_in_flight_is_the_drafted_conversations_and_leaves_the_index(
    tokens, after, limit
):
    """A run-ahead window drafts as if its window in flight's drafts were accepted (pushed, then
    popped): the draft of the longer conversation, and the index as it was."""
    index = ContextIndex(tokens)
    prev, head = list(index.prev), index.heads()
    assert index.draft(limit, after) == oracle_draft(tokens + after, limit)
    assert index.tokens == tokens and index.prev == prev and index.heads() == head


def test_the_index_drafts_a_copy_of_the_conversation():
    code = list(range(100, 160))
    index = ContextIndex([1, 2, *code, 3, 4])
    for t in code[:5]:  # the answer starts to repeat the code
        index.push(t)
    draft, match = index.draft(31)
    assert draft == code[5:36] and match == 5
    assert ContextIndex([5, 6, 7]).draft(4) == ([], 0)  # nothing repeats: no draft


# -- the governor ---------------------------------------------------------------------------------
def test_the_governor_drafts_long_when_rows_are_cheap_and_drafts_succeed():
    g = Governor(FixedCost(per_row=0.0))
    for _ in range(5):
        g.update(drafted=31, accepted=31, match=12)
    assert g.alpha(12) > 0.95 and g.length(31, match=12) == 31


def test_the_governor_shrinks_drafts_as_rows_cost_more():
    cheap, dear = Governor(FixedCost(per_row=0.001)), Governor(FixedCost(per_row=0.05))
    for g in (cheap, dear):
        g.update(drafted=8, accepted=4, match=5)
    assert cheap.length(31, match=5) > dear.length(31, match=5) > 0
    assert Governor(FixedCost(per_row=1.0)).length(31, match=20) == 0  # a row costs a step: never


def test_the_governor_trusts_long_matches_more():
    g = Governor(FixedCost(per_row=0.03))
    assert g.length(31, match=2) < g.length(31, match=10)


def test_the_governor_pauses_short_matches_with_exponential_backoff():
    g = Governor(FixedCost())
    pauses = []
    for _ in range(8):
        g.update(drafted=4, accepted=0, match=2)
        assert g.length(4, match=9) == 4  # a long match is drafted even now
        n = 0
        while g.length(4, match=2) == 0:
            g.step()
            n += 1
        pauses.append(n)
    assert pauses == [1, 3, 7, 15, 31, 63, MAX_PAUSE, MAX_PAUSE]
    g.update(drafted=4, accepted=2, match=2)  # a success ends the backoff
    assert g.failures == 0


def test_failing_short_drafts_stop_until_the_estimate_recovers():
    g = Governor(FixedCost(per_row=0.05))
    for _ in range(6):
        g.update(drafted=4, accepted=0, match=3)
    g.pause = 0
    assert g.length(31, match=3) == 0 and g.length(31, match=12) > 0  # other buckets unharmed
    for _ in range(100):
        g.step()
    assert g.length(31, match=3) > 0


def test_a_batch_makes_the_governor_weigh_the_other_turns():
    alone, batch = Governor(FixedCost(per_row=0.02)), Governor(FixedCost(per_row=0.02))
    batch.cost.company(8, 8)  # the step being gathered: eight one-row windows
    for g in (alone, batch):
        g.update(drafted=8, accepted=6, match=5)
    assert alone.length(31, match=5) > batch.length(31, match=5)


def test_step_costs_are_fitted_from_observed_steps():
    def windows(*rows: int, logits: int | None = None):
        return [SimpleNamespace(tokens=[0] * m, logits=m if logits is None else logits) for m in rows]

    c = StepCost()
    for _ in range(3):
        c.observe(windows(1), 0.010)
    for k in (2, 4, 8, 16, 32, 8, 2):
        c.observe(windows(k), 0.012 + 0.0005 * k)
    c.observe(windows(1, 512, logits=1), 9.0)  # a prefill chunk rode along: not a decode step
    c.observe(windows(12, logits=1), 9.0)  # nor is a short prefill (or rebase) chunk
    assert c.cost(1, False) == pytest.approx(0.010)
    assert c.cost(20, True) == pytest.approx(0.012 + 0.0005 * 20, rel=1e-3)
    c.company(3, 5)  # the scheduler says what the step being gathered holds
    assert (c.windows, c.rows) == (3, 5)


def test_room_for_a_draft_follows_every_new_observation_of_a_long_running_engine():
    """``StepCost.room`` is computed once per company and observation; the fits' weights settle
    after some hundred steps, so it must be keyed by the observations themselves: a batch's
    verify steps that turn expensive close the room even thousands of steps in."""

    def windows(*rows: int):
        return [SimpleNamespace(tokens=[0] * m, logits=m) for m in rows]

    c = StepCost()
    for _ in range(3000):  # cheap extra rows for a long while: a draft fits beside 7 others
        c.observe(windows(*[1] * 8), 0.010)
        c.observe(windows(*[1] * 7, 2), 0.0101)
    c.company(8, 8)
    assert c.room()
    for _ in range(200):  # then a verify row costs 10 % of the step
        c.observe(windows(*[1] * 7, 2), 0.011)
    assert not c.room()


# -- exact acceptance on a Markov source ----------------------------------------------------------
V0 = 3  # the chain's tokens: 0, 1, 2 (below the byte tokenizer's specials)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32"))


def markov_source(engine: Engine, table: torch.Tensor):
    """A ``run_step`` whose logits row for a row fed token ``t`` is ``table[t]`` (the chain's
    next-token logits; every other id -inf). Windows are planned and opened as in a real step."""
    vocab = engine.loaded.config.vocab_size

    def run_step(windows, prev=None):
        assert prev is None, "no run-ahead here: the rows' tokens are read from the windows"
        plan = plan_step(windows, engine.backend, engine.shape.device)
        fed = [t for w in windows for t in list(w.tokens)[len(w.tokens) - w.logits :]]
        logits = torch.full((len(fed), vocab), float("-inf"))
        logits[:, :V0] = table[torch.tensor(fed)]
        return StepResult(plan, logits)

    return run_step


TABLE = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 0.3], [1.5, -0.5, 0.8]])
PROMPT = [0, 1, 2, 0, 0, 1, 2, 2, 1, 0, 2, 1, 1, 0, 1, 2]  # every bigram occurs: drafts from the start


def sample_many(engine, params_for, n: int, max_tokens: int) -> list[tuple[int, ...]]:
    """``n`` turns (``params_for(i)``) of ``max_tokens`` tokens each, 64 at a time (a fresh bank
    per 64: a bank of thousands of entries would make this test slow, not better)."""
    out: list[list[int]] = [[] for _ in range(n)]
    for lo in range(0, n, 64):
        sched = Scheduler(engine, new_bank(engine, "64M"), max_running=64, max_batch_tokens=4096)
        for i in range(lo, min(lo + 64, n)):
            req = TurnRequest(PROMPT, params_for(i), max_tokens=max_tokens)
            sched.submit(
                req, lambda ev, i=i: out[i].append(ev.token_id) if isinstance(ev, GenEvent) else None
            )
        while sched.busy:
            sched.step()
    return [tuple(t for t in o if t is not None) for o in out]


def transformed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The oracle: temperature, then top-k, then the smallest top-p set (as OpenAI defines them)."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    if p.top_k:
        probs[order[p.top_k :]] = 0.0
        probs /= probs.sum()
    mass = 0.0
    for rank, i in enumerate(order):
        if mass >= p.top_p:
            probs[order[rank:]] = 0.0
            break
        mass += probs[i].item()
    return probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=2, ignore_eos=True),
        SamplingParams(temperature=1.3, top_p=0.8, ignore_eos=True),
    ],
)
def test_sampled_sequences_follow_the_target_distribution(engine, monkeypatch, params):
    monkeypatch.setattr(engine, "run_step", markov_source(engine, TABLE))
    monkeypatch.setattr(engine, "speculation", speculation())
    n, length = 2000, 4
    seqs = sample_many(engine, lambda i: replace(params, seed=1000 + i), n, length)
    stats = engine.speculation.stats
    assert stats.windows > 500 and 0 < stats.accepted < stats.drafted  # accepted and rejected drafts
    rows = {t: transformed(TABLE[t], params) for t in range(V0)}
    cells = list(itertools.product(range(V0), repeat=length))
    expected = []
    for seq in cells:
        p, prev = 1.0, PROMPT[-1]
        for t in seq:
            p *= rows[prev][t].item()
            prev = t
        expected.append(p * n)
    counts = {c: 0 for c in cells}
    for s in seqs:
        counts[s] += 1  # a token outside the chain's support would raise KeyError here
    live = [i for i, e in enumerate(expected) if e > 0]
    assert all(counts[cells[i]] == 0 for i, e in enumerate(expected) if e == 0)
    obs = [counts[cells[i]] for i in live]
    exp = [expected[i] for i in live]
    # fixed seeds: this p-value is the same on every run; 1e-3 would flag a real bias at n=2000
    assert chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue > 1e-3


def test_a_seeded_turn_emits_the_same_tokens_with_speculation_on_and_off(engine, monkeypatch):
    monkeypatch.setattr(engine, "run_step", markov_source(engine, TABLE))
    params = SamplingParams(temperature=0.9, top_p=0.95, ignore_eos=True)
    runs = {}
    for mode in ("off", "auto"):
        monkeypatch.setattr(engine, "speculation", speculation(mode))
        runs[mode] = sample_many(engine, lambda i: replace(params, seed=i), 64, 24)
    assert runs["auto"] == runs["off"]
    assert engine.speculation.stats.accepted > 100  # drafts were verified and kept


# -- the end of an answer inside a verify window ------------------------------------------------
A, B, C, EOS = 97, 98, 99, 256  # "a", "b", "c", <|endoftext|>


def cycle_source(engine: Engine, nxt: dict[int, int]):
    """A greedy ``run_step``: the row fed token ``t`` predicts ``nxt[t]`` (else token ``A``)."""
    vocab = engine.loaded.config.vocab_size

    def run_step(windows, prev=None):
        assert prev is None, "no run-ahead here: the rows' tokens are read from the windows"
        plan = plan_step(windows, engine.backend, engine.shape.device)
        fed = [t for w in windows for t in list(w.tokens)[len(w.tokens) - w.logits :]]
        logits = torch.zeros(len(fed), vocab)
        logits[torch.arange(len(fed)), torch.tensor([nxt.get(t, A) for t in fed])] = 10.0
        return StepResult(plan, logits)

    return run_step


def answer(engine: Engine, prompt: list[int], params: SamplingParams, max_tokens: int):
    """Events (token, text, finish) and the banked rows' token ids of one turn."""
    bank = new_bank(engine, "64M")
    events = []
    sched = Scheduler(engine, bank)
    sched.submit(TurnRequest(prompt, params, max_tokens=max_tokens), events.append)
    while sched.busy:
        sched.step()
    gens = [(e.token_id, e.text, e.finish_reason) for e in events if isinstance(e, GenEvent)]
    return gens, bank.entries()[0].tokens, [e.stats for e in events if isinstance(e, GenEvent)][-1]


@pytest.mark.parametrize(
    "cycle, params, max_tokens, finish",
    [
        ({A: B, B: C, C: A}, SamplingParams(ignore_eos=True), 10, "length"),  # max_tokens mid-window
        ({A: B, B: C, C: A}, SamplingParams(stop=("ca",)), 40, "stop"),  # a stop string mid-window
        ({A: B, B: C, C: EOS}, SamplingParams(), 40, "stop"),  # EOS drafted and accepted
    ],
)
def test_the_answer_ends_token_by_token_inside_a_verify_window(
    engine, monkeypatch, cycle, params, max_tokens, finish
):
    monkeypatch.setattr(engine, "run_step", cycle_source(engine, cycle))
    prompt = [A, B, C, A, B, C, EOS, 10, A, B, C, A, B, C, EOS, 10, A]  # the cycle, twice, as context
    monkeypatch.setattr(engine, "speculation", speculation("off"))
    plain = answer(engine, prompt, params, max_tokens)
    grown = engine.layout.stats.grown_rows
    monkeypatch.setattr(engine, "speculation", speculation("auto"))
    spec = answer(engine, prompt, params, max_tokens)
    assert spec[0] == plain[0] and spec[0][-1][2] == finish  # the same tokens, texts and end
    assert spec[1] == plain[1]  # the same rows banked: rejected and overhanging rows were dropped
    assert spec[2].accepted > 0 and spec[2].decode_forwards < plain[2].decode_forwards
    assert engine.layout.stats.grown_rows == grown  # the tail was sized for every window


def test_drafts_never_take_a_step_past_the_windows_a_graph_holds(engine, monkeypatch):
    """On CUDA every draft row is one more one-row window (``one_row_windows``), and a step past
    ``StepGraphs.max_windows`` of them would run eagerly: the scheduler drafts up to that bound
    and no further, while drafts still go on below it."""
    source = cycle_source(engine, {A: B, B: C, C: A})
    steps: list[list] = []

    def run_step(windows, prev=None):
        steps.append(list(windows))
        return source(windows, prev)

    monkeypatch.setattr(engine, "run_step", run_step)
    monkeypatch.setattr(engine, "speculation", speculation("auto"))
    monkeypatch.setattr(engine.graphs, "max_windows", 8, raising=False)
    sched = Scheduler(engine, new_bank(engine, "64M"), max_running=6)
    for i in range(6):
        prompt = [A, B, C, A, B, C, EOS, 10 + i, A, B, C, A, B, C, EOS, 10 + i, A]
        sched.submit(TurnRequest(prompt, SamplingParams(ignore_eos=True), max_tokens=24), lambda e: None)
    while sched.busy:
        sched.step()
    one_row = [sum(len(w.tokens) if w.logits == len(w.tokens) else 1 for w in ws) for ws in steps]
    assert max(one_row) <= 8  # decode rows, draft rows and prompt windows together
    assert any(len(w.tokens) > 1 for ws in steps for w in ws if w.logits == len(w.tokens))  # drafted


def test_the_cache_after_rejections_equals_a_plain_run(monkeypatch):
    """Real forwards (random:test, fp32, fp32 rows): the rows a speculative turn banks are the rows
    a plain turn banks -- the same token ids, K and V equal up to the rounding of a wider matmul
    (bf16 rows, a CPU's default, would round such a difference up to a bf16 step now and then)."""
    engine = load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", kv_dtype="float32"))
    with torch.no_grad():  # weights whose greedy answer partly loops: drafts kept and rejected
        engine.model.init_random(seed=7, std=0.1)
    prompt = [256, *b"the cat sat on the mat; the cat sat on the hat; the cat"]
    banked = {}
    for mode in ("off", "auto"):
        monkeypatch.setattr(engine, "speculation", speculation(mode))
        bank = new_bank(engine, "64M")
        events = []
        sched = Scheduler(engine, bank)
        sched.submit(TurnRequest(prompt, SamplingParams(ignore_eos=True), max_tokens=48), events.append)
        while sched.busy:
            sched.step()
        stats = [e.stats for e in events if isinstance(e, GenEvent)][-1]
        banked[mode] = (bank.entries()[0].snapshot, stats)
    (off, _), (on, s) = banked["off"], banked["auto"]
    assert s.accepted > 0 and s.drafted > s.accepted  # some drafts kept, some rolled back
    assert on.tokens == off.tokens
    k_on, v_on = on.read_rows(0, on.num_tokens)
    k_off, v_off = off.read_rows(0, off.num_tokens)
    torch.testing.assert_close(k_on, k_off, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_on, v_off, atol=1e-4, rtol=1e-4)


def test_an_unmeasured_verify_step_is_priced_by_its_extra_rows():
    c = StepCost()
    for _ in range(3):
        c.observe([SimpleNamespace(tokens=[0], logits=1)] * 8, 0.100)  # batch 8, plain
    assert c.cost(8, True) == pytest.approx(0.100)  # no verify step seen yet: only extra rows cost
    assert c.cost(8 + 32, True) == pytest.approx(0.100 * (1 + 32 * StepCost.PRIOR_ROW))


def test_auto_drafts_with_and_without_graphs_and_not_under_tensor_parallelism():
    """``--speculate auto`` is on where decode steps run eagerly (CPU) and where they replay CUDA
    graphs (verify windows replay decode graphs as one-row windows: ``Engine.stage``), off with
    the reason under tensor parallelism."""
    from turnkv.runtime import speculation_off

    assert speculation_off(1) is None and Speculation("auto", None).enabled  # graphs or not
    s = Speculation("auto", speculation_off(2))
    assert not s.enabled and s.for_turn([1, 2, 3]) is None
    assert s.stats.health()["status"].startswith("off: tensor parallelism")
    assert s.stats.health()["mode"] == "auto"
    off = Speculation("off").stats.health()
    assert off["status"] == "off: --speculate off"

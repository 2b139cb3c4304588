"""CUDA-graph decode: replays are bit-identical to eager steps (CUDA only; CI has no GPU).

Two engines share one model: one replays captured decode steps, one runs every step eagerly.
The same conversations run through both over several rounds (growing tails, a seal per turn,
merges of recent segments in between), at batch sizes that are captured sizes (so the eager step
has the same shapes); every decode step's logits must be equal bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.engine.step import Window
from turnkv.runtime import build, load_engine, new_bank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def record(engine: Engine) -> list[torch.Tensor]:
    """Wrap ``engine.run_step`` to keep a copy of every one-row-per-window step's logits."""
    seen: list[torch.Tensor] = []
    inner = engine.run_step

    def run_step(windows, prev=None):
        res = inner(windows, prev)
        if all(len(w.tokens) == 1 for w in windows):
            seen.append(res.logits.clone())
        return res

    engine.run_step = run_step
    return seen


def conversations(engine: Engine, batch: int, rounds: int) -> list[str]:
    # step for step alike on both engines: no run-ahead (it adds a row after an answer's end;
    # tests/test_run_ahead.py compares it with the plain loop)
    sched = Scheduler(
        engine, new_bank(engine, "8G"), max_running=batch, max_batch_tokens=4096, run_ahead=False
    )
    history = [[256, *(t % 250 for t in range(10 + i, 10 + i + 300 + 97 * i))] for i in range(batch)]
    texts = []
    for r in range(rounds):
        answers: list[list[int]] = [[] for _ in range(batch)]
        for i in range(batch):
            req = TurnRequest(list(history[i]), SamplingParams(ignore_eos=True), max_tokens=24 + 8 * r)
            sched.submit(
                req, lambda ev, a=answers[i]: a.append(ev.token_id) if isinstance(ev, GenEvent) else None
            )
        while sched.busy:
            sched.step()
        for i in range(batch):
            toks = [t for t in answers[i] if t is not None]
            texts.append(" ".join(map(str, toks)))
            history[i] += [*toks[:-1], 300 + r, *(t % 250 for t in range(20, 60 + 40 * r))]  # the follow-up
    return texts


@pytest.mark.parametrize("batch", [1, 4])
def test_replays_are_bit_identical_to_eager_steps(batch):
    # the same steps on both: speculation (on where decode runs eagerly) would change them
    cfg = EngineConfig(
        model="random:test", device="cuda", dtype="bfloat16", attention="auto", speculate="off"
    )
    graphs = load_engine(cfg)
    assert graphs.backend.name == "fused" and graphs.info.graphs == "on"
    eager = Engine(graphs.loaded, replace(cfg, cuda_graphs="off"))
    a, b = record(graphs), record(eager)
    ta = conversations(graphs, batch, rounds=4)
    tb = conversations(eager, batch, rounds=4)
    assert graphs.graphs.replays > 50 and eager.graphs.replays == 0
    assert len(a) == len(b) > 50
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert ta == tb
    assert graphs.layout.stats.merges > 0  # merges happened between the rounds


def test_speculation_replays_verify_windows_and_keeps_the_greedy_text():
    """With ``--speculate auto`` on CUDA a verify window runs as one-row windows in a replayed
    decode graph, and drafting turns run ahead: each row rounds as it would decoded alone, so a
    conversation alone answers token for token as without speculation, at any context (the
    drafts stop at the key bucket: 4096 is crossed here)."""
    cfg = EngineConfig(model="random:test", device="cuda", dtype="bfloat16", attention="auto")
    on = load_engine(cfg)
    off = Engine(on.loaded, replace(cfg, speculate="off"))
    texts = {}
    for name, engine in (("on", on), ("off", off)):
        sched = build(cfg, "bench", engine=engine).scheduler(new_bank(engine, "8G"), max_running=1)
        got = texts[name] = []
        for i, n in enumerate((40, 600, 4070)):  # a loop the drafts copy; the last crosses 4096 keys
            loop = [256, *([40 + i, 41, 42, 43, 44, 45, 46] * (n // 7))]
            answer: list[int] = []
            req = TurnRequest(loop, SamplingParams(ignore_eos=True), max_tokens=64)
            sched.submit(
                req, lambda ev, a=answer: a.append(ev.token_id) if isinstance(ev, GenEvent) else None
            )
            while sched.busy:
                sched.step()
            got.append(answer)
        assert sched.pipeline.run_ahead and engine.graphs.replays > 0
    assert texts["on"] == texts["off"]
    stats = on.speculation.stats
    assert stats.status == "on" and stats.drafted > 0 and stats.windows > 0


def test_a_steps_logits_are_its_own_after_later_replays_of_its_graph():
    """A replay rewrites its graph's output buffer: a step's logits, kept by a caller (a reference
    row, issue 33's test), must not change when a later step replays the same graph (one decode
    graph of batch 1 here, and one mixed graph of a narrow prompt window)."""
    cfg = EngineConfig(model="random:test", device="cuda", dtype="bfloat16", speculate="off")
    engine = load_engine(cfg)
    caches = [engine.new_cache() for _ in range(3)]
    kept = []
    for i, cache in enumerate(caches):  # the same graph keys for each conversation
        kept.append(engine.run_step([Window(cache, list(range(10 + i, 27 + i)), logits=1)]).logits)
        cache.commit(list(range(10 + i, 27 + i)))
        kept.append(engine.run_step([Window(cache, [40 + i])]).logits)
        cache.commit([40 + i])
    copies = [t.clone() for t in kept]
    later = engine.new_cache()
    engine.run_step([Window(later, list(range(60, 80)), logits=1)])
    later.commit(list(range(60, 80)))
    engine.run_step([Window(later, [5])])
    assert engine.graphs.replays >= 8
    assert all(torch.equal(a, b) for a, b in zip(kept, copies, strict=True))
    assert not torch.equal(kept[0], kept[2])  # different prompts: different logits


def test_a_step_past_the_rope_tables_drops_the_graphs_that_read_them():
    """The engine sizes the rope tables to its context limit (4096 here); a direct engine caller
    may go past it, which grows the tables and frees the old ones that every graph captured so far
    reads (a gather bounded by their old length: a device assert). Those graphs are dropped and
    captured again, so each step past 4096 equals it run eagerly."""
    cfg = EngineConfig(model="random:test", device="cuda", dtype="bfloat16", speculate="off")
    on = load_engine(cfg)
    off = Engine(on.loaded, replace(cfg, cuda_graphs="off"))
    got = {}
    for name, engine in (("on", on), ("off", off)):
        cache = engine.new_cache()
        engine.prefill(cache, [t % 250 for t in range(4000)])
        rows = got[name] = []
        for i in range(140):  # decode from position 4000 across 4096
            rows.append(engine.run_step([Window(cache, [1 + i % 250])]).logits)
            cache.commit([1 + i % 250])
    assert on.graphs.replays >= 140 and off.graphs.replays == 0
    assert all(torch.equal(a, b) for a, b in zip(got["on"], got["off"], strict=True))

"""Steps with prompt rows replay captured graphs (engine/graphs.py), bit for bit as the same
staged step run eagerly (CUDA only; CI has no GPU: tests/test_graph_inputs.py and
tests/test_triton_segments.py cover the host side and the padded attention launch on the CPU).

Through the scheduler: prompts prefilled in chunks beside decode rows, verify windows of
context-copy drafts and a turn under a grammar in the same steps, run-ahead on (the CUDA
default). Every step with prompt rows is run eagerly on its graph's buffers first
(``StepGraphs.eager``, what a capture's warm-up runs), then replayed: logits equal bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

from turnkv.config import EngineConfig
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.runtime import build, load_engine, new_bank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def loop(n: int, seed: int) -> list[int]:
    """A prompt the context copy drafts from (a repeated phrase)."""
    return [256, *([40 + seed, 41, 42, 43, 44, 45, 46] * (n // 7))]


def test_mixed_steps_replay_bit_for_bit_as_eager_with_drafts_and_a_grammar_beside():
    cfg = EngineConfig(model="random:test", device="cuda", dtype="bfloat16", attention="auto")
    engine = load_engine(cfg)
    graphs = engine.graphs
    assert engine.backend.name == "fused" and graphs.status == "on"
    sched = build(cfg, "bench", engine=engine).scheduler(
        new_bank(engine, "8G"), max_running=8, max_batch_tokens=256
    )
    assert sched.pipeline.run_ahead
    compared, kinds, constrained = [], [], set()

    replay = graphs.replay

    def checked(staged, prev=None):
        if not staged.mixed:
            return replay(staged, prev)
        eager = graphs.eager(staged, prev).logits.clone()
        got = replay(staged, prev)
        compared.append(torch.equal(eager, got.logits))
        kinds.append(
            {
                "prefill" if len(w.tokens) > 32 else "decode" if len(w.tokens) == 1 else "short"
                for w in staged.windows
            }
            | ({"verify"} if len(staged.windows) > len({id(w.cache) for w in staged.windows}) else set())
            | ({"grammar"} if constrained & {id(w.cache) for w in staged.windows} else set())
        )
        return got

    graphs.replay = checked
    launch = sched.pipeline.launch

    def noted(work, *args, **kw):
        constrained.update(id(w.cache) for e, w in work if e.turn.constraint is not None)
        return launch(work, *args, **kw)

    sched.pipeline.launch = noted
    answers: dict[str, list[int]] = {}

    def submit(name, req):
        got = answers.setdefault(name, [])
        sched.submit(req, lambda ev: got.append(ev.token_id) if isinstance(ev, GenEvent) else None)

    grammar = None
    try:
        from turnkv.chat_format.grammar import Grammars

        schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                  "b": {"enum": ["x", "yz"]}}, "required": ["a", "b"]}  # fmt: skip
        grammar = Grammars(engine.tokenizer, engine.loaded.config.vocab_size).json_schema(schema)
    except ImportError:  # llguidance: a project dependency (dev_tests.sh installs it on the device)
        pass
    for i in range(3):  # decoding loops that draft, beside the long prompts below
        submit(f"d{i}", TurnRequest(loop(60 + 30 * i, i), SamplingParams(ignore_eos=True), max_tokens=80))
    for _ in range(3):
        sched.step()
    if grammar is not None:
        submit("g", TurnRequest(loop(20, 9), SamplingParams(), max_tokens=60, grammar=grammar))
    for i in range(3):  # long prompts, prefilled in chunks of the 256-row budget
        submit(f"p{i}", TurnRequest(loop(700 + 333 * i, 5 + i), SamplingParams(ignore_eos=True), 24))
        sched.step()
    while sched.busy:
        sched.step()
    assert len(compared) > 10 and all(compared)
    assert graphs.mixed_replays >= len(compared) and graphs.captures > 0
    assert any({"prefill", "decode"} <= k for k in kinds)
    assert any({"prefill", "verify"} <= k for k in kinds), kinds
    assert engine.speculation.stats.drafted > 0
    if grammar is not None:
        assert any({"prefill", "grammar"} <= k for k in kinds), kinds
        text = engine.tokenizer.decode([t for t in answers["g"] if t is not None])
        assert json.loads(text)["b"] in ("x", "yz")
    assert all(len(answers[f"p{i}"]) >= 24 for i in range(3))


def test_one_mixed_graph_serves_every_context_its_split_count_read_from_the_table():
    """The same step shape over a short and a long history (past the first key bucket: a decode
    row's split count doubles there) stages one graph key and one capture; each step's split
    count is its own, in the segment table, and each replay equals its step run eagerly."""
    from turnkv.engine.step import Window

    cfg = EngineConfig(model="random:test", device="cuda", dtype="bfloat16", speculate="off")
    engine = load_engine(cfg)
    graphs = engine.graphs
    seen = []
    replay = graphs.replay

    def checked(staged, prev=None):
        eager = graphs.eager(staged, prev).logits.clone()
        got = replay(staged, prev)
        counts = [int(staged.step.packed[lc.offset + 6]) for lc in staged.step.launches]
        seen.append((staged.key, counts, torch.equal(eager, got.logits)))
        return got

    histories = []
    for context in (100, 5000):
        histories.append(engine.new_cache())
        engine.prefill(histories[-1], loop(context, 1))
    before = graphs.captures
    graphs.replay = checked
    for history in histories:
        engine.run_step([Window(history, [7]), Window(engine.new_cache(), loop(45, 2)[:40], logits=1)])
    (key_a, counts_a, same_a), (key_b, counts_b, same_b) = seen
    assert key_a == key_b and same_a and same_b
    assert counts_a[0] < counts_b[0]  # the decode row's table: more splits past 4096 keys
    assert graphs.captures == before + 1


def test_a_warm_up_step_captures_its_graph_without_replaying_it_and_the_replay_is_the_eager_step():
    """``Engine.warm_step`` (the warm-up's capture_mixed and verify steps): the graph is captured,
    nothing is replayed; the next step of that key replays it, equal to the eager step bit for bit."""
    from turnkv.engine.step import Window

    cfg = EngineConfig(model="random:test", device="cuda", dtype="bfloat16", attention="auto")
    engine = load_engine(cfg)
    graphs = engine.graphs

    def windows():
        caches = [engine.new_cache(), engine.new_cache()]
        engine.prefill(caches[1], list(range(40, 90)))
        return [Window(caches[0], list(range(100, 300)), logits=1), Window(caches[1], [7])]

    first = windows()  # (its prefill runs steps of its own)
    captures, replays = graphs.captures, graphs.replays
    engine.warm_step(first)
    assert graphs.captures == captures + 1 and graphs.replays == replays  # captured, not replayed
    staged = engine.stage(windows()).step
    assert graphs.graphs.get(staged.key) is staged.captured  # the next step of the key has a graph
    eager = graphs.eager(staged).logits.clone()
    assert torch.equal(graphs.replay(staged).logits, eager) and graphs.captures == captures + 1

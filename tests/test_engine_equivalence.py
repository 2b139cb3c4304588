"""Cached == uncached: greedy text through turns, /undo rollback and a fork is identical for the
segmented layout, the contiguous layout and recomputation from scratch every turn.

Runs the real default model (SmolLM2-135M-Instruct, fp32 on CPU) with its weights dequantized
(``weights="dequant"``): fp32 end to end, so the paths agree to ~1e-6 and greedy text is exact.
The packed-weight path (bf16 activations) is held to the same script within a stated tolerance
in tests/test_quant_default.py. Also checks that the follow-up
turns really were served from the cache (cached_tokens, no gather) and that a multi-row window
gives the same logits as the same rows one at a time.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from turnkv.chat import ChatSession
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=12)
SCRIPT = [
    ("ask", "Name a large river in Europe."),
    ("ask", "Which countries does it flow through?"),
    ("ask", "Say one fact about its length."),
    ("undo",),
    ("ask", "Which sea does it end in?"),
    ("fork", "Name a city on that river."),  # from the snapshot after turn 2
    ("ask", "Thank you. Now name a mountain."),
]


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    seg = Engine.from_config(
        EngineConfig(kv_layout="segmented", device="cpu", weights="dequant"), progress=False
    )
    con = Engine(seg.loaded, replace(seg.cfg, kv_layout="contiguous"))
    return {"segmented": seg, "contiguous": con}


def run_script(engine: Engine, fresh_each_turn: bool) -> tuple[list[str], list[int]]:
    session = ChatSession(engine, PARAMS)
    answers, cached = [], []
    fork_point = None
    for step in SCRIPT:
        if step[0] == "undo":
            assert session.undo()
            continue
        if step[0] == "fork":
            messages, snap = fork_point
            forked = ChatSession(engine, PARAMS)
            forked.messages = list(messages)
            forked.cache = engine.new_cache() if fresh_each_turn else engine.restore(snap)
            answers.append("".join(forked.ask(step[1])))
            cached.append(forked.last.cached_tokens)
            continue
        if fresh_each_turn:
            session.cache = engine.new_cache()
        answers.append("".join(session.ask(step[1])))
        cached.append(session.last.cached_tokens)
        if len(answers) == 2:
            fork_point = (list(session.messages), session.cache.snapshot())
    return answers, cached


def test_greedy_text_identical_across_layouts_and_recompute(engines):
    seg_text, seg_cached = run_script(engines["segmented"], fresh_each_turn=False)
    con_text, con_cached = run_script(engines["contiguous"], fresh_each_turn=False)
    ref_text, ref_cached = run_script(engines["segmented"], fresh_each_turn=True)
    assert seg_text == ref_text
    assert con_text == ref_text
    assert all(a for a in ref_text)
    assert ref_cached == [0] * len(ref_cached)
    # every follow-up and the fork reuse the history; undo trimmed without recompute
    assert seg_cached[0] == 0 and all(c > 0 for c in seg_cached[1:])
    assert seg_cached == con_cached
    counts = engines["segmented"].router.route_counts
    assert not any(k.startswith("gather") for k in counts)
    assert any(k.startswith("lse") for k in counts), counts  # several segments were attended


def test_window_of_rows_equals_rows_one_at_a_time(engines):
    engine = engines["segmented"]
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to ten."}])
    a = engine.new_cache()
    engine.prefill(a, ids[:-7])
    a.seal()  # the window attends over a sealed segment and the tail
    wide = engine.forward_window(a, ids[-7:])  # one window of 7 query rows
    b = engine.new_cache()
    engine.prefill(b, ids[:-7])
    b.seal()
    rows = []
    for t in ids[-7:]:
        rows.append(engine.forward_window(b, [t])[-1])
        b.commit([t])
    torch.testing.assert_close(wide, torch.stack(rows), atol=2e-4, rtol=2e-4)
    assert torch.equal(wide.argmax(-1), torch.stack(rows).argmax(-1))

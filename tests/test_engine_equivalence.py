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
from turnkv.engine.step import Window
from turnkv.runtime import build, load_engine

pytestmark = pytest.mark.slow

PARAMS = SamplingParams()
SCRIPT = [
    ("ask", "Name a large river in Europe."),
    ("ask", "Which countries does it flow through?"),
    ("ask", "Say one fact about its length."),
    ("undo",),
    ("ask", "Which sea does it end in?"),
    ("fork", "Name a city on that river."),  # from the conversation after turn 2
    ("ask", "Thank you. Now name a mountain."),
]


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    seg = load_engine(
        # fp32 rows: windows are compared at fp32 tolerance (bf16 rows would round a row's fp32
        # differences to bf16 steps; tests/test_kv_dtype.py holds bf16 rows to their own bound)
        EngineConfig(kv_layout="segmented", device="cpu", weights="dequant", kv_dtype="float32"),
        progress=False,
    )
    con = Engine(seg.loaded, replace(seg.cfg, kv_layout="contiguous"))
    return {"segmented": seg, "contiguous": con}


def run_script(engine: Engine, fresh_each_turn: bool) -> tuple[list[str], list[int]]:
    """The script through ``ChatSession`` (the server's turn path with a private bank). With
    ``fresh_each_turn`` every turn runs in a namespace of its own: nothing is reused."""
    session = ChatSession(build(engine.cfg, "chat", engine=engine), PARAMS, max_tokens=12)
    answers, cached = [], []
    fork_point = None
    fresh = iter(range(1000))

    def ask(s: ChatSession, text: str) -> None:
        if fresh_each_turn:
            s.namespace = f"fresh-{next(fresh)}"
        answers.append("".join(s.ask(text)))
        cached.append(s.last.cached_tokens)

    for step in SCRIPT:
        if step[0] == "undo":
            assert session.undo()
        elif step[0] == "fork":
            ask(fork_point, step[1])
        else:
            ask(session, step[1])
            if len(answers) == 2:
                fork_point = session.fork()
    return answers, cached


def test_greedy_text_identical_across_layouts_and_recompute(engines):
    seg_text, seg_cached = run_script(engines["segmented"], fresh_each_turn=False)
    con_text, con_cached = run_script(engines["contiguous"], fresh_each_turn=False)
    ref_text, ref_cached = run_script(engines["segmented"], fresh_each_turn=True)
    assert seg_text == ref_text
    assert con_text == ref_text
    assert all(a for a in ref_text)
    assert ref_cached == [0] * len(ref_cached)
    # every follow-up and the fork reuse the history; undo restored a prefix without recompute
    assert seg_cached[0] == 0 and all(c > 0 for c in seg_cached[1:])
    assert seg_cached == con_cached


def test_window_of_rows_equals_rows_one_at_a_time(engines):
    engine = engines["segmented"]
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to ten."}])

    def history():
        cache = engine.new_cache()
        engine.run_step([Window(cache, ids[:-7], logits=0)])
        cache.commit(ids[:-7])
        cache.seal()  # the window attends over a sealed segment and the tail
        return cache

    a = history()
    wide = engine.run_step([Window(a, ids[-7:], logits=7)])  # one window of 7 query rows
    assert wide.plan.labels == ["lse_q7"]
    b = history()
    rows = []
    for t in ids[-7:]:
        rows.append(engine.run_step([Window(b, [t])]).logits[-1])
        b.commit([t])
    torch.testing.assert_close(wide.logits, torch.stack(rows), atol=2e-4, rtol=2e-4)
    assert torch.equal(wide.logits.argmax(-1), torch.stack(rows).argmax(-1))

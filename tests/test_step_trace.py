"""``TURNKV_STEP_TRACE=FILE``: one JSON line per completed step, its host marks in order and its
rows as the step ran them (prompt chunks beside decode rows counted apart); off by default."""

from __future__ import annotations

import json

from turnkv.config import EngineConfig
from turnkv.engine.events import TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.runtime import load_engine, new_bank


def run_turns(engine) -> Scheduler:
    sched = Scheduler(engine, new_bank(engine, "64M"), max_running=4, max_batch_tokens=16)
    for i, (n, m) in enumerate(((40, 5), (7, 9))):  # the 40-row prompt prefills in chunks of 16
        prompt = [256, *((3 * i + 7 * j) % 250 for j in range(n - 1))]
        sched.submit(
            TurnRequest(prompt, SamplingParams(ignore_eos=True), m, namespace=f"c{i}"), lambda ev: None
        )
    while sched.busy:
        sched.step()
    return sched


def test_each_step_writes_one_line_with_its_marks_and_rows(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TURNKV_STEP_TRACE", str(path))
    engine = load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", speculate="off"))
    sched = run_turns(engine)
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    assert len(lines) == sched.pipeline.stats.steps > 0
    for rec in lines:
        assert rec["launch"] <= rec["launched"] <= rec["sync"] <= rec["synced"] <= rec["done"]
        assert 0 <= rec["prompt_rows"] <= rec["rows"] and 1 <= rec["windows"] <= rec["rows"]
        assert "device_ms" not in rec  # CPU: no device timeline
    # every row went through a step: the prompts' 47 and each answer's after its first (the last
    # prompt chunk yields the first token), in steps of at most the budget; prompt rows are those
    # of windows that skip some logits (a one-row last chunk reads as a decode row)
    assert sum(r["rows"] for r in lines) == 47 + (5 - 1) + (9 - 1)
    assert 47 - 2 <= sum(r["prompt_rows"] for r in lines) <= 47
    assert max(r["rows"] for r in lines) <= 16


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("TURNKV_STEP_TRACE", raising=False)
    engine = load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", speculate="off"))
    assert run_turns(engine).pipeline.trace is None

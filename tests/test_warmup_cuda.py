"""On CUDA: a server started with an empty Triton cache compiles and captures nothing after ready.

``turnkv serve --model random:llama3-8b`` in a child process whose cache home (and so its Triton
cache) is an empty directory; ``/health`` answers 503 while it loads and warms, then ok; a mixed
workload (staggered clients, documents of 200-3300 tokens, short questions and follow-ups beside
each other's decode rows; greedy, sampled, grammar-masked and logprob rows; then one client
alone) leaves ``jit_after_ready`` at 0, and nothing compiled inside a capture. A sealed graph
set (``StepGraphs.seal``, after the warm-up) runs a key it has not captured eagerly, with the
bits its replay would give. Skipped without CUDA (run on the device).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cold_start_then_a_mixed_workload_compiles_nothing_after_ready(tmp_path):
    from bench.startup_gpu import ServeProcess, measure

    srv = ServeProcess("random:llama3-8b", str(tmp_path), "--device", "cuda", "--no-disk")
    try:
        figures = measure("cold", srv)  # ready, two ~3.3K-token requests, the mixed workload
        print(json.dumps(figures))  # the cold row of bench/startup_gpu.py (run with -s)
        assert srv.statuses[0] in ("loading", "warming") and srv.statuses[-1] == "ok", srv.statuses
        assert any((tmp_path / "turnkv" / "triton").iterdir()), "the Triton cache is not under the cache home"
        assert not figures["mixed"]["errors"], figures["mixed"]["errors"]
        sched = srv.health()["scheduler"]
        assert sched["warm"] is True and sched["jit_status"] == "on"
        assert sched["jit_after_ready"] == 0, (
            sched["jit_late"],
            [x for x in srv.lines if "after ready" in x],
        )
        assert not [x for x in srv.lines if "step failed" in x or "inside a CUDA-graph capture" in x]
    finally:
        srv.stop()
        # what the server warned about (late compiles, graph misses), for the log of a run with -s
        print("\n".join(x for x in srv.lines if "WARNING" in x or "ERROR" in x or "ready in" in x)[-12000:])


def test_a_sealed_graph_set_runs_an_uncaptured_step_eagerly_with_the_bits_of_its_replay():
    from turnkv.config import EngineConfig
    from turnkv.engine.step import Window
    from turnkv.runtime import load_engine

    engine = load_engine(EngineConfig(model="random:test", device="cuda", dtype="bfloat16"))
    graphs = engine.graphs
    assert graphs.status == "on"
    doc, chat = engine.new_cache(), engine.new_cache()
    engine.prefill(doc, list(range(100, 300)))
    engine.prefill(chat, list(range(400, 450)))

    def step() -> torch.Tensor:  # a prompt chunk beside a decode row, not committed (rerun alike)
        return engine.run_step([Window(doc, list(range(7, 77)), logits=1), Window(chat, [5])]).logits.clone()

    before = graphs.captures
    graphs.seal()
    eager = step()
    assert (graphs.captures, graphs.misses, len(graphs.missed)) == (before, 1, 1)
    graphs.sealed = False  # (as before a warm-up ends: the first step of a key captures it)
    replayed = step()
    assert graphs.captures == before + 1 and torch.equal(eager, replayed)

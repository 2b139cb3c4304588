"""Warm before ready: what a starting server answers, what the warm-up drives, what is counted.

The served app is the real one (``server.run.start``: load, warm-up, open), its warm-up held on
an event so the test sees the gate while it warms; the warm-up's plan is checked against the
buckets a CUDA server captures (GRAPH_BATCHES) without a GPU.
"""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
import uvicorn

from turnkv.attention.segment_table import GRAPH_BATCHES
from turnkv.config import EngineConfig
from turnkv.engine import warmup
from turnkv.engine.jit_watch import JitWatch
from turnkv.server.run import serve, start, uvicorn_config
from turnkv.server.warming import WarmGate

pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_warming_then_ok_and_503_with_retry_after_meanwhile(monkeypatch, default_model, tmp_path):
    held, release = threading.Event(), threading.Event()
    drive = warmup._drive

    def slow(*a, **kw):  # the warm-up's first turn waits for the test
        held.set()
        assert release.wait(60)
        return drive(*a, **kw)

    monkeypatch.setattr(warmup, "_drive", slow)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = EngineConfig(device="cpu", bank_bytes="256M", no_disk=True, no_ram=True)
    progress = warmup.WarmProgress()
    gate = WarmGate(progress, cfg.model)
    port = _port()
    uv = uvicorn.Server(uvicorn_config(gate, cfg, host="127.0.0.1", port=port))
    threading.Thread(target=uv.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = httpx.get(url + "/health")  # listening before the model is even loaded
        assert r.status_code == 503 and r.json()["status"] in ("loading", "warming")
        threading.Thread(target=start, args=(cfg, gate, progress, port), daemon=True).start()
        assert held.wait(120), "the warm-up never started"
        r = httpx.get(url + "/health")
        doc = r.json()
        assert r.status_code == 503 and doc["status"] == "warming"
        assert doc["warmup"]["phase"] == "smoke" and (doc["warmup"]["done"], doc["warmup"]["total"]) == (0, 1)
        body = {"model": cfg.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"):
            r = httpx.post(url + path, json=body) if path != "/v1/models" else httpx.get(url + path)
            assert r.status_code == 503 and r.headers["retry-after"] == "5", path
            err = r.json()["error"]  # OpenAI's shape
            assert err["code"] == "warming_up" and "retry" in err["message"], path
        r = httpx.post(url + "/v1/messages", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
        release.set()
        deadline = time.monotonic() + 120
        while (r := httpx.get(url + "/health")).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.05)
        doc = r.json()
        assert doc["status"] == "ok" and doc["scheduler"]["warm"] is True
        assert doc["scheduler"]["jit_after_ready"] == 0
        assert doc["scheduler"]["warmup"]["turns"] == 1 and doc["scheduler"]["warmup"]["failed"] == 0
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        metrics = httpx.get(url + "/metrics").text
        assert "turnkv_jit_after_ready_total 0.0" in metrics and "turnkv_jit_in_capture_total" in metrics
    finally:
        release.set()
        uv.should_exit = True


def test_a_load_that_fails_stops_the_listening_server(tmp_path):
    cfg = EngineConfig(model=str(tmp_path / "missing"), device="cpu", port=_port(), no_disk=True)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="missing"):
        serve(cfg)
    assert time.monotonic() - t0 < 60


def _cuda_sched(budget=512, running=64, max_context=131072):
    engine = SimpleNamespace(
        loaded=SimpleNamespace(config=SimpleNamespace(vocab_size=128256)),
        shape=SimpleNamespace(device=torch.device("cuda")),
        max_context=max_context,
    )
    return SimpleNamespace(engine=engine, max_batch_tokens=budget, max_running=running)


def test_the_cuda_plan_covers_every_decode_batch_key_bucket_and_row_count():
    phases = dict(warmup.plan(_cuda_sched(), grammar="G"))
    assert list(phases) == ["prefill", "decode", "history", "mixed"]
    # prompt chunks alone, one turn per group: every power of two to the budget and one past it
    lengths = [len(g[0].request.prompt) for g in phases["prefill"]]
    assert all(len(g) == 1 for g in phases["prefill"])
    for p in (1, 2, 16, 64, 256, 512):
        assert p in lengths and (p + 1 in lengths or p == 512)
    assert 513 + 2 in lengths and 1025 in lengths  # past the budget: chunked
    # decode groups: each captured batch size, short and beside each longer key bucket
    groups = phases["decode"]
    sizes = sorted({len(g) for g in groups})
    assert sizes == list(GRAPH_BATCHES)
    longest = {max(len(a.request.prompt) for a in g) for g in groups}
    assert set(warmup.LONG_CONTEXTS) <= longest
    long_prompts = {tuple(a.request.prompt) for g in groups for a in g if len(a.request.prompt) > 4096}
    assert len(long_prompts) == len(warmup.LONG_CONTEXTS)  # one per bucket: the bank restores it
    # follow-up chunks over every power of two of history, a prefix of the banked long prompt
    (long,) = [p for p in long_prompts if len(p) == max(map(len, long_prompts))]
    follow = [g[0].request.prompt for g in phases["history"]]
    assert {64, 1024, 8192} <= {h for h in (64, 1024, 8192) if any(p[:h] == list(long[:h]) for p in follow)}
    assert {2, 40, 512} <= {len(p) - h for p in follow for h in (64, 4096) if p[:h] == list(long[:h])}
    # mixed: for each captured batch of decode rows (greedy, sampled, logprob and grammar rows
    # among them), prompts that fill the step to each power-of-two row bucket, a short one, a pair
    mixed = phases["mixed"]
    assert sorted({len([a for a in g if a.at == 0]) for g in mixed}) == [1, 2, 4, 8, 16, 32, 62]
    for g in mixed:
        decoders = [a.request for a in g if a.at == 0]
        b = len(decoders)
        totals = {len(a.request.prompt) + b for a in g if a.at > 0}
        assert {r for r in (64, 128, 256, 512) if r - b > 32} <= totals
        assert 17 + b in totals  # a narrow window beside the decode rows
        ats = [a.at for a in g if a.at > 0]
        assert ats.count(max(ats)) == 2  # two prompts arrive together: a wide table of two
        assert max(r.max_tokens for r in decoders) >= 2 * len(ats)  # still decoding at the pair
        if b >= 8:
            assert sum(r.grammar == "G" for r in decoders) == 2 and any(r.logprobs for r in decoders)
            assert any(r.params.temperature > 0 for r in decoders)
    assert all(a.request.params.ignore_eos for g in groups for a in g)


def test_verify_steps_cover_solo_and_company_decode_graphs():
    """Verify windows: alone at each padded row count, beside 1, 3 and 7 other conversations."""
    runs = []

    class Engine:
        loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=128256))
        shape = SimpleNamespace(device=torch.device("cuda"))
        backend = SimpleNamespace(cuts_verify_windows=True)
        max_context = 131072

        def new_cache(self):
            return SimpleNamespace(n=0)

        def prefill(self, cache, tokens):
            cache.n = len(tokens)

        def warm_step(self, windows):
            runs.append([(w.cache.n, len(w.tokens), w.logits) for w in windows])

    assert warmup.verify_steps(Engine()) == len(runs)
    solo = {(run[0][0], run[0][1]) for run in runs if len(run) == 1}
    assert solo == {(c, r) for c in (64, warmup.LONG_CONTEXTS[0]) for r in (2, 3, 5, 9, 17)}
    for run in runs:
        (ctx, rows, logits), *others = run
        assert logits == rows > 1 and all(o == (ctx, 1, 1) for o in others)  # a verify window first
        padded = next(b for b in GRAPH_BATCHES if b >= rows + len(others))
        assert rows + len(others) in (padded, rows + len(others)) and rows <= 32
    company = {(len(run), run[0][1] + len(run) - 1) for run in runs if len(run) > 1}
    assert {(2, 4), (4, 8), (8, 16), (8, 32), (2, 32)} <= company  # (conversations, rows)


def test_the_plan_stays_inside_the_context_and_the_running_set():
    phases = dict(warmup.plan(_cuda_sched(budget=256, running=8, max_context=6000), grammar=None))
    assert max(len(g) for g in phases["decode"]) == 8
    assert max(len(a.request.prompt) for _, gs in phases.items() for g in gs for a in g) < 6000
    assert all(a.request.grammar is None for a in phases["mixed"][0])


def test_cpu_warmup_is_one_short_turn():
    cpu = _cuda_sched()
    cpu.engine.shape.device = torch.device("cpu")
    ((name, [[arrival]]),) = warmup.plan(cpu)
    assert name == "smoke" and len(arrival.request.prompt) == 16 and arrival.request.max_tokens == 2


def test_jit_watch_counts_compiles_and_captures_after_ready():
    pytest.importorskip("triton")
    from triton import knobs

    before = knobs.runtime.jit_post_compile_hook
    try:
        w = JitWatch()
        assert w.install() == "on"
        engine = SimpleNamespace(graphs=SimpleNamespace(captures=3))
        knobs.runtime.jit_post_compile_hook(key="k", repr="warm_kernel")
        assert (w.compiles, w.after_ready(engine)) == (1, 0)  # not ready yet: nothing is late
        w.mark_ready(engine)
        knobs.runtime.jit_post_compile_hook(key="k2", repr="late_kernel")
        engine.graphs.captures += 1
        assert w.after_ready(engine) == 2 and w.late == ["late_kernel"] and w.in_capture == 0
    finally:
        knobs.runtime.jit_post_compile_hook = before


def test_graph_keys_in_words():
    from turnkv.attention.backend import MixedLaunch, TableLaunch
    from turnkv.engine.graphs import describe

    assert describe((8, 8, 4, False)) == "decode batch 8, splits 4"  # (batch, logit rows, splits, solo)
    assert describe((2, 2, 16, True)) == "decode batch 2, splits 16, solo"
    cfg = SimpleNamespace(block_m=128, block_n=128, splits=3)
    key = (512, 5, MixedLaunch(TableLaunch(4, 1, cfg), TableLaunch(1, 512, cfg)), False)
    assert describe(key) == (
        "mixed 512 rows, 5 logit rows: narrow batch 4 x 1 rows, tiles 128x128, room for 3 splits; "
        "wide batch 1 x 512 rows, tiles 128x128, room for 3 splits"
    )

"""The prompt budget (``engine/budget.py``): the cost model's inversion and knee, the adaptive
decision within the target, and, through the real scheduler on ``random:test``, that every prompt
keeps moving (hypothesis over arrival orders and prompt lengths); the flags' validation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from order_helpers import last_row_bound, record

from turnkv.config import ConfigError, EngineConfig
from turnkv.engine.budget import AdaptiveBudget, StepCurve
from turnkv.engine.budget_probe import Probe
from turnkv.engine.events import TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.runtime import load_engine, new_bank

CHUNK = 64  # --prefill-chunk of the engine below


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(
        model="random:test", device="cpu", dtype="float32", prefill_chunk=CHUNK, speculate="off"
    )
    return load_engine(cfg)


# a memory-bound floor, then compute-bound: per row cheaper until 256 rows, then flat
CURVE = StepCurve((16, 32, 64, 128, 256, 512), (4.0, 4.2, 4.8, 6.0, 9.0, 18.0))


@st.composite
def curves(draw) -> StepCurve:
    rows = sorted(draw(st.sets(st.sampled_from([16, 32, 64, 128, 256, 512, 1024]), min_size=1, max_size=7)))
    steps = draw(st.lists(st.floats(0.0, 20.0), min_size=len(rows), max_size=len(rows)))
    ms, t = [], draw(st.floats(0.5, 30.0))
    for s in steps:
        t += s
        ms.append(t)
    return StepCurve(tuple(rows), tuple(ms))


def test_the_curve_interpolates_inverts_and_finds_the_knee():
    assert CURVE.predict(1) == 4.0 and CURVE.predict(96) == pytest.approx(5.4)
    assert CURVE.predict(1024) == pytest.approx(36.0)  # past the last point: its cost per row
    assert CURVE.rows_within(9.0) == 256 and CURVE.rows_within(3.9) == 0
    assert CURVE.knee() == 256  # 9/256 is within 10 % of the cheapest per row (18/512)
    noisy = Probe(StepCurve((16, 32, 64), (1470.0, 1977.0, 4444.0)), 1.0, complete=False)
    assert noisy.curve.knee() == 32 and noisy.ceiling(512) == 512  # never below the fixed default
    assert Probe(CURVE, 1.0, complete=True).ceiling(128) == 256


@settings(max_examples=200, deadline=None)
@given(curves(), st.integers(0, 300), st.one_of(st.none(), st.floats(1.0, 200.0)), st.floats(-3.0, 10.0))
def test_adaptive_prompt_rows_stay_within_the_target_by_the_model(curve, decode, target, residual):
    ceiling = max(curve.rows[-1], 64)
    b = AdaptiveBudget(curve, ceiling, target, floor=16)
    b.residual_ms = residual
    rows = b.prompt_rows(decode)
    assert rows >= 16  # prompts always move
    if decode == 0:
        assert rows == ceiling
        return
    goal = target if target is not None else 2 * b.predict(decode)
    assert b.last.target_ms == pytest.approx(goal)
    if rows > 16:  # above the floor only where the model says the step fits the target
        assert b.predict(decode + rows) <= goal + 1e-9
        assert decode + rows <= ceiling


def test_the_residual_learns_what_steps_really_cost():
    b = AdaptiveBudget(CURVE, 512, None, floor=16)
    for _ in range(60):
        b.observe(64, 14.8)  # 10 ms of attention over long histories the curve does not know
    assert b.residual_ms == pytest.approx(10.0, abs=0.01)
    # the target doubles the decode rows' cost with it, the prompt rows fit the rest
    rows = b.prompt_rows(32)
    assert b.predict(32 + rows) <= 2 * b.predict(32) and rows > 100


def test_a_relative_target_is_off_where_steps_cost_their_rows_and_the_residual_is_bounded():
    cpu = AdaptiveBudget(CURVE, 512, None, floor=16, relative=False)
    assert cpu.prompt_rows(8) == 512 and cpu.health()["itl_target_ms"] is None
    assert (
        AdaptiveBudget(CURVE, 512, 7.0, floor=16, relative=False).prompt_rows(8) == 160
    )  # 170 rows cost 7 ms
    for _ in range(50):
        cpu.observe(64, 0.1)  # far cheaper than the probe said (it ran on a busier machine)
    assert cpu.residual_ms == -2.0  # half the smallest step at most


def _request(n: int, answer: int, seed: int) -> TurnRequest:
    ids = [256, *((seed * 31 + i * 7) % 250 for i in range(n - 1))]
    return TurnRequest(ids, SamplingParams(ignore_eos=True), answer)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(2, 200), st.integers(2, 4)), min_size=1, max_size=6),
    st.one_of(st.none(), st.floats(0.01, 50.0)),
)
def test_every_prompt_keeps_moving_and_steps_stay_within_the_target(engine, arrivals, target):
    """Arrivals (step, prompt rows, answer tokens) in any order and lengths: no step has more rows
    than the budget gave, and above the floor the model's prediction of a step stays within the
    target; every prompt's last row is computed within the prompt order's bound at the floor
    (``order_helpers.last_row_bound``: no starvation); every turn ends."""
    floor = 16
    budget = AdaptiveBudget(CURVE, 256, target, floor)
    sched = Scheduler(engine, new_bank(engine, "256M"), max_running=64, max_batch_tokens=budget)
    rows_seen: list[int] = []
    sched.pipeline.observe = lambda windows, rows, seconds: rows_seen.append(rows)
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    turns, seen = {}, {}
    while pending or sched.busy:
        while pending and pending[0][1][0] <= sched.steps:
            i, (_, n, answer) = pending.pop(0)
            turns[i] = sched.submit(_request(n, answer, i), lambda ev: None)
        before = len(rows_seen)
        budget.last = None  # set again only by a step that asks
        sched.step()
        record(sched, turns, seen)
        last = budget.last
        if last is not None and last.decode and len(rows_seen) > before:
            assert rows_seen[-1] <= last.decode + last.prompt  # the budget held
            if last.prompt > floor:
                assert last.predicted_ms <= last.target_ms + 1e-9
        assert sched.steps < 2000, "the scheduler did not finish"
    assert set(seen) == set(turns) and all(t.done for t in turns.values())
    for i, p in seen.items():
        assert p.done is not None and p.done <= last_row_bound(p, list(seen.values()), min(floor, CHUNK)), i


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [
        ("max_batch_tokens", "0", "auto or a row count"),
        ("max_batch_tokens", "lots", "auto or a row count"),
        ("max_batch_tokens", "-5", "auto or a row count"),
        ("itl_target_ms", "0", "auto or milliseconds"),
        ("itl_target_ms", "nan", "auto or milliseconds"),
        ("itl_target_ms", "fast", "auto or milliseconds"),
    ],
)
def test_bad_budget_values_name_the_field_and_the_fix(field, value, fix):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**{field: value})
    assert e.value.field == field and fix in str(e.value) and repr(value) in str(e.value)


def test_budget_values_parse():
    cfg = EngineConfig(max_batch_tokens="2048", itl_target_ms="40.5")
    assert cfg.batch_tokens() == 2048 and cfg.itl_target() == 40.5
    assert EngineConfig().batch_tokens() is None and EngineConfig().itl_target() is None  # auto


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["serve", "--max-batch-tokens", "0"], {}, "--max-batch-tokens must be auto or a row count"),
        (["serve"], {"TURNKV_MAX_BATCH_TOKENS": "x"}, "TURNKV_MAX_BATCH_TOKENS must be auto"),
        (["serve", "--itl-target-ms", "-1"], {}, "--itl-target-ms must be auto or milliseconds"),
        (["serve"], {"TURNKV_ITL_TARGET_MS": "soon"}, "TURNKV_ITL_TARGET_MS must be auto"),
    ],
)
def test_bad_budget_flags_are_one_line_errors_before_loading(monkeypatch, capsys, argv, env, needle):
    from turnkv.cli import main

    monkeypatch.setattr("turnkv.runtime.load_engine", lambda *a, **k: pytest.fail("loaded a model"))
    for var in [v for v in __import__("os").environ if v.startswith("TURNKV_")]:
        monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("turnkv: error:"), lines
    assert needle in lines[0], lines[0]


def test_a_kept_probe_is_read_back_only_for_the_sizes_it_measured(tmp_path):
    """``probe_cache``: a complete probe survives a restart; another size list, a torn or
    nonsense file, or an incomplete probe give nothing back (measured again)."""
    from turnkv.engine import probe_cache

    path = tmp_path / "probe" / "k.json"
    sizes = [64, 128, 256]
    p = Probe(StepCurve(tuple(sizes), (5.0, 6.0, 9.5)), 3.2, True)
    probe_cache.save(path, p)
    back = probe_cache.load(path, sizes)
    assert back is not None and back.cached and back.curve == p.curve and back.seconds == 0.0
    assert back.ceiling(64) == p.ceiling(64)
    assert probe_cache.load(path, [64, 128]) is None  # other sizes: measure again
    assert probe_cache.load(tmp_path / "missing.json", sizes) is None
    path.write_text('{"rows": [64, 128, 256], "ms": [5.0, 0, 9.5]}')
    assert probe_cache.load(path, sizes) is None
    path.write_text("{not json")
    assert probe_cache.load(path, sizes) is None
    probe_cache.save(tmp_path / "partial.json", Probe(p.curve, 1.0, False))
    assert not (tmp_path / "partial.json").exists()
    probe_cache.save(None, p)  # a device whose probe is not kept: nothing happens


def test_a_cpu_engine_measures_its_probe_every_start(monkeypatch):
    from turnkv.engine import probe_cache
    from turnkv.runtime import build

    cfg = EngineConfig(model="random:test", device="cpu", dtype="float32")
    rt = build(cfg, "generate", progress=False)
    assert probe_cache.probe_path(rt.engine, 4, [16, 32]) is None


def test_a_kept_probe_replaces_the_measurement_at_the_next_start(monkeypatch, tmp_path):
    """``Runtime.measure_budget`` over a kept curve (forced on this CPU): the first start measures
    and keeps it, the second reads it back and probes nothing, with the same ceiling."""
    from turnkv.engine import budget_probe, probe_cache
    from turnkv.runtime import build

    monkeypatch.setattr(probe_cache, "probe_path", lambda engine, running, sizes: tmp_path / "p.json")
    cfg = EngineConfig(model="random:test", device="cpu", dtype="float32")
    first = build(cfg, "serve", progress=False)
    first.measure_budget()
    assert first.probe is not None and not first.probe.cached and (tmp_path / "p.json").exists()
    ran = []
    monkeypatch.setattr(budget_probe, "probe", lambda *a, **k: ran.append(1))
    second = build(cfg, "serve", engine=first.engine, progress=False)
    second.measure_budget()
    assert ran == [] and second.probe.cached and second.probe.curve == first.probe.curve
    assert second.step_budget().ceiling == first.step_budget().ceiling
    assert second.step_budget().health()["probe_cached"] is True

"""The support verdict and the self-check probe (turnkv/attention/selfcheck.py).

Kernel-running cases use CUDA when present, else Triton's CPU interpreter (TRITON_INTERPRET=1);
without either they skip. The verdict logic for failures is driven by real wrong kernels (an
attention that misses one key, one that raises), which the probe must catch.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from turnkv.attention import selfcheck
from turnkv.attention.lse import lse_attention
from turnkv.kv.cache import KVWindow

CUDA = torch.cuda.is_available()
KERNEL_DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_kernel = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no CUDA and TRITON_INTERPRET unset"
)
BF16 = torch.bfloat16


def test_forced_lse():
    verdict, fused = selfcheck.decide("lse", torch.device("cpu"), 64, 8, 2, BF16)
    assert (verdict.route, verdict.verdict, fused) == ("lse", "forced_lse", None)


def test_cpu_without_interpreter_is_no_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for mode in ("auto", "fused"):
        verdict, fused = selfcheck.decide(mode, torch.device("cpu"), 64, 8, 2, BF16)
        assert (verdict.route, verdict.verdict, fused) == ("lse", "no_cuda", None)
    assert "serving the lse route" in verdict.reason  # fused was asked for: it says it fell back


def test_auto_on_cpu_never_runs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    verdict, fused = selfcheck.decide("auto", torch.device("cpu"), 64, 8, 2, BF16)
    assert verdict.verdict == "no_cuda" and fused is None


@pytest.mark.parametrize(
    ("head_dim", "hq", "hkv", "dtype", "code"),
    [
        (96, 8, 2, BF16, "head_dim_96_unsupported"),
        (128, 18, 2, BF16, "gqa_18_2_unsupported"),
        (128, 8, 3, BF16, "gqa_8_3_unsupported"),
        (64, 8, 2, torch.float32, "dtype_float32_unsupported"),
    ],
)
def test_unsupported_shapes(monkeypatch, head_dim, hq, hkv, dtype, code):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    verdict, fused = selfcheck.decide("fused", KERNEL_DEVICE, head_dim, hq, hkv, dtype)
    assert (verdict.route, verdict.verdict, fused) == ("lse", code, None)


def test_triton_missing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "turnkv.attention.triton_segments", raising=False)
    verdict, fused = selfcheck.decide("fused", KERNEL_DEVICE, 64, 8, 2, BF16)
    assert (verdict.route, verdict.verdict, fused) == ("lse", "triton_missing", None)


def _off_by_one(q, views, scale):
    """A wrong kernel: every row misses the newest key it should see."""
    t = sum(k.shape[1] for k, _ in views)
    return lse_attention(q, views, scale, window_start=t - q.shape[1] - 1)


def _raises(q, views, scale):
    raise RuntimeError("launch failed")


@pytest.mark.parametrize("kernel", [_off_by_one, _raises])
def test_a_wrong_kernel_fails_the_check(monkeypatch, kernel):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(selfcheck, "_load_kernel", lambda: (kernel, None))
    verdict, fused = selfcheck.decide("fused", KERNEL_DEVICE, 64, 8, 2, BF16)
    assert (verdict.route, verdict.verdict, fused) == ("lse", "selfcheck_failed", None)
    assert verdict.selfcheck["passed"] is False
    assert "serving the lse route" in verdict.reason
    if kernel is _raises:
        assert "launch failed" in verdict.reason


def test_exact_attention_passes_the_probe():
    # the lse route is the fp32 result rounded once: inside the tolerance by construction
    for shape in selfcheck.cli_shapes(small=True):
        res = selfcheck.run_probe(lse_attention, shape, BF16, torch.device("cpu"))
        assert res.ok and res.tol_ratio <= 0.51, res


@needs_kernel
def test_the_real_kernel_passes_at_the_model_shapes():
    backend = selfcheck.make_backend("fused", KERNEL_DEVICE, 64, 9, 3, BF16)
    assert backend.name == "fused"
    assert (backend.verdict.route, backend.verdict.verdict) == ("fused", "ok"), backend.verdict.reason
    report = backend.verdict.selfcheck
    # steps as serving launches them (a graphed mixed step, a graphed decode step, an eager
    # step of two view groups), nothing single-sequence: their kernels are serving's own
    names = [r["name"] for r in report["shapes"]]
    assert report["passed"] and names == ["", *selfcheck.STEP_PROBES]  # one sequence, then the steps
    assert {r["segments"] for r in report["shapes"]} >= {13}  # past MAX_SEGMENTS: two groups
    assert all(r["tol_ratio"] <= 1 for r in report["shapes"])
    views = tuple((torch.randn(2, 3, n, 64).to(KERNEL_DEVICE, BF16),) * 2 for n in (5, 0, 9))
    assert [r.label for r in backend.plan([KVWindow(views, 10, 4)]).routes] == ["fused_q4"]


@needs_kernel
def test_cli_json(capsys):
    code = selfcheck.cli_main(str(KERNEL_DEVICE), as_json=True)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["verdict"] == "ok" and doc["route"] == "fused"
    shapes = doc["selfcheck"]["shapes"]
    assert {(s["head_dim"], s["num_heads"] // s["num_kv_heads"], s["rows"]) for s in shapes} == {
        (d, g, m) for d in (64, 128, 256) for g in (1, 4, 8) for m in (1, 4, 32)
    }
    assert all(s["ok"] and s["segments"] >= 4 for s in shapes)


def test_cli_without_a_kernel_device_says_why_and_exits_0_on_a_cpu(monkeypatch, capsys):
    """On a CPU "not available here" is the expected answer (exit 0); where CUDA was asked for and
    is missing, or the kernel fails the probe, the exit code is 1."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert selfcheck.cli_main("cpu", as_json=False) == 0
    assert "verdict no_cuda" in capsys.readouterr().out
    if not CUDA:
        assert selfcheck.cli_main("auto", as_json=True) == 0  # auto on a machine without CUDA: its CPU
        assert json.loads(capsys.readouterr().out)["verdict"] == "no_cuda"
        assert selfcheck.cli_main("cuda", as_json=True) == 1
        assert json.loads(capsys.readouterr().out)["verdict"] == "no_cuda"


def test_cli_exits_1_when_the_kernel_fails_the_probe(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(selfcheck, "_load_kernel", lambda: (_off_by_one, None))
    assert selfcheck.cli_main(str(KERNEL_DEVICE), as_json=True) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "selfcheck_failed"

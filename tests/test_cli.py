"""The ``turnkv`` command as a user runs it: generate --json, scripted chat with /undo, and the
expected failures (one line on stderr, exit code 2, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def turnkv(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "turnkv", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("turnkv: error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_model_path_is_one_line_exit_2(tmp_path):
    proc = turnkv("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert_one_line_error(proc, "nope")


def test_unsupported_architecture_is_one_line_exit_2(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    proc = turnkv("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert_one_line_error(proc, "GPT2LMHeadModel", "LlamaForCausalLM")


@pytest.mark.slow
def test_prompt_longer_than_context_is_one_line_exit_2():
    proc = turnkv("generate", "--max-context", "32", "--prompt", "word " * 64)
    assert_one_line_error(proc, "context")


@pytest.mark.slow
def test_generate_json_reports_text_and_stats():
    proc = turnkv("generate", "--prompt", "Say hello.", "--max-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["text"] and out["completion_tokens"] <= 6 and out["prompt_tokens"] > 5
    stats = out["stats"]
    for key in (
        "prefill_s",
        "decode_tok_s",
        "forwards",
        "decode_forwards",
        "drafted",
        "accepted",
        "route_counts",
    ):
        assert key in stats
    assert 0 <= stats["accepted"] <= stats["drafted"]
    assert stats["forwards"] >= 1 and sum(stats["route_counts"].values()) > 0


@pytest.mark.slow
def test_scripted_chat_undo_reuses_segments():
    script = "Name a colour.\nName another one.\n/undo\nName a fruit.\n/stats\n"
    proc = turnkv("chat", "--max-tokens", "6", stdin=script)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "(undone)" in lines
    stats = json.loads(lines[-1])
    assert stats["turns"] == 2
    # the turn after /undo was served from the first turn's segment, not recomputed
    assert stats["last_turn"]["cached_tokens"] > 0
    assert stats["seals"] >= 3
    assert any(k.startswith("lse_") for k in stats["last_turn"]["route_counts"])  # several segments

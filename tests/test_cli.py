"""The ``turnkv`` command as a user runs it: generate --json, scripted chat with /undo, and the
expected failures (one line on stderr, exit code 2, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from turnkv.cli import build_parser, engine_config


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


# -- flags are validated before the model loads (issue 7, items 8 and 9) ---------------------------


@pytest.fixture
def no_load(monkeypatch):
    """Loading a model fails the test: every refusal below must come before the load."""
    from turnkv import runtime

    def refuse(*a, **kw):
        raise AssertionError("the model was loaded before the flags were validated")

    monkeypatch.setattr(runtime, "load_engine", refuse)
    for var in [v for v in __import__("os").environ if v.startswith("TURNKV_")]:
        monkeypatch.delenv(var)
    return monkeypatch


def run_main(capsys, *argv: str) -> tuple[int, str]:
    from turnkv.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own exits
        code = e.code
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["serve", "--port", "99999"], {}, "--port"),
        (["serve", "--port", "abc"], {}, "--port"),
        (["serve"], {"TURNKV_PORT": "abc"}, "TURNKV_PORT"),
        (["serve"], {"TURNKV_PORT": "70000"}, "TURNKV_PORT"),
        (["serve", "--max-context", "-1"], {}, "--max-context"),
        (["serve", "--prefill-chunk", "0"], {}, "--prefill-chunk"),
        (["serve"], {"TURNKV_PREFILL_CHUNK": "0"}, "TURNKV_PREFILL_CHUNK"),
        (["serve", "--bank-bytes", "lots"], {}, "--bank-bytes"),
        (["serve", "--device", "bogus"], {}, "--device"),
        (["serve"], {"TURNKV_KV_LAYOUT": "paged"}, "TURNKV_KV_LAYOUT"),
        (["serve", "--session-share", "1.5"], {}, "--session-share"),
        (["serve"], {"TURNKV_ACCESS_LOG": "maybe"}, "TURNKV_ACCESS_LOG"),
        (["serve", "--shutdown-timeout", "-1"], {}, "--shutdown-timeout"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], {}, "--temperature"),
        (["generate", "--prompt", "hi", "--top-p", "0"], {}, "--top-p"),
        (["generate", "--prompt", "hi", "--top-k", "-2"], {}, "--top-k"),
        (["generate", "--prompt", "hi", "--max-tokens", "0"], {}, "--max-tokens"),
        (["serve", "--temperature", "-1"], {}, "--temperature"),
        (["serve", "--top-p", "1.5"], {}, "--top-p"),
        (["serve"], {"TURNKV_MAX_TOKENS": "0"}, "TURNKV_MAX_TOKENS"),
        (["chat", "--top-k", "-2"], {}, "--top-k"),
        (["chat", "--seed", str(2**64)], {}, "--seed"),
        (["selfcheck", "--device", "bogus"], {}, "--device"),
    ],
)
def test_bad_flags_and_variables_are_one_line_naming_them_before_loading(no_load, capsys, argv, env, needle):
    for k, v in env.items():
        no_load.setenv(k, v)
    code, err = run_main(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("turnkv: error:"), err
    assert needle in lines[0], lines[0]


def test_a_port_in_use_fails_before_loading_and_before_serving_on(no_load, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = run_main(capsys, "serve", "--port", str(port))
    assert code == 2 and "serving on" not in err
    assert err.strip().splitlines() == [
        f"turnkv: error: port {port} on 127.0.0.1 is already in use; pick another with --port"
    ]


def test_version_and_help_with_defaults(capsys):
    from turnkv.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("turnkv 0.")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "default: 8000; env TURNKV_PORT",
        "default: auto; env TURNKV_BANK_BYTES",
        "--no-access-log",
        "for requests that set none (default: the model's recommended value, else 1.0; env TURNKV_TEMPERATURE)",
        "else 1024; env TURNKV_MAX_TOKENS",
    ):
        assert needle in text, needle
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and "turnkv: an OpenAI-compatible LLM server" in top  # plain text, not RST
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--prompt PROMPT the user message" in text and "--system SYSTEM a system message" in text


@pytest.mark.parametrize(
    ("argv", "where"),
    [
        (["serve", "--bogus"], "turnkv serve"),  # argparse reports these from the top parser
        (["generate"], "turnkv generate"),
        (["cache", "stats", "--no-disk"], "turnkv cache"),
        (["--bogus"], "turnkv"),
    ],
)
def test_usage_errors_point_at_the_subcommands_help(no_load, capsys, argv, where):
    code, err = run_main(capsys, *argv)
    assert code == 2 and err.strip().endswith(f"(see {where} --help)"), err


def test_the_cli_samples_with_the_models_defaults_unless_a_flag_says_otherwise(default_model):
    """``generate``/``chat`` without sampling flags use the model's recommendation (the default
    model's card: 0.2, 0.9), as the server does for a request that sets none."""
    from turnkv.cli import sampling_params
    from turnkv.engine.engine import Engine
    from turnkv.engine.sampling import SamplingParams
    from turnkv.models.generation import DEFAULT_MAX_TOKENS

    for argv, want in [
        (["generate", "--prompt", "x"], SamplingParams(temperature=0.2, top_p=0.9)),
        (["chat", "--temperature", "0.7", "--seed", "3"], SamplingParams(temperature=0.7, top_p=0.9, seed=3)),
        (["chat", "--top-p", "1", "--top-k", "5"], SamplingParams(temperature=0.2, top_k=5)),
    ]:
        args = build_parser().parse_args(argv)
        engine = Engine(default_model, engine_config(args))
        assert sampling_params(args, engine.sampling_defaults.values) == want, argv
        assert engine.sampling_defaults.values.max_tokens == DEFAULT_MAX_TOKENS  # not 128/256


def test_selfcheck_on_cuda_without_cuda_says_no_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = turnkv("selfcheck", "--device", "cuda", "--json")
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "no_cuda"
    assert proc.returncode == 1  # asked for CUDA, which is not there (on a CPU no_cuda exits 0)


def test_cache_verify_of_a_directory_in_use_says_what_works(tmp_path):
    from turnkv.bank.disk_store import LocalDirStore
    from turnkv.cache_cli import cache_main

    held = LocalDirStore(tmp_path)  # as a running server holds it
    try:
        with pytest.raises(ValueError) as e:
            cache_main("verify", str(tmp_path), as_json=False)
    finally:
        held.close()
    msg = str(e.value)
    assert "in use" in msg and "stop it before `turnkv cache verify`" in msg and "--no-disk" not in msg
    assert cache_main("verify", str(tmp_path), as_json=True) == 0  # once it is free


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Chat:
    """``turnkv chat`` in a subprocess, its stdout read as it comes (issue 7, item 10)."""

    def __init__(self, *args: str) -> None:
        import os
        import threading

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "turnkv", "chat", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # SIGABRT dumps every thread (``stacks``)
            # Ctrl-C as a terminal gives it: a run started in the background ('&' in a script) has
            # SIGINT ignored, which the chat would inherit (and then rightly not quit on Ctrl-C)
            preexec_fn=_default_sigint,
        )
        self.out = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while ch := self.proc.stdout.read(1):
            self.out += ch

    def stacks(self) -> str:
        """Where a hung chat is: its threads' tracebacks (faulthandler on SIGABRT), then its stderr."""
        import signal

        self.proc.send_signal(signal.SIGABRT)
        try:
            return self.proc.communicate(timeout=20)[1][-6000:]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "(no traceback: it did not die on SIGABRT)"

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, predicate, timeout: float = 240) -> None:
        import time

        deadline = time.monotonic() + timeout
        while not predicate(self.out):
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, self.out
            time.sleep(0.05)


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_keeps_the_turn_and_ctrl_c_at_the_prompt_exits():
    import signal

    chat = Chat("--max-tokens", "2000")
    try:
        chat.send("Write a very long story about a lighthouse keeper and the sea.")
        chat.wait_for(lambda out: len(out) > 40)
        chat.proc.send_signal(signal.SIGINT)
        chat.wait_for(lambda out: "(stopped)" in out)
        chat.send("/stats")
        chat.wait_for(lambda out: out.rstrip().endswith("}"))
        first = json.loads(chat.out.strip().splitlines()[-1])
        assert first["turns"] == 1
        turn = first["last_turn"]
        assert 0 < turn["completion_tokens"] < 2000
        # the stopped answer is sealed and banked: the conversation goes on from it
        assert first["seals"] == 1 and first["bank_entries"] == 1
        chat.send("/undo")  # the turn is part of the conversation
        chat.wait_for(lambda out: "(undone)" in out)
        # at the prompt (or on the way to it: a Ctrl-C outside an answer quits wherever it lands)
        chat.proc.send_signal(signal.SIGINT)
        try:  # the event is the exit; the bound only stops a hang (and says where it hung)
            code = chat.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"chat did not exit on Ctrl-C at the prompt:\n{chat.stacks()}")
        assert code == 0
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()

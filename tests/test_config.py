"""Sizes, TURNKV_* env twins and their precedence under command-line flags."""

from __future__ import annotations

import pytest

from turnkv.cli import build_parser, engine_config
from turnkv.config import parse_size


@pytest.mark.parametrize(
    ("text", "value"), [("512M", 512 << 20), ("8G", 8 << 30), ("1.5k", 1536), (4096, 4096), ("77", 77)]
)
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "8X", "-1G"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_env_twins_apply_and_flags_win(monkeypatch):
    monkeypatch.setenv("TURNKV_KV_LAYOUT", "contiguous")
    monkeypatch.setenv("TURNKV_PORT", "9001")
    monkeypatch.setenv("TURNKV_API_KEY", "a,b")
    cfg = engine_config(build_parser().parse_args(["serve"]))
    assert (cfg.kv_layout, cfg.port, cfg.api_key, cfg.host) == ("contiguous", 9001, ["a", "b"], "127.0.0.1")
    cfg = engine_config(build_parser().parse_args(["serve", "--kv-layout", "segmented", "--port", "8002"]))
    assert (cfg.kv_layout, cfg.port) == ("segmented", 8002)


def test_speculate_flag_and_env_twin(monkeypatch):
    assert engine_config(build_parser().parse_args(["generate", "--prompt", "x"])).speculate == "auto"
    monkeypatch.setenv("TURNKV_SPECULATE", "off")
    assert engine_config(build_parser().parse_args(["serve"])).speculate == "off"
    cfg = engine_config(build_parser().parse_args(["chat", "--speculate", "auto"]))
    assert cfg.speculate == "auto"


def test_deterministic_flag_and_env_twin(monkeypatch):
    assert engine_config(build_parser().parse_args(["serve"])).deterministic == "off"
    monkeypatch.setenv("TURNKV_DETERMINISTIC", "on")
    assert engine_config(build_parser().parse_args(["serve"])).deterministic == "on"
    cfg = engine_config(build_parser().parse_args(["chat", "--deterministic", "off"]))
    assert cfg.deterministic == "off"


def test_malformed_bank_size_fails_early():
    with pytest.raises(ValueError):
        engine_config(build_parser().parse_args(["serve", "--bank-bytes", "lots"]))


def test_new_server_flags_have_typed_env_twins(monkeypatch):
    monkeypatch.setenv("TURNKV_SESSION_TTL", "90.5")
    monkeypatch.setenv("TURNKV_ACCESS_LOG", "off")
    monkeypatch.setenv("TURNKV_MAX_BODY_BYTES", "2M")
    cfg = engine_config(build_parser().parse_args(["serve", "--shutdown-timeout", "4"]))
    assert (cfg.session_ttl, cfg.access_log, cfg.max_body_bytes, cfg.shutdown_timeout) == (
        90.5,
        False,
        "2M",
        4.0,
    )
    cfg = engine_config(build_parser().parse_args(["serve", "--access-log"]))
    assert cfg.access_log is True  # the flag wins over TURNKV_ACCESS_LOG=off


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("port", 65536),
        ("port", True),
        ("kv_layout", "paged"),
        ("max_body_bytes", "0"),
        ("session_ttl", float("nan")),
        ("temperature", -0.5),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_k", -1),
        ("max_tokens", 0),
    ],
)
def test_engine_config_validates_every_field_in_one_place(field, value):
    from turnkv.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError) as e:
        EngineConfig(**{field: value})
    assert e.value.field == field


def test_disk_flags_and_their_env_twins(monkeypatch):
    cfg = engine_config(build_parser().parse_args(["serve"]))
    assert (cfg.disk_dir, cfg.disk_bytes, cfg.no_disk) == ("", "8G", False)  # on by default
    monkeypatch.setenv("TURNKV_NO_DISK", "1")
    monkeypatch.setenv("TURNKV_DISK_DIR", "/tmp/kv")
    monkeypatch.setenv("TURNKV_DISK_BYTES", "2G")
    cfg = engine_config(build_parser().parse_args(["serve"]))
    assert (cfg.disk_dir, cfg.disk_bytes, cfg.no_disk) == ("/tmp/kv", "2G", True)
    cfg = engine_config(build_parser().parse_args(["serve", "--disk-dir", "/x", "--disk-bytes", "1G"]))
    assert (cfg.disk_dir, cfg.disk_bytes) == ("/x", "1G")
    with pytest.raises(ValueError):
        engine_config(build_parser().parse_args(["serve", "--disk-bytes", "lots"]))


def test_sampling_flags_and_env_twins_on_every_command(monkeypatch):
    """Unset (None: the model's, else built-in) unless given; a flag wins over its env twin; an
    empty variable means unset."""
    from turnkv.models.generation import SamplingDefaults

    assert engine_config(build_parser().parse_args(["serve"])).sampling_flags() == SamplingDefaults()
    monkeypatch.setenv("TURNKV_TEMPERATURE", "0.3")
    monkeypatch.setenv("TURNKV_MAX_TOKENS", "200")
    monkeypatch.setenv("TURNKV_TOP_K", "")
    for command in (["serve"], ["chat"], ["generate", "--prompt", "x"]):
        cfg = engine_config(build_parser().parse_args([*command, "--top-p", "0.5", "--top-k", "7"]))
        assert cfg.sampling_flags() == SamplingDefaults(0.3, 0.5, 7, 200)
    cfg = engine_config(build_parser().parse_args(["serve", "--temperature", "0", "--max-tokens", "9"]))
    assert (cfg.temperature, cfg.max_tokens, cfg.top_k) == (0.0, 9, None)
    monkeypatch.setenv("TURNKV_TOP_P", "most")
    with pytest.raises(ValueError, match="TURNKV_TOP_P must be a number"):
        engine_config(build_parser().parse_args(["serve"]))

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


def test_malformed_bank_size_fails_early():
    with pytest.raises(ValueError):
        engine_config(build_parser().parse_args(["serve", "--bank-bytes", "lots"]))

"""Session-wide test settings and fixtures: servers a test starts keep their KV disk tier under a
temp dir; the default model is loaded once per session for the server test modules."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


def pytest_configure(config) -> None:
    # the disk tier's default directory is $XDG_CACHE_HOME/turnkv/kv: never the user's real cache;
    # removed when the session ends (packed weights put ~100 MB a session there)
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="turnkv-test-cache-")
    config._turnkv_cache = os.environ["XDG_CACHE_HOME"]


def pytest_unconfigure(config) -> None:
    where = getattr(config, "_turnkv_cache", None)
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct on the CPU (each server gets its own engine, bank and budget), with
    fp32 dequantized weights: server tests compare greedy text across a cold request and one that
    reuses the bank, which is exact only in fp32 (packed weights round activations to bf16 and can
    flip a near-tie; tests/test_quant_default.py holds that path to its stated tolerance)."""
    from turnkv.models.load import load_model

    return load_model("default", "cpu", "auto", progress=False, weights="dequant")

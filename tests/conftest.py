"""Fixtures shared by the server test modules: the default model, loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct on the CPU (each server gets its own engine, bank and budget)."""
    from turnkv.models.load import load_model

    return load_model("default", "cpu", "auto", progress=False)

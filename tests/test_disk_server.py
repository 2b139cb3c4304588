"""The disk tier through the HTTP server with the real default model, and ``turnkv cache``.

A server answers a long conversation and shuts down; a new server over the same directory (an
empty bank) answers the follow-up exactly as a server without any cache does, with
``cached_tokens`` covering the stored blocks, and reports it on ``/health.disk`` and ``/metrics``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from test_server import SYSTEM, Live, chat

from turnkv.bank.disk import DISK_KEYS
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.models.load import load_model

pytestmark = pytest.mark.slow

FACTS = " ".join(f"Fact {i}: the river number {i} flows into lake {i * 7 % 13}." for i in range(60))


@pytest.fixture(scope="module")
def loaded():
    return load_model("default", "cpu", "auto", progress=False)


def test_a_new_server_restores_from_disk_and_answers_as_without_cache(loaded, tmp_path):
    msgs = [SYSTEM, {"role": "user", "content": FACTS + " Which lake does river 5 flow into?"}]
    first = Live(loaded, disk_dir=str(tmp_path))
    r = chat(first.client(), msgs)
    first.idle()
    first.close()  # shutdown drains the write queue
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}]
    msgs += [{"role": "user", "content": "And river 6?"}]

    second = Live(loaded, disk_dir=str(tmp_path))
    r2 = chat(second.client(), msgs)
    h = second.health()["disk"]
    metrics = httpx.get(second.url + "/metrics", timeout=30).text
    second.close()
    fresh = Live(loaded, no_disk=True)
    want = chat(fresh.client(), msgs)
    assert fresh.health()["disk"] == {
        "enabled": False,
        "degraded": None,
        "restore_gbps": 0.0,
        **dict.fromkeys(DISK_KEYS, 0),
    }
    fresh.close()

    assert r2.choices[0].message.content == want.choices[0].message.content
    assert want.usage.prompt_tokens_details.cached_tokens == 0
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= 3 * B and cached % B == 0  # whole blocks of the first turn's history
    assert (
        h["enabled"] is True
        and h["degraded"] is None
        and set(h) == {"enabled", "degraded", "restore_gbps", *DISK_KEYS}
    )
    assert (h["hits"], h["hit_tokens"], h["corrupt"], h["write_failures"]) == (1, cached, 0, 0)
    assert h["blocks"] >= cached // B and h["bytes"] > 0
    for name in ("turnkv_disk_blocks", "turnkv_disk_hits_total", "turnkv_disk_corrupt_total"):
        assert name in metrics
    assert "turnkv_disk_hits_total 1.0" in metrics


def turnkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "turnkv", *args], capture_output=True, text=True, timeout=120
    )


def test_cache_cli_stats_verify_clear(loaded, tmp_path):
    srv = Live(loaded, disk_dir=str(tmp_path))
    chat(srv.client(), [SYSTEM, {"role": "user", "content": FACTS}], max_tokens=2)
    srv.idle()
    busy = turnkv("cache", "verify", "--disk-dir", str(tmp_path))
    assert busy.returncode == 2 and "in use" in busy.stderr  # the server holds the directory
    srv.close()
    stats = json.loads(turnkv("cache", "stats", "--disk-dir", str(tmp_path), "--json").stdout)
    assert stats["blocks"] >= 2 and stats["bytes"] > 0 and stats["contexts"] == 1
    files = sorted((tmp_path / "blocks").rglob("*.safetensors"))
    data = bytearray(files[0].read_bytes())
    data[-5] ^= 0xFF
    files[0].write_bytes(bytes(data))
    verify = turnkv("cache", "verify", "--disk-dir", str(tmp_path), "--json")
    assert verify.returncode == 1, verify.stderr
    report = json.loads(verify.stdout)
    assert (report["bad"], report["good"]) == (1, stats["blocks"] - 1)
    assert turnkv("cache", "verify", "--disk-dir", str(tmp_path)).returncode == 0
    cleared = json.loads(turnkv("cache", "clear", "--disk-dir", str(tmp_path), "--json").stdout)
    assert cleared["removed_blocks"] == stats["blocks"] - 1
    assert not list((tmp_path / "blocks").rglob("*.safetensors"))
    assert json.loads(turnkv("cache", "stats", "--disk-dir", str(tmp_path), "--json").stdout)["blocks"] == 0

"""Restarts and crashes: what one process wrote, a new process reads back exactly, or not at all.

A child process (``disk_child.py``) serves turns of the tiny engine through a bank with the disk
tier. After a clean exit, a follow-up in this process restores the stored blocks and answers as
a run without any cache. After ``kill -9`` at random moments mid-writing, reopening the directory
reconciles it, every indexed block verifies, and a prompt built from each stored chain restores
all of it and gets the logits of a run computed from scratch. When the index is lost after such a
kill, the rebuild from the block files keeps every block the process had made durable.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from disk_helpers import GIB, first_logits, prompt, tiny_engine, turn

from turnkv.bank.disk import DiskTier
from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.disk_blocks import ROOT_KEY
from turnkv.bank.session_bank import SessionBank
from turnkv.kv.segments import unique_bytes

CHILD = Path(__file__).with_name("disk_child.py")
ROOT = CHILD.parent.parent


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def spawn(directory: Path, *args: str) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )


def plain_bank(engine) -> SessionBank:
    return SessionBank(GIB, engine.shape.bytes_per_row, lambda held: unique_bytes(*held))


def test_restart_in_a_new_process_answers_as_without_cache(engine, tmp_path):
    child = spawn(tmp_path, "once")
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    banked = json.loads(out.strip().splitlines()[-1])
    follow = [*banked, *prompt(50, seed=9)]
    tier = DiskTier.open(tmp_path, engine.info.fingerprint, engine.shape, GIB)
    bank = SessionBank(GIB, engine.shape.bytes_per_row, lambda held: unique_bytes(*held), tier=tier)
    got, cached = first_logits(engine, bank, "ns", follow)
    want, _ = first_logits(engine, None, "ns", follow)
    assert cached == (len(banked) // B) * B > 0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    answer, stats, _ = turn(engine, bank, "ns", follow, max_tokens=8)
    plain, plain_stats, _ = turn(engine, plain_bank(engine), "ns", follow, max_tokens=8)
    assert answer == plain and plain_stats.cached_tokens == 0
    assert stats.cached_tokens == (len(banked) // B) * B  # cached_tokens covers the stored blocks
    assert tier.health()["corrupt"] == 0
    tier.close()


def _chains(tier: DiskTier) -> list[list[str]]:
    """Every stored chain that ends in a block no other block continues, root first."""
    infos = {i.key: i for i in tier.store.iterate()}
    parents = {i.parent for i in infos.values()}
    chains = []
    for leaf in (k for k in infos if k not in parents):
        chain = [leaf]
        while infos[chain[-1]].parent != ROOT_KEY and infos[chain[-1]].parent in infos:
            chain.append(infos[chain[-1]].parent)
        chains.append(chain[::-1])
    return chains


def test_kill_9_while_writing_then_every_block_verifies_and_answers_stay_right(engine, tmp_path):
    rng = random.Random(2026)
    seen = 0
    for trial in range(8):
        child = spawn(tmp_path, "forever", str(trial))
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.0, 0.8))
        child.kill()  # SIGKILL: no clean-up of any kind
        child.wait(timeout=30)
        tier = DiskTier.open(tmp_path, engine.info.fingerprint, engine.shape, GIB)
        assert tier.stats.corrupt == 0  # reconcile found no row without its whole file
        for info in tier.store.iterate():
            tier.store.get(info.key)  # every indexed block verifies (raises otherwise)
        seen = max(seen, tier.store.count)
        bank = SessionBank(GIB, engine.shape.bytes_per_row, lambda held: unique_bytes(*held), tier=tier)
        chains = sorted(_chains(tier), key=len)[-2:]
        for chain in chains:
            assert tier.store.get(chain[0]).parent == ROOT_KEY  # writes go parent first
            tokens = [t for key in chain for t in tier.store.get(key).tokens]
            ids = [*tokens, 7]
            got, cached = first_logits(engine, bank, "ns", ids)
            assert cached == len(chain) * B
            want, _ = first_logits(engine, None, "ns", ids)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert tier.health()["corrupt"] == 0
        tier.close()
    assert seen >= 8, "the children hardly wrote"


def test_an_index_lost_after_a_kill_9_is_rebuilt_with_every_block_the_process_made_durable(engine, tmp_path):
    child = spawn(tmp_path, "forever", "11")
    assert child.stdout.readline().strip() == "ready", child.stderr.read()
    time.sleep(0.5)
    child.kill()
    child.wait(timeout=30)
    durable = {p.stem for p in (tmp_path / "blocks").rglob("*.safetensors")}
    assert durable
    (tmp_path / "index.sqlite").unlink()  # its -wal and -shm stay behind, stale
    tier = DiskTier.open(tmp_path, engine.info.fingerprint, engine.shape, GIB)
    assert {i.key for i in tier.store.iterate()} == durable  # every renamed file was whole
    assert tier.store.rebuilt is not None and tier.store.rebuilt.dropped == 0
    bank = SessionBank(GIB, engine.shape.bytes_per_row, lambda held: unique_bytes(*held), tier=tier)
    chain = max(_chains(tier), key=len)
    ids = [*(t for key in chain for t in tier.store.get(key).tokens), 7]
    got, cached = first_logits(engine, bank, "ns", ids)
    want, _ = first_logits(engine, None, "ns", ids)
    assert cached == len(chain) * B
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    tier.close()

"""CPU thread set-up (turnkv/threads.py): passive OpenMP waiting unless the user chose otherwise,
torch threads = the cores this process may run on, and the CLI applying both before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from turnkv.threads import OMP_DEFAULTS, available_cores, prepare_env, set_threads


def test_prepare_env_fills_only_what_is_unset():
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert prepare_env(env) == {k: v for k, v in OMP_DEFAULTS.items() if k != "OMP_WAIT_POLICY"}
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"
    fresh: dict[str, str] = {}
    assert prepare_env(fresh) == OMP_DEFAULTS and fresh == OMP_DEFAULTS


def test_threads_follow_the_affinity_mask():
    assert 1 <= available_cores() <= len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
        assert set_threads(0) == available_cores() == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_cli_sets_passive_waiting_before_torch_loads():
    code = (
        "import os, sys\n"
        "os.environ.pop('OMP_WAIT_POLICY', None)\n"
        "import turnkv.cli as cli\n"
        "cli.build_parser = lambda: (_ for _ in ()).throw(SystemExit(0))\n"
        "try:\n    cli.main([])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split() == ["PASSIVE", "False"], out.stderr

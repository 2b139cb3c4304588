"""CPU thread set-up (turnkv/threads.py): a short OpenMP spin unless the user chose how to wait,
torch threads = the cores this process may run on, and the CLI applying both before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from turnkv.threads import OMP_DEFAULTS, USER_WAIT_KEYS, available_cores, prepare_env, set_threads


def test_prepare_env_leaves_a_users_waiting_policy_alone():
    for key, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "0")):
        env = {key: value}
        assert prepare_env(env) == {} and env == {key: value}
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


def test_cli_sets_the_spin_before_torch_loads():
    code = (
        "import os, sys\n"
        "os.environ.pop('GOMP_SPINCOUNT', None)\n"
        "import turnkv.cli as cli\n"
        "cli.build_parser = lambda: (_ for _ in ()).throw(SystemExit(0))\n"
        "try:\n    cli.main([])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in USER_WAIT_KEYS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split() == [OMP_DEFAULTS["GOMP_SPINCOUNT"], "False"], out.stderr

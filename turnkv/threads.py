"""CPU threads: how many torch uses, and how its OpenMP threads wait.

``prepare_env()`` must run before torch is imported (``cli.main`` calls it first; the CLI imports
torch lazily); ``set_threads()`` after. Both leave alone anything the user set explicitly.

Why a short spin: a decode step is ~120 small parallel regions (the int4 matmuls). Threads that
spin between them keep the team awake (``GOMP_SPINCOUNT`` 30000 decodes as fast as libgomp's
300000); threads that wait passively pay a wake-up in each. A spinning team collapses when
another process is busy on a core: that is what the engine's thread governor handles
(``turnkv/engine/cpu_threads.py`` measures steps and falls back to one thread). The spin is
finite, so a worker left idle by one-thread steps sleeps within about a millisecond instead of
competing for the busy core (``OMP_WAIT_POLICY=ACTIVE`` spins forever, slow beside a neighbour
even on one thread). Figures: docs/BENCHMARKS.md (issue 11).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# Set only where the user has set no waiting policy: the user's own OpenMP settings always win
# (libgomp lets an explicit GOMP_SPINCOUNT override OMP_WAIT_POLICY, so neither may be set).
OMP_DEFAULTS = {"GOMP_SPINCOUNT": "30000"}
USER_WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def prepare_env(environ: dict | None = None) -> dict[str, str]:
    """Put ``OMP_DEFAULTS`` into the environment unless the user chose how OpenMP waits; returns
    what it set."""
    env = os.environ if environ is None else environ
    if any(k in env for k in USER_WAIT_KEYS):
        return {}
    env.update(OMP_DEFAULTS)
    return dict(OMP_DEFAULTS)


def available_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def set_threads(threads: int = 0) -> int:
    """torch's intra-op threads: ``threads``, or (0) the cores available. Returns the count."""
    import torch

    n = threads if threads > 0 else available_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n

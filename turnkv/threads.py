"""CPU threads: how many torch uses, and how its OpenMP threads wait.

``prepare_env()`` must run before torch is imported (``cli.main`` calls it first; the CLI imports
torch lazily); ``set_threads()`` after. Both leave alone anything the user set explicitly.

Why: libgomp's threads spin between parallel regions. A decode step is hundreds of tiny regions,
so with another process busy on one of the two cores a spinning thread burns the time slice its
partner needs (issue 11: decode fell from 24.1 to 4.1 tok/s). Passive waiting lets the scheduler
run the partner at once. Measured on the shared 2-core VM (load average 9-10, default model
packed, 2 threads): 0.5 tok/s with libgomp's default, 5-13 with ``GOMP_SPINCOUNT=10000``, 20-23
with ``OMP_WAIT_POLICY=PASSIVE`` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# Set only where the user has not: the user's own OpenMP settings always win.
OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def prepare_env(environ: dict | None = None) -> dict[str, str]:
    """Put ``OMP_DEFAULTS`` into the environment where unset; returns what it set."""
    env = os.environ if environ is None else environ
    added = {k: v for k, v in OMP_DEFAULTS.items() if k not in env}
    env.update(added)
    return added


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

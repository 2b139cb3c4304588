"""Run one function on every rank of a fresh group, each rank computing alike (benches and tests).

``run_group(size, device, fn, *args)`` spawns ``size`` processes; each joins a new group (not
driven: no control messages, every rank runs ``fn`` itself), calls ``fn(group, *args)`` and
sends back its result; the caller gets the list in rank order. ``fn`` must be importable by name
(a module-level function) and its result picklable. A rank that raises or dies fails the call
with that rank's trace. Deterministic programs (greedy turns, seeded samples, the same inputs on
every rank) stay in step this way without rank 0 sending anything.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable

from turnkv.parallel.group import init_group, set_group_env
from turnkv.parallel.launch import free_port


def run_group(
    size: int, device: str, fn: Callable, *args, threads: int = 0, timeout_s: float = 600.0
) -> list:
    """``[fn(group, *args) on rank r for r in range(size)]`` (see the module docstring);
    ``threads`` > 0 sets each rank's torch CPU threads."""
    set_group_env()
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(r, size, device, port, fn, args, threads, results))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"rank process {dead[0].name} exited with code {dead[0].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the group of {size} did not finish in {timeout_s:.0f} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(30 if len(got) == size else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(5)
    return [got[r] for r in range(size)]


def _entry(rank, size, device, port, fn, args, threads, results) -> None:
    code = 0
    try:
        if threads:
            import torch

            torch.set_num_threads(threads)
        group = init_group(rank, size, device, f"tcp://127.0.0.1:{port}")
        results.put((rank, True, fn(group, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        code = 1
    results.close()
    results.join_thread()  # the result is in the pipe before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (NCCL's can hang after CUDA graph captures)

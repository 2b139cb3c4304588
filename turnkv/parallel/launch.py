"""``--tensor-parallel N`` on the command line: one process per GPU, started by turnkv (or torchrun).

``run_command(cfg, main)`` checks, before anything is loaded, that the model's heads, KV heads
and MLP rows divide by N (from its config alone) and that a CUDA run sees N GPUs -- either
failure is a ``ValueError``: one line and exit code 2. Then:

- started plainly, this process becomes rank 0 and spawns ranks 1..N-1 (``multiprocessing``
  spawn; they inherit the environment, NVLink multicast off) on ``127.0.0.1`` and a free port;
- under ``torchrun --nproc-per-node N`` (``RANK``/``WORLD_SIZE`` set), torchrun started every
  rank: rank 0 runs the command, the others follow.

Rank 0 runs ``main(cfg)`` (serve, generate or chat); the others run ``control.follow`` until rank
0 sends STOP. On rank 0 a watchdog thread waits on the spawned ranks: one that exits marks the
group down (``/health.tensor_parallel``, new turns refused with 503) instead of leaving the
server hanging. Ranks other than 0 ignore Ctrl-C (rank 0 stops them) and exit when rank 0's
process is gone.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from turnkv.config import EngineConfig, ModelConfig
from turnkv.parallel.group import Group, init_group, set_group_env
from turnkv.parallel.shard import check_divisible

log = logging.getLogger(__name__)

JOIN_S = 30.0  # how long rank 0 waits for the others to exit after STOP


def model_config(spec: str) -> tuple[ModelConfig, str]:
    """The model's config and name, read without its weights (for the checks before launching)."""
    from turnkv.models import gguf as gg
    from turnkv.models.load import (
        DEFAULT_NAME,
        SHAPES,
        ModelLoadError,
        config_from_hf,
        default_model_path,
        file_fingerprint,
    )

    if spec.startswith("random:"):
        shape = spec.split(":", 1)[1]
        if shape not in SHAPES:
            raise ModelLoadError(f"unknown shape {shape!r} (supported: {', '.join(SHAPES)})")
        return SHAPES[shape], spec
    path = default_model_path() if spec in ("", "default") else Path(spec).expanduser()
    name = DEFAULT_NAME if spec in ("", "default") else path.name
    if path.is_dir() and (path / "config.json").is_file():
        return config_from_hf(json.loads((path / "config.json").read_text())), name
    if path.is_file() and path.suffix.lower() == ".gguf":
        try:
            header, _, _ = gg.cached_header(path, file_fingerprint(path))
        except Exception as exc:
            raise ModelLoadError(f"{path.name} is not a readable GGUF file ({exc})") from exc
        return header.config, name
    raise ModelLoadError(f"model {spec!r} is neither a folder with config.json nor a .gguf file")


def check(cfg: EngineConfig, world: int | None = None) -> None:
    """Raise ValueError unless ``cfg.tensor_parallel`` can run here (module docstring)."""
    n = cfg.tensor_parallel
    full, name = model_config(cfg.model)
    check_divisible(full, n, name)
    if world is not None and world != n:
        raise ValueError(f"--tensor-parallel {n}, but torchrun started {world} processes: make them equal")
    wants_cuda = cfg.device.startswith("cuda") or (cfg.device in ("", "auto") and torch.cuda.is_available())
    if wants_cuda and torch.cuda.device_count() < n:
        raise ValueError(
            f"--tensor-parallel {n} needs {n} GPUs (one per process), but torch sees "
            f"{torch.cuda.device_count()}; use --tensor-parallel {max(torch.cuda.device_count(), 1)} "
            "or more GPUs (--device cpu runs the group on the CPU, for testing)"
        )


def run_command(cfg: EngineConfig, main: Callable[[EngineConfig], int]) -> int:
    """Run ``main`` on rank 0 of a group of ``cfg.tensor_parallel`` processes (module docstring)."""
    n = cfg.tensor_parallel
    if n <= 1:
        return main(cfg)
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun started every rank
        check(cfg, int(env["WORLD_SIZE"]))
        rank = int(env["RANK"])
        group = init_group(rank, n, cfg.device, "env://", int(env.get("LOCAL_RANK", rank)))
        group.driven = True
        return _leave(group, _lead(cfg, main, group, []) if rank == 0 else _follow(cfg, group))
    check(cfg)
    set_group_env()
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_follower_entry, args=(cfg, r, n, port, os.getpid()), name=f"turnkv-rank{r}")
        for r in range(1, n)
    ]
    for p in procs:
        p.start()
    try:
        group = init_group(0, n, cfg.device, f"tcp://127.0.0.1:{port}")
    except BaseException:
        _end(procs, 0.0)
        raise
    group.driven = True
    return _leave(group, _lead(cfg, main, group, procs))


def _lead(cfg: EngineConfig, main, group: Group, procs: list) -> int:
    stopping = threading.Event()
    if procs:
        threading.Thread(
            target=_watch, args=(group, procs, stopping), name="turnkv-tp-watchdog", daemon=True
        ).start()
    try:
        return main(cfg)
    finally:
        stopping.set()
        if group.driver is not None:
            try:
                group.driver.stop()
            except Exception as exc:  # a rank already gone: nothing to tell it
                log.warning("could not stop the other ranks: %s", exc)
        _end(procs, JOIN_S)


def _watch(group: Group, procs: list, stopping: threading.Event) -> None:
    """Mark the group down as soon as a spawned rank exits while rank 0 still needs it."""
    pending = {p.sentinel: p for p in procs}
    while pending:
        for sentinel in multiprocessing.connection.wait(list(pending)):
            p = pending.pop(sentinel)
            p.join()
            if not stopping.is_set():
                rank = int(p.name.removeprefix("turnkv-rank"))
                group.down(f"rank {rank} exited with code {p.exitcode}", rank)


def _end(procs: list, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.0))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)


def _leave(group: Group, code: int) -> NoReturn:
    """End this process with ``code`` once every rank is done (after STOP's barrier), skipping
    the interpreter's teardown of torch.distributed: with NCCL ``destroy_process_group`` can hang
    after a CUDA graph captured collectives (pytorch/pytorch#115388), and under torchrun on gloo
    the teardown aborted one run in twelve here ("terminate called without an active exception")."""
    del group  # the process ends with it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _follow(cfg: EngineConfig, group: Group) -> int:
    from turnkv.runtime import follow

    follow(cfg)  # this rank's shard, replaying rank 0's steps (the group is ``current_group()``)
    return 0


def _follower_entry(cfg: EngineConfig, rank: int, size: int, port: int, parent: int) -> None:
    """A spawned rank: join the group, follow rank 0, exit (never back into the caller's code)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process: rank 0 stops us
    threading.Thread(target=_watch_parent, args=(parent,), name="turnkv-tp-parent", daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(message)s")
    code = 1
    try:
        group = init_group(rank, size, cfg.device, f"tcp://127.0.0.1:{port}")
        group.driven = True
        code = _follow(cfg, group)
    except BaseException as exc:  # one line for a user, the trace in the log
        print(f"turnkv: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        log.debug("rank %d failed", rank, exc_info=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: NCCL's can hang after graph captures


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)  # rank 0 is gone: nobody will send the next step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""Small all-reduces in one kernel over NVLink: torch's one-shot all-reduce on symmetric memory.

A decode step under tensor parallelism makes two all-reduces per layer of a few rows each
(``[B, hidden]``: 8 KiB at batch 1 on the 8B shape), 65 a step. NCCL's time for one of them
inside a CUDA graph is mostly protocol and synchronisation, not bytes (docs/BENCHMARKS.md,
'Tensor parallelism (issue 15)'). torch's ``symm_mem.one_shot_all_reduce_copy_out`` does it in
one kernel: each rank copies its rows into a buffer that every rank of the group maps (symmetric
memory, allocated and exchanged once here), a barrier over signal pads, every rank reads every
rank's buffer and sums them, a closing barrier (the next call may then overwrite the buffer).

Every rank sums the buffers in the same order (rank 0, 1, ...: torch's ``load_and_reduce``
indexes its loads by absolute rank), so every rank ends with the same bytes -- the invariant
``group.TensorParallel`` keeps for NCCL too (module docstring there).

Messages up to ``MAX_BYTES`` take it; larger ones (prefill chunks) stay on NCCL, whose ring
moves bytes better. ``TURNKV_TP_ALL_REDUCE=nccl`` keeps every all-reduce on NCCL.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

ENV = "TURNKV_TP_ALL_REDUCE"  # auto (one-shot where it can) | nccl
# the largest message the one-shot kernel takes: decode steps of up to 64 rows at hidden 8192
# (bf16); prefill chunks are far larger and stay on NCCL
MAX_BYTES = 1 << 20


class OneShot:
    """The symmetric buffer of one process group and the one-shot all-reduce over it."""

    def __init__(self, group_name: str, device: torch.device, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
        if enabled is not None and not enabled(group_name):
            symm_mem.enable_symm_mem_for_group(group_name)
        self.group_name = group_name
        self.dtype = dtype
        self.buffer = symm_mem.empty(MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group_name)  # a collective: every rank maps every buffer

    def takes(self, y: torch.Tensor) -> bool:
        return y.dtype == self.dtype and y.is_cuda and y.numel() <= self.buffer.numel() and y.is_contiguous()

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """The sum of ``y`` over the group's ranks, as a new tensor (``y`` is left as it was)."""
        out = torch.empty_like(y)
        slot = self.buffer[: y.numel()].view_as(y)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(slot, y, "sum", self.group_name, out)
        return out


def make_one_shot(group, device: torch.device, dtype: torch.dtype) -> tuple[OneShot | None, str]:
    """The one-shot all-reduce for ``group`` (a ``group.Group``) or None, and what
    ``/health.tensor_parallel.all_reduce`` says. Every rank calls this at the same point; every
    rank takes the same answer (a rank that cannot map the buffer makes every rank use NCCL)."""
    mode = os.environ.get(ENV, "auto").strip().lower()
    if mode not in ("auto", "nccl"):
        raise ValueError(f"{ENV}={mode!r}: expected auto or nccl")
    if device.type != "cuda":
        return None, "gloo" if device.type == "cpu" else "nccl"
    if mode == "nccl":
        return None, f"nccl ({ENV}=nccl)"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return None, "nccl (this torch has no symmetric-memory one-shot all-reduce)"
    one, why = None, ""
    try:
        one = OneShot(group.data.group_name, device, dtype)
    except Exception as exc:  # no peer access, an old driver: NCCL does everything
        why = f"{type(exc).__name__}: {exc}"
        log.warning("one-shot all-reduce unavailable, NCCL only: %s", why)
    if group.min_over_ranks(int(one is not None)) == 0:
        return None, f"nccl (symmetric memory unavailable{': ' + why if why else ' on another rank'})"
    return one, f"one-shot on symmetric memory up to {MAX_BYTES >> 10} KiB, nccl above"

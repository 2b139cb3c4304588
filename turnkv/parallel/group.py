"""This process's tensor-parallel group: its rank and device, the collectives the model calls, health.

``init_group`` joins the group (``torch.distributed``: NCCL between GPUs, gloo on CPU) and makes
a second, gloo-only group for the control messages of ``control.py`` (host data never goes
through NCCL). ``current_group()`` is what ``runtime.load_engine`` asks for; it hands the
loaders ``partial(shard_model, group=group)`` as the empty model to fill (``models`` never
imports ``parallel``).

``TensorParallel`` is what ``LlamaModel.tp`` holds: the shard plan and the three collectives of
a step -- an all-reduce after the vocabulary-split embedding, one after each row-parallel layer
(o and down: two per layer), and an all-gather of the LM head's vocabulary shards. Every rank
ends each collective with bit-identical tensors (ring and tree all-reduces hand every rank the
same reduced bytes; a gather copies), so every rank takes the same argmax and draws the same
sample from a generator seeded alike: that is what keeps their schedulers and banks in step.

Every process turnkv starts for a group runs with NVLink multicast off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``): the lent GPU hosts require it.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from turnkv.parallel.shard import ShardPlan

log = logging.getLogger(__name__)

# set in every process of a group before torch.distributed starts (see the module docstring)
GROUP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# a collective or control message that waits longer than this fails (a rank died or hung);
# long enough for the slowest first step (Triton compiling its kernels on every rank at once)
TIMEOUT_S = float(os.environ.get("TURNKV_TP_TIMEOUT_S", "300"))


def set_group_env() -> None:
    os.environ.update(GROUP_ENV)


@dataclass
class GroupHealth:
    """Whether every rank is alive and in step. Set once, by the watchdog (a rank exited), a
    failed control message or a failed step; read by ``/health`` and the request handlers.
    ``size`` is the group's; every rank's bank holds ``1/size`` of each KV row."""

    size: int
    error: str | None = None
    dead_ranks: list[int] = field(default_factory=list)
    all_reduce: str = ""  # which all-reduce the model's collectives take (one_shot.make_one_shot)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, reason: str, rank: int | None = None) -> None:
        with self._lock:
            if rank is not None and rank not in self.dead_ranks:
                self.dead_ranks.append(rank)
            if self.error is None:
                self.error = reason
                log.error("tensor-parallel group down: %s", reason)

    def doc(self) -> dict:
        """``/health.tensor_parallel``."""
        with self._lock:
            return {
                "size": self.size,
                "status": "ok" if self.error is None else "down",
                "dead_ranks": list(self.dead_ranks),
                "error": self.error,
                "all_reduce": self.all_reduce,
            }


@dataclass
class Group:
    """This process's membership: rank ``rank`` of ``size``, on ``device``."""

    rank: int
    size: int
    device: torch.device
    data: object  # the ProcessGroup of the model's collectives (NCCL on CUDA, gloo on CPU)
    control: object  # a gloo ProcessGroup for control messages (control.py)
    health: GroupHealth
    # True when rank 0 drives the others with control messages (the turnkv command); False when
    # every rank runs the same program itself (benches and tests: nothing to send)
    driven: bool = False
    driver: object = None  # rank 0's control.Leader once its engine exists
    on_down: list = field(default_factory=list)  # callables(reason) run when a rank dies

    def down(self, reason: str, rank: int | None = None) -> None:
        """Mark the group down (``health``) and tell whoever listens (the server's worker)."""
        first = self.health.ok
        self.health.fail(reason, rank)
        for fn in list(self.on_down) if first else ():
            try:
                fn(reason)
            except Exception:
                log.exception("a tensor-parallel on_down callback failed")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def agree_min(self, value: int) -> int:
        """``min_over_ranks`` on the model's group, in step order on the engine thread (the
        control group is rank 0's heartbeat thread's too): what the disk tier's restores agree on."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.data)
        return int(t.item())

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (a collective: every rank calls it together)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


_current: Group | None = None
# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def current_group() -> Group | None:
    """The group this process joined (``init_group``), or None."""
    return _current


def group_device(device: str, local_rank: int) -> torch.device:
    """One GPU per rank (``cuda:<local rank>``) for ``cuda``/``auto`` with CUDA, else the CPU."""
    if device in ("", "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    return torch.device("cuda", local_rank) if dev.type == "cuda" else dev


def init_group(rank: int, size: int, device: str, init_method: str, local_rank: int | None = None) -> Group:
    """Join the group of ``size`` processes as ``rank`` (``init_method``: ``tcp://host:port`` or
    ``env://`` under torchrun) and make it this process's ``current_group()``."""
    global _current
    set_group_env()
    if rank == 0:  # rank 0 must outlive a dead peer to report it: abort the communicator, not us
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    dev = group_device(device, rank if local_rank is None else local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    bind = {"device_id": dev} if dev.type == "cuda" else {}  # NCCL's communicator made here, eagerly
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout, **bind
    )
    # its own group even on CPU: control messages (another thread on rank 0) never interleave
    # with the model's collectives
    control = dist.new_group(backend="gloo", timeout=timeout)
    # the first collective builds the NCCL communicator: here, never inside a CUDA graph capture
    warm = torch.ones(1, device=dev)
    dist.all_reduce(warm)
    if int(warm.item()) != size:
        raise RuntimeError(f"the group's first all-reduce gave {warm.item()}, expected {size}")
    _current = Group(rank, size, dev, dist.group.WORLD, control, GroupHealth(size))
    return _current


class TensorParallel:
    """``LlamaModel.tp``: this rank's shard plan and the collectives of a step (module docstring)."""

    def __init__(self, group: Group, plan: ShardPlan, dtype: torch.dtype) -> None:
        from turnkv.parallel.one_shot import make_one_shot

        self.group = group
        self.plan = plan
        self.rank, self.size = plan.rank, plan.size
        self.lo, self.hi = plan.vocab_range
        self.vocab = plan.full.vocab_size
        # decode-sized all-reduces in one kernel on symmetric memory where the GPUs allow it
        self.one_shot, group.health.all_reduce = make_one_shot(group, group.device, dtype)

    def vocab_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[N]`` as rows of this rank's embedding shard (others' ids read row 0)."""
        mine = (ids >= self.lo) & (ids < self.hi)
        return torch.where(mine, ids - self.lo, 0)

    def vocab_reduce(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows ``x`` ``[N, hidden]`` of ``vocab_ids(ids)``: zero the rows of other
        ranks' ids, then sum over ranks (every id's row comes from exactly one rank)."""
        mine = (ids >= self.lo) & (ids < self.hi)
        x.masked_fill_(~mine[:, None], 0)
        return self.all_reduce(x)

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` summed over ranks (every rank ends with the same bytes): decode-sized messages
        through the one-shot kernel into a new tensor (``one_shot.py``), others in place by NCCL
        (gloo on a CPU). Use the returned tensor."""
        if self.one_shot is not None and self.one_shot.takes(y):
            return self.one_shot(y)
        dist.all_reduce(y, group=self.group.data)
        return y

    def gather_vocab(self, part: torch.Tensor) -> torch.Tensor:
        """Logits ``[R, V / size]`` of this rank's vocabulary rows -> ``[R, V]`` on every rank."""
        r, vs = part.shape
        if r == 0:  # a step that asks for no logits (every rank knows R)
            return part.new_empty(0, self.vocab)
        out = part.new_empty(self.size * r, vs)
        _all_gather(out, part.contiguous(), group=self.group.data)
        # [size, R, Vs] -> [R, size * Vs]; the last rank's zero padding rows are dropped
        return out.view(self.size, r, vs).permute(1, 0, 2).reshape(r, self.size * vs)[:, : self.vocab]


def shard_model(cfg, device: torch.device, dtype: torch.dtype, group: Group):
    """An empty ``LlamaModel`` of this rank's shard of ``cfg``, with its ``tp`` set (the loaders
    fill it: ``load.py``)."""
    from turnkv.models.llama import LlamaModel

    plan = ShardPlan(group.rank, group.size, cfg)
    model = LlamaModel(plan.config, device, dtype)
    model.tp = TensorParallel(group, plan, dtype)
    return model

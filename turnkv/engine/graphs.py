"""CUDA graphs for decode steps: one capture per padded batch size and context bucket.

A decode step (every window one row) is a pure function of a few device buffers: the step's ids,
positions and logit rows, and the segment table (``attention/fused.py``). ``DecodeGraphs``
captures the whole forward once per (padded batch size, split count, solo) into a shared memory
pool, then each step only writes those buffers (two uploads: ``stage``) and replays (``replay``).
A verify window of context-copy drafts reaches here cut into one-row windows
(``step.one_row_windows``); alone in its step it is ``solo``: its matmuls take the one-row GEMV
for every row, so each row rounds as it would decoded alone.
Padding sequences have ``q_len`` 0 and are neither read nor written by the kernels. The split
count of the attention launch is fixed by the key bucket (the next power of two of the longest
context), and the eager fused path picks its splits the same way (``backend.decode_launch``),
so a replay equals an eager step of the same batch bit for bit.

``--cuda-graphs auto`` captures where it can: CUDA, the fused route, windows of one row, at most
``MAX_GRAPH_BATCH`` of them, each with at most ``MAX_SEGMENTS`` views; everything else runs
eagerly, and ``status`` says why graphs are off altogether (``/health.scheduler.graphs``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turnkv.attention.backend import AttentionBackend, StepAttention
from turnkv.attention.segment_table import GRAPH_BATCHES
from turnkv.engine.step import StepPlan, StepResult, Window, carry, host_inputs, open_kv
from turnkv.kv.cache import KVWindow
from turnkv.models.matmul import MatmulPlan

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = GRAPH_BATCHES[-1]


class NoGraphs:
    """Every step runs eagerly; ``status`` says why."""

    def __init__(self, status: str) -> None:
        self.status = status
        self.replays = 0
        self.captures = 0

    def stage(self, windows: Sequence[Window], solo: bool = False) -> GraphStep | None:
        return None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [5 * bs] int64: ids | positions | logit rows (what the graph reads) | feeds
    table: torch.Tensor  # the segment table's words
    logits: torch.Tensor  # [bs, V]


@dataclass
class GraphStep:
    """A decode step staged for replay (``DecodeGraphs.stage``)."""

    windows: list[Window]
    kv: list[KVWindow]
    key: tuple[int, int, bool]  # (padded batch size, split count, ``solo``): which graph
    captured: _Captured  # its buffers (fresh ones when that graph is not captured yet)
    step: StepAttention  # the segment table's plan, written into ``captured.table``
    used: int  # words of ``captured.inputs`` written: ids, positions, rows of bs, then the feeds


class DecodeGraphs:
    """Captured decode steps of one model (see the module docstring). ``threaded``: the step has
    collectives (tensor parallelism), captured in ``thread_local`` mode (``_capture``)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, threaded: bool) -> None:
        self.model, self.backend, self.threaded = model, backend, threaded
        self.status = "on"
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, bool], _Captured] = {}
        self.replays = 0
        self.captures = 0

    def stage(self, windows: Sequence[Window], solo: bool = False) -> GraphStep | None:
        """The host work of this decode step's replay (KV windows, inputs and segment table
        written into the graph's buffers, in stream order), or None: it runs eagerly. Needs
        nothing from the step in flight, so it can run before that step's argmax is launched.
        ``solo``: the rows are one conversation's (a verify window cut into one-row windows), each
        to round as alone (``LlamaModel.forward``): graphs of their own."""
        b = len(windows)
        if b > MAX_GRAPH_BATCH or any(len(w.tokens) != 1 or w.logits != 1 for w in windows):
            return None
        kv = [open_kv(w) for w in windows]
        launch = self.backend.decode_launch(kv)  # the batch and splits an eager step takes too
        if launch is None:
            return None
        bs = launch.batch
        words, _, _ = host_inputs(windows, kv)
        pad = bs - b
        inputs = words[:b] + [0] * pad + words[b : 2 * b] + [0] * pad + list(range(bs)) + words[3 * b :]
        host = torch.tensor(inputs, dtype=torch.int64, pin_memory=True)
        # one graph per batch size and split count: the split count is all a graph bakes in of the
        # context (past a few thousand keys it no longer changes), so contexts share graphs; keyed
        # by the context bucket instead, a 64-client H200 run spent most of its time capturing
        # (the split count is sized by conversations: a verify window's rows split as one row's)
        key = (bs, launch.splits, solo)
        captured = self.graphs.get(key) or self._new_buffers(bs)
        captured.inputs[: len(inputs)].copy_(host, non_blocking=True)
        step = self.backend.plan(kv, launch, out=captured.table)
        return GraphStep(list(windows), kv, key, captured, step, len(inputs))

    def replay(self, staged: GraphStep, prev: torch.Tensor | None = None) -> StepResult:
        """Replay (capturing first) the graph of ``staged``. ``prev`` (device): the argmax of the
        step in flight, which fed rows read (``carry``: on the device, never on the host)."""
        captured, (bs, _, solo) = staged.captured, staged.key
        b, inputs = len(staged.windows), captured.inputs
        carry(inputs[:b], prev, inputs[3 * bs : staged.used])
        ids, pos, rows = inputs[:bs], inputs[bs : 2 * bs], inputs[2 * bs : 3 * bs]
        matmul = MatmulPlan(solo=solo)  # decode rows: none wide
        if self.graphs.get(staged.key) is not captured:
            self._capture(captured, ids, pos, rows, staged.step, matmul)
            self.graphs[staged.key] = captured
        captured.graph.replay()
        self.replays += 1
        plan = StepPlan(
            staged.windows, staged.kv, ids[:b], pos[:b], rows[:b], list(range(b)), staged.step, matmul
        )
        return StepResult(plan, captured.logits[:b])

    def _new_buffers(self, bs: int) -> _Captured:
        device = self.model.device
        inputs = torch.zeros(5 * bs, dtype=torch.int64, device=device)
        return _Captured(torch.cuda.CUDAGraph(), inputs, self.backend.graph_table(bs), torch.empty(0))

    def _capture(self, captured: _Captured, ids, pos, rows, step, matmul: MatmulPlan) -> None:
        model = self.model
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles the kernels at these shapes
            model(ids, pos, rows, step, matmul)
        torch.cuda.current_stream().wait_stream(stream)
        if self.threaded:  # NCCL's watchdog queries the events of eager collectives: let them finish
            torch.cuda.synchronize()
        # thread_local: a global-mode capture forbids "unsafe" calls in *every* thread, and other
        # threads make them while a step captures: the disk tier's writer (cudaEventSynchronize,
        # pinned allocations, stream syncs), NCCL's watchdog (cudaEventQuery, pytorch#104487).
        # One such call invalidates the capture, and the step's next launch fails with "operation
        # failed due to a previous error during capture" (issue 30's cold run). Their work is on
        # streams of their own, so only this thread's calls need to be checked.
        with torch.cuda.graph(captured.graph, pool=self.pool, capture_error_mode="thread_local"):
            captured.logits = model(ids, pos, rows, step, matmul)
        self.captures += 1
        log.info("captured a decode graph for %d rows", ids.shape[0])


def make_graphs(
    mode: str, model: torch.nn.Module, backend: AttentionBackend, threaded: bool
) -> DecodeGraphs | NoGraphs:
    """``--cuda-graphs auto|off``: captured decode where possible, else eager with the reason."""
    if mode == "off":
        return NoGraphs("off: --cuda-graphs off")
    if model.device.type != "cuda":
        return NoGraphs(f"off: no CUDA ({model.device.type})")
    if not backend.captures_graphs:
        return NoGraphs(f"off: the attention route is not fused ({backend.verdict.verdict})")
    return DecodeGraphs(model, backend, threaded)

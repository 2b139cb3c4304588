"""CUDA graphs for every step: one capture per shape bucket, attention included.

A step is a pure function of a few device buffers: its ids, positions and logit rows, and the
segment table (``attention/fused.py``), which the attention kernels read their whole plan from
(views, windows, row offsets). ``StepGraphs`` captures the whole forward once per bucket into a
shared memory pool, then each step only writes those buffers (two uploads: ``stage``) and replays
(``replay``): no Python per layer, whatever the step holds.

- **Decode steps** (every window one row): keyed by (padded batch size, split count, solo). A
  verify window of context-copy drafts reaches here cut into one-row windows
  (``step.one_row_windows``); alone in its step it is ``solo``: its matmuls take the one-row GEMV
  for every row, so each row rounds as it would decoded alone. The eager fused path picks its
  splits as a graph does (``backend.decode_launch``), so a replay equals an eager step of the
  same batch bit for bit.
- **Steps with prompt rows** (prefill chunks, alone or beside decode and verify rows): keyed by
  the row bucket of their rows (``segment_table.row_bucket``, up to 8192), their padded logit
  rows and the attention's ``MixedLaunch`` (per table: its batch class, ``MIXED_BATCHES``, the
  grid's rows: 1 or 32 for the narrow table, the step's row bucket for the wide one, and the
  tiles and room for splits those give). Neither a chunk's size nor any context enters the key:
  each table's grid has room for the most splits any context could ask (``table_launch``), and
  the step's own split count
  (by the key bucket of its longest context and its conversations) is written into the segment
  table, where the kernels read it; the programs past it read and write nothing
  (``FusedBackend.table_launch``/``table_splits``). Padding rows read token 0 at position 0 and
  belong to no window; a replay equals the same staged step run eagerly (``StepGraphs.eager``,
  what the capture's warm-up runs) bit for bit.

A graph's output buffer is rewritten by its next replay, so a step's fp32 logits are upcast from it
after the replay into a tensor of the caller's (``_result``): a kept row stays what its step gave.
Padding sequences have ``q_len`` 0 and are neither read nor written by the kernels. Captures are
lazy (the first step of a key captures it: a warm-up forward that compiles the kernels at those
shapes, then the capture), so no JIT runs inside a capture. Once the server's warm-up has run
(``engine.warmup``) the graphs are ``sealed``: a step whose key the warm-up did not capture runs
eagerly on its staged buffers (``eager``: the same bits a replay would give) and is counted in
``misses`` instead of capturing while serving (a capture stalls every running turn for a forward
and more, and captured under load it shares the device with the tiers' copy threads). The
mixed keys are few (row bucket x the narrow table's class and grid rows x the wide table's
class: 165 for a 1024-row budget and 64 running, ``engine.mixed_keys``), and the warm-up captures
a step of each (``warmup.capture_mixed``; ``/health.scheduler.warmup.mixed_keys``).

``--cuda-graphs off`` stages every step the same way and runs it eagerly on those buffers (so
graphs on or off change no bit). ``--cuda-graphs auto`` captures where it can: CUDA, the fused route, at most ``MAX_GRAPH_BATCH``
windows of each kind (one-row/narrow, prefill), each with at most ``MAX_SEGMENTS`` views, and
plain (unpacked) weights for steps with prompt rows; everything else runs eagerly, and
``status`` says why graphs are off altogether (``/health.scheduler.graphs``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turnkv.attention.backend import AttentionBackend, MixedLaunch, StepAttention
from turnkv.attention.segment_table import GRAPH_BATCHES, row_bucket
from turnkv.engine.step import StepPlan, StepResult, Window, carry, host_inputs, open_kv
from turnkv.kv.cache import KVWindow
from turnkv.models.matmul import MatmulPlan

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = GRAPH_BATCHES[-1]


class NoGraphs:
    """Every step runs eagerly; ``status`` says why."""

    max_windows = None  # no bound on a step's windows: none is captured

    def __init__(self, status: str) -> None:
        self.status = status
        self.replays = 0
        self.mixed_replays = 0
        self.captures = 0
        self.misses = 0
        self.missed: set[tuple] = set()

    def seal(self) -> None:
        pass

    def stage(self, windows: Sequence[Window], solo: bool = False) -> GraphStep | None:
        return None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [2 * rows + 3 * logits] int64: ids | positions | logit rows | feeds
    table: torch.Tensor  # the segment table's words
    logits: torch.Tensor  # [logits, V] in the compute dtype, rewritten by every replay (``_result``)


@dataclass
class GraphStep:
    """A step staged for replay (``StepGraphs.stage``)."""

    windows: list[Window]
    kv: list[KVWindow]
    key: tuple  # which graph: (rows, logit rows, the attention's launch, ``solo``)
    captured: _Captured  # its buffers (fresh ones when that graph is not captured yet)
    step: StepAttention  # the segment table's plan, written into ``captured.table``
    used: int  # words of ``captured.inputs`` written: ids, positions, rows, then the feeds
    rows: int  # the real rows (of ``key[0]``) and logit rows (of ``key[1]``)
    logits: int
    offsets: list[int]  # window i's logits are rows [off_i, ...) of ``logits``

    @property
    def mixed(self) -> bool:
        return isinstance(self.key[2], MixedLaunch)


def padded_inputs(words: list[int], n: int, r: int, np_: int, rp: int) -> list[int]:
    """``host_inputs``'s ``ids + positions + logit_rows + feeds`` of ``n`` rows and ``r`` logit
    rows laid out for a graph of ``np_`` rows and ``rp`` logit rows: padding rows read token 0 at
    position 0 and padding logit rows row 0 (each row's matmuls and norms are its own, and no
    window's attention reads a padding row, so a real row comes out the same)."""
    ids, pos, rows, feeds = words[:n], words[n : 2 * n], words[2 * n : 2 * n + r], words[2 * n + r :]
    return ids + [0] * (np_ - n) + pos + [0] * (np_ - n) + rows + [0] * (rp - r) + feeds


class StepGraphs:
    """Captured steps of one model (see the module docstring). ``threaded``: the step has
    collectives (tensor parallelism), captured in ``thread_local`` mode (``_capture``)."""

    # the most one-row windows a captured step holds (a decode graph's batch, a mixed step's
    # narrow table): the scheduler drafts no further, or the step would run eagerly, several
    # times slower than its replay (docs/BENCHMARKS.md, "A step timeline under load")
    max_windows = MAX_GRAPH_BATCH

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        threaded: bool,
        capture: bool = True,
        rowinv: bool = False,
    ) -> None:
        """``capture`` False (``--cuda-graphs off``): every step is staged alike and runs eagerly
        on its buffers (``eager``), so a step's bits do not depend on whether graphs are on."""
        self.model, self.backend, self.threaded, self.capture = model, backend, threaded, capture
        self.rowinv = rowinv  # --deterministic: every captured matmul row through triton_rowinv
        self.status = "on" if capture else "off: --cuda-graphs off"
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Captured] = {}
        self.replays = 0
        self.mixed_replays = 0  # of ``replays``: steps with prompt rows
        self.captures = 0
        self.sealed = False  # after the warm-up: uncaptured keys run eagerly (``seal``)
        self.misses = 0  # steps run eagerly since ``seal`` because their key was not captured
        self.missed: set[tuple] = set()  # those keys (each logged once)
        # packed weights choose their matmul path per window (``MatmulPlan.wide``), which a
        # graph would bake in: steps with prompt rows run eagerly over them
        self._plain = isinstance(model.layers[0].qkv, torch.Tensor)

    def seal(self) -> None:
        """From now on capture nothing: a step of a key not captured yet runs eagerly (a miss)."""
        self.sealed = True

    def stage(self, windows: Sequence[Window], solo: bool = False) -> GraphStep | None:
        """The host work of this step's replay (KV windows, inputs and segment table written
        into the graph's buffers, in stream order), or None: it runs eagerly. Needs nothing from
        the step in flight, so it can run before that step's argmax is launched. ``solo``: the
        rows are one conversation's (a verify window cut into one-row windows), each to round as
        alone (``LlamaModel.forward``): graphs of their own."""
        if all(len(w.tokens) == 1 == w.logits for w in windows):
            return self._stage_decode(windows, solo)
        return self._stage_mixed(windows) if self._plain and not solo else None

    def _stage_decode(self, windows: Sequence[Window], solo: bool) -> GraphStep | None:
        b = len(windows)
        if b > MAX_GRAPH_BATCH:
            return None
        kv = [open_kv(w) for w in windows]
        launch = self.backend.decode_launch(kv)  # the batch and splits an eager step takes too
        if launch is None:
            return None
        bs = launch.batch
        words, _, _, _ = host_inputs(windows, kv)
        # one graph per batch size and split count: the split count is all a graph bakes in of the
        # context (past a few thousand keys it no longer changes), so contexts share graphs; keyed
        # by the context bucket instead, a 64-client H200 run spent most of its time capturing
        # (the split count is sized by conversations: a verify window's rows split as one row's)
        key = (bs, bs, launch.splits, solo)
        return self._write(windows, kv, key, launch, padded_inputs(words, b, b, bs, bs), b, b, list(range(b)))

    def _stage_mixed(self, windows: Sequence[Window]) -> GraphStep | None:
        """A step with prompt rows (prefill chunks beside decode and verify rows, or alone),
        captured whole: its rows padded to their bucket (``segment_table.row_bucket``), the
        attention's tables to ``MixedLaunch``'s batches and widest windows."""
        if any(w.scores for w in windows):  # scoring rows (the prompt's logprobs) run eagerly
            return None
        n = sum(len(w.tokens) for w in windows)
        np_ = row_bucket(n)
        if np_ is None:
            return None
        kv = [open_kv(w) for w in windows]
        launch = self.backend.mixed_launch(kv)
        if launch is None:
            return None
        words, _, offsets, _ = host_inputs(windows, kv)
        r, rp = sum(w.logits for w in windows), launch.batch  # a window asks for <= 1 logit row
        if r > rp:  # (a verify window not cut into one-row windows)
            return None
        inputs = padded_inputs(words, n, r, np_, rp)
        return self._write(windows, kv, (np_, rp, launch, False), launch, inputs, n, r, offsets)

    def _write(self, windows, kv, key, launch, inputs, n, r, offsets) -> GraphStep:
        """Write ``inputs`` and the segment table into the buffers of the graph ``key``."""
        # positions past the rope tables grow them (past the engine's context limit: a direct
        # engine caller), which frees the tables every graph so far reads: those graphs go
        top = max(k.start + k.rows for k in kv)
        if self.model.rope.ensure(top) and self.graphs:
            log.warning("the rope tables grew to position %d: dropping %d step graphs", top, len(self.graphs))
            self.graphs.clear()
        captured = self.graphs.get(key) or self._new_buffers(key[0], key[1], launch.batch)
        host = torch.tensor(inputs, dtype=torch.int64, pin_memory=True)
        captured.inputs[: len(inputs)].copy_(host, non_blocking=True)
        step = self.backend.plan(kv, launch, out=captured.table)
        return GraphStep(list(windows), kv, key, captured, step, len(inputs), n, r, offsets)

    def _buffers(self, staged: GraphStep, prev: torch.Tensor | None):
        """``ids``, ``positions``, ``logit_rows`` of ``staged``'s graph, the fed ids carried in,
        and its matmul plan."""
        inputs, (np_, rp, _, solo) = staged.captured.inputs, staged.key
        carry(inputs[:np_], prev, inputs[2 * np_ + rp : staged.used])
        ids, pos, rows = inputs[:np_], inputs[np_ : 2 * np_], inputs[2 * np_ : 2 * np_ + rp]
        return ids, pos, rows, MatmulPlan(solo=solo, rowinv=self.rowinv)  # (plain weights: no wide rows)

    def replay(self, staged: GraphStep, prev: torch.Tensor | None = None) -> StepResult:
        """Replay (capturing first) the graph of ``staged``. ``prev`` (device): the argmax of the
        step in flight, which fed rows read (``carry``: on the device, never on the host)."""
        captured = staged.captured
        if not self.capture:
            self.graphs[staged.key] = captured  # (its buffers, for the next step of this shape)
            return self.eager(staged, prev)
        if self.graphs.get(staged.key) is not captured and self.sealed:
            return self._miss(staged, prev)
        ids, pos, rows, matmul = self._buffers(staged, prev)
        self._ensure(staged, ids, pos, rows, matmul)
        captured.graph.replay()
        self.replays += 1
        self.mixed_replays += staged.mixed
        return self._result(staged, captured.logits, ids, pos, rows, matmul)

    def prepare(self, staged: GraphStep) -> bool:
        """Capture the graph of ``staged`` if it is not yet, replaying nothing (the warm-up);
        whether it is captured now (False: sealed, or graphs off)."""
        if self.graphs.get(staged.key) is staged.captured:
            return True
        if not self.capture or self.sealed:
            return False
        self._ensure(staged, *self._buffers(staged, None))
        return True

    def _ensure(self, staged: GraphStep, ids, pos, rows, matmul: MatmulPlan) -> None:
        """Capture the graph of ``staged`` on these buffers unless it holds that key already."""
        if self.graphs.get(staged.key) is not staged.captured:
            self._capture(staged.captured, ids, pos, rows, staged.step, matmul)
            self.graphs[staged.key] = staged.captured

    def _miss(self, staged: GraphStep, prev: torch.Tensor | None) -> StepResult:
        self.misses += 1
        if staged.key not in self.missed:
            self.missed.add(staged.key)
            log.warning("step graph not captured in the warm-up, running eagerly: %s", describe(staged.key))
        return self.eager(staged, prev)

    def eager(self, staged: GraphStep, prev: torch.Tensor | None = None) -> StepResult:
        """The forward of ``staged`` run eagerly on its graph's buffers, what its capture's
        warm-up runs (the reference a replay equals bit for bit: ``tests/test_mixed_graphs.py``)."""
        ids, pos, rows, matmul = self._buffers(staged, prev)
        logits = self.model(ids, pos, rows, staged.step, matmul, upcast=False)
        return self._result(staged, logits, ids, pos, rows, matmul)

    @staticmethod
    def _result(staged: GraphStep, logits, ids, pos, rows, matmul) -> StepResult:
        """The step's result, its fp32 logits a tensor of its own: ``logits`` (the graph's output
        in the compute dtype) is rewritten by the next replay of this graph, which a caller that
        keeps a step's logits (a test's reference row) must not see. The upcast that every step
        makes anyway runs here, after the replay, so owning them costs no copy (fp32 models:
        one)."""
        n, r = staged.rows, staged.logits
        plan = StepPlan(
            staged.windows, staged.kv, ids[:n], pos[:n], rows[:r], staged.offsets, staged.step, matmul
        )
        own = logits[:r].float() if logits.dtype != torch.float32 else logits[:r].clone()  # [R, V]
        return StepResult(plan, own)

    def _new_buffers(self, rows: int, logits: int, tables: int) -> _Captured:
        device = self.model.device
        inputs = torch.zeros(2 * rows + 3 * logits, dtype=torch.int64, device=device)
        return _Captured(torch.cuda.CUDAGraph(), inputs, self.backend.graph_table(tables), torch.empty(0))

    def _capture(self, captured: _Captured, ids, pos, rows, step, matmul: MatmulPlan) -> None:
        model = self.model
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles the kernels at these shapes
            model(ids, pos, rows, step, matmul, upcast=False)
        torch.cuda.current_stream().wait_stream(stream)
        if self.threaded:
            # the step's NCCL collectives are captured too; NCCL's watchdog thread may still query
            # events of eager collectives (cudaEventQuery): let them finish first
            torch.cuda.synchronize()
        # captures are lazy, so they happen under load while other threads (the RAM tier's
        # copies, the disk writer's event syncs, NCCL's watchdog: pytorch/pytorch#104487) make CUDA calls on their own streams; a
        # global-mode capture forbids those in every thread and fails, so forbid only this one's
        captured.graph = torch.cuda.CUDAGraph()  # (a step staged before its graph was dropped)
        with torch.cuda.graph(captured.graph, pool=self.pool, capture_error_mode="thread_local"):
            captured.logits = model(ids, pos, rows, step, matmul, upcast=False)  # [R, V], compute dtype
        self.captures += 1
        log.info("captured a step graph for %d rows, %d logit rows", ids.shape[0], rows.shape[0])


def describe(key: tuple) -> str:
    """A graph key in words (logs, ``/health.scheduler.graph_misses``)."""
    rows, logits, launch, solo = key
    if isinstance(launch, MixedLaunch):
        tables = [
            f"{name} batch {t.batch} x {t.rows} rows, tiles {t.config.block_m}x{t.config.block_n}, "
            f"room for {t.config.splits} splits"
            for name, t in zip(("narrow", "wide"), launch, strict=True)
            if t is not None
        ]
        return f"mixed {rows} rows, {logits} logit rows: " + "; ".join(tables)
    return f"decode batch {rows}, splits {launch}{', solo' if solo else ''}"  # (launch: the split count)


def make_graphs(
    mode: str, model: torch.nn.Module, backend: AttentionBackend, threaded: bool, rowinv: bool = False
) -> StepGraphs | NoGraphs:
    """``--cuda-graphs auto|off``: captured steps where possible, else eager with the reason. Off
    on the fused route, steps are staged as for a capture and run eagerly (``StepGraphs.capture``)."""
    if model.device.type != "cuda":
        return NoGraphs(f"off: no CUDA ({model.device.type})")
    if not backend.captures_graphs:
        return NoGraphs(f"off: the attention route is not fused ({backend.verdict.verdict})")
    return StepGraphs(model, backend, threaded, capture=mode != "off", rowinv=rowinv)

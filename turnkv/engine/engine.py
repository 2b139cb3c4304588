"""The engine: the model, the KV layout and the attention backend, and one forward per step.

``Engine.run_step(windows)`` is the only way the model runs: a plan is built once for the step
(``step.plan_step``), the model runs every layer once over all rows of every window, and the
logits of the rows that asked for them come back. On CUDA a step (decode rows, prompt chunks,
verify windows, any mix up to 8192 rows) replays a captured graph when ``--cuda-graphs auto``
allows (``graphs.py``). Turns (``turn.py``) decide what goes into a step and what to do with its
logits; the scheduler (``scheduler.py``) decides which turns share a step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from turnkv.attention.verdict import Verdict
from turnkv.config import EngineConfig
from turnkv.engine.admission import Footprint
from turnkv.engine.context import TurnContext
from turnkv.engine.context_copy import Speculation
from turnkv.engine.cpu_threads import make_thread_policy
from turnkv.engine.graphs import GraphStep, make_graphs
from turnkv.engine.step import Staged, StepResult, Window, one_row_windows, plan_step, run_plan
from turnkv.kv import make_layout
from turnkv.kv.cache import KVCache, KVShape, Snapshot, kv_dtype
from turnkv.models.generation import resolve
from turnkv.models.load import LoadedModel, cache_fingerprint
from turnkv.models.matmul import rowinv_route


@dataclass(frozen=True)
class EngineInfo:
    """What the server reports about the engine (``/health``, ``/v1/models``, metrics)."""

    model_name: str
    fingerprint: str  # what cache keys (the disk tier's blocks) are derived from
    device: str
    dtype: str  # the compute dtype
    kv_dtype: str  # the KV rows' (kv.cache.kv_dtype)
    kv_layout: str
    max_context: int
    verdict: Verdict
    graphs: str  # "on", or why decode steps run eagerly
    weights: dict  # how the matrices are held: {"held", "note", "matmul"} (``/health.weights``)


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, speculation_off: str | None = None) -> None:
        """``speculation_off``: why ``--speculate auto`` drafts nothing here (``runtime.resolve``)."""
        from turnkv.attention.selfcheck import make_backend

        self.loaded = loaded
        self.cfg = cfg
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        if cfg.chat_template:  # --chat-template (runtime.chat_template checked it before the load)
            from turnkv.tokenizer import chat_template_text

            self.tokenizer = self.tokenizer.with_chat_template(chat_template_text(cfg.chat_template))
        # this rank's shard under tensor parallelism (its heads, its KV heads); else the model
        mc = self.model.cfg
        self.tp = self.model.tp  # turnkv.parallel.group.TensorParallel, or None in one process
        kv = kv_dtype(cfg.kv_dtype, loaded.dtype, loaded.device)
        self.shape = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv, loaded.device)
        self.layout = make_layout(cfg.kv_layout, self.shape)
        # --deterministic: whether every matmul row takes the row-invariant GEMM (models/matmul.py)
        self.rowinv, self.deterministic = rowinv_route(self.model.device, cfg.deterministic)
        t0 = time.perf_counter()
        self.backend = make_backend(
            cfg.attention,
            loaded.device,
            mc.head_dim,
            mc.num_heads,
            mc.num_kv_heads,
            loaded.dtype,
            deterministic=cfg.deterministic == "on",
        )
        self.selfcheck_s = time.perf_counter() - t0  # the startup line's "self-check"
        self.max_context = (
            min(cfg.max_context or mc.max_position, mc.max_position) if mc.max_position else cfg.max_context
        )
        self.prefill_chunk = max(1, cfg.prefill_chunk)
        # RoPE tables for every position a turn may reach, built once: steps (and graphs) only index
        self.model.rope.ensure(self.max_context or mc.max_position or 8192)
        self.graphs = make_graphs(cfg.cuda_graphs, self.model, self.backend, self.tp is not None, self.rowinv)
        self.speculation = Speculation(cfg.speculate, speculation_off, self.shape.device.type)
        # torch's CPU threads per step: chosen by timing decode steps with --threads 0 (cpu_threads.py)
        self.threads = make_thread_policy(loaded.device, cfg.threads, self.tp is not None)
        # what a turn gets where it sets no temperature, top_p, top_k or max_tokens (the same on
        # every rank: the same flags and model)
        self.sampling_defaults = resolve(cfg.sampling_flags(), loaded.sampling)
        self.info = EngineInfo(
            loaded.name,
            # weights, their matmul kernel, dtypes, geometry
            cache_fingerprint(loaded.fingerprint, self.shape, loaded.dtype, loaded.matmul),
            str(loaded.device),
            str(loaded.dtype).removeprefix("torch."),
            str(kv).removeprefix("torch."),
            cfg.kv_layout,
            self.max_context,
            self.backend.verdict,
            self.graphs.status,
            {"held": loaded.weights, "note": loaded.weights_note, "matmul": loaded.matmul or None},
        )

    def deterministic_health(self) -> dict:
        """/health's ``deterministic`` block: the mode and the routes its rows take."""
        fused = getattr(self.backend, "fixed", None)
        if fused is None:
            attention = f"{self.backend.verdict.verdict}: not the fused route"
        else:
            attention = (
                "fused, fixed tiles and 256-key pieces" if fused else "fused, splits by batch and keys"
            )
        matmul = (
            "triton_rowinv" if self.rowinv else ("cpu" if self.model.device.type == "cpu" else "cublas+gemv")
        )
        return {"mode": self.deterministic, "matmul": matmul, "attention": attention}

    # -- caches -------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        return self.layout.new()

    def restore(self, snapshot: Snapshot) -> KVCache:
        return self.layout.restore(snapshot)

    @property
    def footprint(self) -> Footprint:
        """What one prefill chunk's activations are made of (``admission.activation_bytes``)."""
        mc = self.model.cfg  # this rank's shard: its heads and MLP rows
        return Footprint(
            mc.hidden_size,
            mc.intermediate_size,
            self.shape.dtype.itemsize,
            self.loaded.config.vocab_size,
            self.prefill_chunk,
            scratch=partial(self.backend.scratch_bytes, mc.num_heads, mc.head_dim),
        )

    def turn_context(self) -> TurnContext:
        """What a turn may use of this engine (``engine.context``), as it stands now."""
        return TurnContext(
            self.max_context,
            self.loaded.config.vocab_size,
            self.sampling_defaults.values.max_tokens,
            self.prefill_chunk,
            self.shape.device,
            self.tokenizer,
            self.layout,
            self.footprint,
            self.speculation.for_turn,
            self.speculation.stats,
            self.verify_rows,
        )

    def counters(self) -> dict[str, int]:
        """``seals``, ``merges``, ``max_segments`` of the layout (``/health.segments``)."""
        return self.layout.counters()

    def prefill(self, cache: KVCache, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` to ``cache`` in steps of ``prefill_chunk`` rows (committed); the last
        row's fp32 logits ``[V]``. For benches and tests: turns prefill through the scheduler."""
        logits = None
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = list(tokens[start : start + self.prefill_chunk])
            last = start + len(chunk) == len(tokens)
            res = self.run_step([Window(cache, chunk, logits=1 if last else 0)])
            cache.commit(chunk)
            logits = res.logits[-1] if last else logits
        if logits is None:
            raise ValueError("prefill needs at least one token")
        return logits

    # -- one step -----------------------------------------------------------------------------
    def run_step(self, windows: Sequence[Window], prev: torch.Tensor | None = None) -> StepResult:
        """One forward over ``windows`` (each a different cache); the caller commits afterwards.
        ``prev`` (device ``[R']``): the argmax of the step in flight, whose rows give the windows
        with a ``feed`` their first token id (the scheduler's run-ahead; never copied to the host)."""
        return self.run_staged(self.stage(windows), prev)

    def stage(self, windows: Sequence[Window]) -> Staged:
        """The host work of a step that needs nothing from the step in flight: KV windows opened,
        inputs and tables built and uploaded (stream order). ``run_staged`` then launches it; the
        scheduler stages a step while the grammar masks of the step in flight are being filled.

        On the fused route a verify window runs as one-row windows (``step.one_row_windows``),
        which a decode graph replays. Alone in its step it is ``solo``: every row takes the one-row
        GEMV and the attention splits of one conversation, so each comes out bit for bit as that
        row decoded alone, and greedy text is the same with speculation on and off. Beside other
        conversations its rows go through cuBLAS's GEMM with theirs, as every batched row on CUDA
        does (cuBLAS picks its kernel by the row count)."""
        asked = list(windows)
        cut = one_row_windows(asked) if self.backend.cuts_verify_windows else None
        run, firsts = cut if cut is not None else (asked, None)
        solo = cut is not None and len(asked) == 1  # (a step holds one window per conversation)
        try:
            step = self.graphs.stage(run, solo)
            step = (
                step
                if step is not None
                else plan_step(run, self.backend, self.model.device, solo, self.rowinv)
            )
        except Exception as exc:
            self._down(exc)
            raise
        return Staged(step, asked, firsts)

    def run_staged(self, staged: Staged, prev: torch.Tensor | None = None) -> StepResult:
        """Launch the forward of ``staged`` (``prev``: as ``run_step``'s)."""
        step = staged.step
        try:
            if isinstance(step, GraphStep):
                result = self.graphs.replay(step, prev)
            else:
                self.threads.begin([len(w.tokens) for w in step.windows])
                t0 = time.perf_counter()
                result = StepResult(step, run_plan(self.model, step, prev))
                self.threads.end(time.perf_counter() - t0)  # on a CPU the forward is done here
        except Exception as exc:
            self._down(exc)
            raise
        if staged.firsts is None:
            return result
        plan, firsts = result.plan, staged.firsts  # of the one-row windows: per window asked for
        asked = replace(
            plan,
            windows=staged.windows,
            kv=[plan.kv[i] for i in firsts],
            logit_offsets=[plan.logit_offsets[i] for i in firsts],
            score_offsets=[plan.score_offsets[i] for i in firsts] if plan.score_offsets else [],
            window_labels=[plan.labels[i] for i in firsts],
        )
        return StepResult(asked, result.logits)

    def warm_step(self, windows: Sequence[Window]) -> None:
        """The warm-up's step: its graph captured and not replayed (only the graph is wanted, not
        the logits); a step no graph holds (graphs off, past their limits) runs eagerly instead,
        so its kernels compile all the same."""
        staged = self.stage(windows)
        if isinstance(staged.step, GraphStep):
            try:
                if self.graphs.prepare(staged.step):
                    return
            except Exception as exc:
                self._down(exc)
                raise
        self.run_staged(staged)

    def verify_rows(self, start: int) -> int:
        """The most rows a verify window whose first row is cache row ``start`` may have (the
        backend's ``verify_rows``: on the fused route within its first row's key bucket)."""
        return self.backend.verify_rows(start)

    def _down(self, exc: Exception) -> None:
        if self.tp is not None:  # the other ranks ran (or wait in) a step this rank did not finish
            self.tp.group.down(f"a step failed on rank {self.tp.rank}: {type(exc).__name__}: {exc}")

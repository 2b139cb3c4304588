"""The engine: the model, the KV layout and the attention backend, and one forward per step.

``Engine.run_step(windows)`` is the only way the model runs: a plan is built once for the step
(``step.plan_step``), the model runs every layer once over all rows of every window, and the
logits of the rows that asked for them come back. Decode-only steps on CUDA replay a captured
graph when ``--cuda-graphs auto`` allows (``graphs.py``). Turns (``turn.py``) decide what goes
into a step and what to do with its logits; the scheduler (``scheduler.py``) decides which turns
share a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turnkv.attention.route import Verdict
from turnkv.bank.session_bank import SessionBank, auto_budget_bytes
from turnkv.config import EngineConfig, parse_size
from turnkv.engine.context_copy import Speculation
from turnkv.engine.step import StepPlan, Window, forward
from turnkv.kv import make_layout
from turnkv.kv.cache import KVCache, KVShape, Snapshot
from turnkv.kv.segments import unique_bytes
from turnkv.models.load import LoadedModel


@dataclass(frozen=True)
class EngineInfo:
    """What the server reports about the engine (``/health``, ``/v1/models``, metrics)."""

    model_name: str
    fingerprint: str
    device: str
    dtype: str
    kv_layout: str
    max_context: int
    verdict: Verdict
    graphs: str  # "on", or why decode steps run eagerly


@dataclass
class StepResult:
    """The logits of one step, per window: ``logits[off_i : off_i + windows[i].logits]``."""

    plan: StepPlan
    logits: torch.Tensor  # [R, V] fp32, device

    def of(self, i: int) -> torch.Tensor:
        off = self.plan.logit_offsets[i]
        return self.logits[off : off + self.plan.windows[i].logits]


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig) -> None:
        from turnkv.attention.selfcheck import make_backend

        self.loaded = loaded
        self.cfg = cfg
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        mc = loaded.config
        self.shape = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, loaded.dtype, loaded.device)
        self.layout = make_layout(cfg.kv_layout, self.shape)
        self.backend = make_backend(
            cfg.attention, loaded.device, mc.head_dim, mc.num_heads, mc.num_kv_heads, loaded.dtype
        )
        self.max_context = (
            min(cfg.max_context or mc.max_position, mc.max_position) if mc.max_position else cfg.max_context
        )
        self.prefill_chunk = max(1, cfg.prefill_chunk)
        # RoPE tables for every position a turn may reach, built once: steps (and graphs) only index
        self.model.rope.ensure(self.max_context or mc.max_position or 8192)
        from turnkv.engine.graphs import make_graphs

        self.graphs = make_graphs(self, cfg.cuda_graphs)
        self.speculation = Speculation(cfg.speculate)  # context-copy drafts, step costs, counters
        self.info = EngineInfo(
            loaded.name,
            loaded.fingerprint,
            str(loaded.device),
            str(loaded.dtype).removeprefix("torch."),
            cfg.kv_layout,
            self.max_context,
            self.backend.verdict,
            self.graphs.status,
        )

    @classmethod
    def from_config(cls, cfg: EngineConfig, progress: bool = True) -> Engine:
        from turnkv.models.load import build_random_model, load_model

        if cfg.model.startswith("random:"):
            loaded = build_random_model(cfg.model.split(":", 1)[1], cfg.device, cfg.dtype)
        else:
            loaded = load_model(cfg.model, cfg.device, cfg.dtype, progress=progress)
        return cls(loaded, cfg)

    # -- caches -------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        return self.layout.new()

    def restore(self, snapshot: Snapshot) -> KVCache:
        return self.layout.restore(snapshot)

    def new_bank(self, budget: str | int | None = None) -> SessionBank:
        """A session bank of ``budget`` bytes (``auto``: see ``auto_budget_bytes``; default the
        ``--bank-bytes`` flag) for this engine's caches."""
        budget = self.cfg.bank_bytes if budget is None else budget
        size = auto_budget_bytes(self.shape.device) if budget == "auto" else parse_size(budget)
        return SessionBank(
            budget_bytes=size,
            bytes_per_row=self.shape.bytes_per_row,
            measure=lambda held: unique_bytes(*held),
            copy_on_restore=self.layout.copies_on_restore,
        )

    def activation_bytes(self, rows: int, history: int = 0) -> int:
        """Transient memory of one prefill chunk of ``rows`` rows over ``history`` cached rows.

        Counts the hidden states and MLP of the chunk and, for the portable route, the fp32 score
        and probability matrices of the largest segment (bounded by the whole history); the fused
        kernels keep scores in registers (flash) and need only their fp32 split partials.
        """
        mc = self.loaded.config
        rows = min(rows, self.prefill_chunk)
        item = self.shape.dtype.itemsize
        hidden = rows * (6 * mc.hidden_size + 3 * mc.intermediate_size) * item
        if self.backend.name == "fused":
            scores = mc.num_heads * rows * (mc.head_dim + 1) * 4 * 2  # a few partials per row
        else:
            scores = 2 * mc.num_heads * rows * (history + rows) * 4
        logits = mc.vocab_size * 4
        return hidden + scores + logits

    def counters(self) -> dict[str, int]:
        """``seals``, ``merges``, ``max_segments`` of the layout (``/health.segments``)."""
        return self.layout.counters()

    # -- one step -----------------------------------------------------------------------------
    def run_step(self, windows: Sequence[Window]) -> StepResult:
        """One forward over ``windows`` (each a different cache); the caller commits afterwards."""
        replay = self.graphs.run(windows)
        if replay is not None:
            return replay
        return StepResult(*forward(self.model, windows, self.backend))

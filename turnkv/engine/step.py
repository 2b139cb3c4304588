"""The per-step forward plan: the windows of several turns in one forward, built once per step.

A step is a list of ``Window`` s, one per conversation that has work now: a prefill chunk, a
one-row decode window or a verify window (any mix, ragged). ``plan_step`` opens each cache's KV
window, lays the rows out back to back and builds, once for the whole step:

- ``ids`` and ``positions`` ``[N]`` and ``logit_rows`` ``[R]`` as device tensors (one upload);
- the attention backend's plan (``StepAttention``: each window's route, and for the fused backend
  one segment table for all layers, one upload);
- the matmul plan (``MatmulPlan``: which rows take packed weights' wide path, whether each row
  rounds as alone).

Every linear layer then runs once over the ``N`` rows; each window attends over its own views.
A window asks for the logits of its last ``logits`` rows only (none for a prefill chunk that is
not the prompt's last, one for decode, all for a verify window), so the LM head runs on ``R``
rows, not ``N``. A prompt chunk of a turn that asks for the prompt's logprobs (``Window.scores``)
also asks for the logits of its first rows, which score the prompt's next tokens; those rows come
after every window's ``logits`` rows (``StepPlan.score_offsets``), so what chooses tokens is laid
out as in any other step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from turnkv.attention.backend import AttentionBackend, StepAttention
from turnkv.kv.cache import KVCache, KVWindow
from turnkv.models.matmul import PLAIN, MatmulPlan, plan_matmul

if TYPE_CHECKING:
    from turnkv.engine.graphs import GraphStep


@dataclass
class Window:
    """One conversation's rows in a step: ``tokens`` go to rows ``[n + ahead, n + ahead +
    len(tokens))`` of ``cache``; the logits of the last ``logits`` rows come back. The caller
    commits afterwards.

    ``ahead`` > 0: a window launched before the step in flight was committed (the scheduler's
    run-ahead): its rows follow ``ahead`` uncommitted rows that the step in flight writes first
    (same stream). ``feed``: the logit row of the step in flight whose argmax (on the device,
    ``Engine.run_step``'s ``prev``) is this window's first token id -- a decode row's, whose
    ``tokens`` are then a placeholder until that step completes.

    ``scores``: the prompt tokens that follow this window's first ``len(scores)`` rows (row ``j``
    scores ``scores[j]``): those rows' logits come back too, after every window's ``logits`` rows,
    for the prompt's logprobs (``engine.logprobs.prompt_logprobs``). Never more rows than those
    not asking ``logits``: the prompt's last row starts the answer."""

    cache: KVCache
    tokens: Sequence[int]
    logits: int = 1
    ahead: int = 0
    feed: int | None = None
    scores: Sequence[int] = ()

    def __post_init__(self) -> None:
        if not self.tokens or not 0 <= self.logits <= len(self.tokens):
            raise ValueError(f"a window of {len(self.tokens)} rows asking for {self.logits} logits")
        if len(self.scores) + self.logits > len(self.tokens):
            raise ValueError(f"a window of {len(self.tokens)} rows scoring {len(self.scores)} of them")

    @property
    def verifies(self) -> bool:
        """A verify window: several rows, each asking for its logits."""
        return len(self.tokens) > 1 and self.logits == len(self.tokens)


@dataclass
class StepPlan:
    """What one forward needs, built once: device inputs, KV windows, the attention and matmul plans."""

    windows: list[Window]
    kv: list[KVWindow]
    ids: torch.Tensor  # [N] int64, device
    positions: torch.Tensor  # [N] int64, device
    logit_rows: torch.Tensor  # [R] int64, device
    logit_offsets: list[int]  # window i's logits are rows [off_i, off_i + windows[i].logits) of R
    attention: StepAttention
    matmul: MatmulPlan = PLAIN
    feeds: torch.Tensor | None = None  # [2F] int64, device: ``carry``'s dst | src (None: no feed)
    window_labels: list[str] | None = None  # per window, where ``attention`` ran other windows
    # window i's scoring rows (``Window.scores``) are rows [s_i, s_i + len(scores)) of R, after
    # every window's ``logits`` rows (empty: no window scores)
    score_offsets: list[int] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def labels(self) -> list[str]:
        """Per window, the route label of its attention calls (one per layer) this step."""
        if self.window_labels is not None:
            return self.window_labels
        return [r.label for r in self.attention.routes]


@dataclass
class Staged:
    """A step built and uploaded, not launched (``Engine.stage``)."""

    step: StepPlan | GraphStep  # what runs
    windows: list[Window]  # the windows asked for
    firsts: list[int] | None = None  # each one's first one-row window in ``step`` (None: the same)


@dataclass
class StepResult:
    """The logits of one step, per window: ``logits[off_i : off_i + windows[i].logits]``."""

    plan: StepPlan
    logits: torch.Tensor  # [R, V] fp32, device; the caller's own, never rewritten by a later step

    def of(self, i: int) -> torch.Tensor:
        off = self.plan.logit_offsets[i]
        return self.logits[off : off + self.plan.windows[i].logits]


def one_row_windows(windows: Sequence[Window]) -> tuple[list[Window], list[int]] | None:
    """``windows`` with each verify window (several rows, each asking for its logits) cut into
    one-row windows in order (row ``i`` after ``i`` rows of its own: ``ahead``), and each window's
    first index in that list; None when no window verifies. Each row then attends over exactly
    the keys, and in the splits, that it would decoded alone (``fused.conversations``), and a
    decode graph replays the step (``Engine.stage``)."""
    if not any(w.verifies for w in windows):
        return None
    rows: list[Window] = []
    firsts: list[int] = []
    for w in windows:
        firsts.append(len(rows))
        if w.verifies:
            rows += [
                Window(w.cache, [t], 1, ahead=w.ahead + i, feed=w.feed if i == 0 else None)
                for i, t in enumerate(w.tokens)
            ]
        else:
            rows.append(w)
    return rows, firsts


def open_kv(w: Window) -> KVWindow:
    """The KV rows of ``w`` (``KVCache.open_window``; past its ``ahead`` rows in flight)."""
    if not w.ahead:
        return w.cache.open_window(len(w.tokens))
    kv = w.cache.open_window(w.ahead + len(w.tokens))  # the rows in flight are in the views
    return KVWindow(kv.views, kv.start + w.ahead, len(w.tokens))


def host_inputs(
    windows: Sequence[Window], kv: Sequence[KVWindow]
) -> tuple[list[int], int, list[int], list[int]]:
    """The step's ``ids + positions + logit_rows + feeds`` as one list, ``N``, the logit offsets
    and the scoring rows' offsets (``StepPlan.score_offsets``; empty when no window scores);
    ``feeds`` is ``dst + src`` (``carry``) for the windows with a ``feed``."""
    if all(len(w.tokens) == 1 == w.logits for w in windows):  # a decode step: one row each
        b = len(windows)
        dst = [i for i, w in enumerate(windows) if w.feed is not None]
        src = [windows[i].feed for i in dst]
        words = [w.tokens[0] for w in windows] + [k.start for k in kv] + list(range(b)) + dst + src
        return words, b, list(range(b)), []
    ids: list[int] = []
    pos: list[int] = []
    rows: list[int] = []
    offsets: list[int] = []
    dst, src = [], []
    n = 0
    for w, k in zip(windows, kv, strict=True):
        m = len(w.tokens)
        if w.feed is not None:
            dst.append(n)
            src.append(w.feed)
        ids += w.tokens
        pos += range(k.start, k.start + m)
        offsets.append(len(rows))
        rows += range(n + m - w.logits, n + m)
        n += m
    scored: list[int] = []
    if any(w.scores for w in windows):
        n0 = 0
        for w in windows:
            scored.append(len(rows))
            rows += range(n0, n0 + len(w.scores))
            n0 += len(w.tokens)
    return ids + pos + rows + dst + src, n, offsets, scored


def carry(ids: torch.Tensor, prev: torch.Tensor | None, feeds: torch.Tensor) -> None:
    """Write the token ids that the step in flight chooses into this step's ``ids`` ``[N]``:
    ``ids[dst[i]] = prev[src[i]]``, ``feeds`` = ``dst | src`` (device int64); all on the
    device, in stream order after that step's argmax (never through the host)."""
    f = feeds.shape[0] // 2
    if f:
        if prev is None:
            raise ValueError("a window fed by the step in flight, but no step in flight given")
        ids.index_copy_(0, feeds[:f], prev.index_select(0, feeds[f:]))


def plan_step(
    windows: Sequence[Window],
    backend: AttentionBackend,
    device: torch.device,
    solo: bool = False,
    rowinv: bool = False,
) -> StepPlan:
    """Open every window's KV rows and build the step's inputs and attention plan (see module doc):
    everything but the fed ids, which ``run_plan`` writes from the step in flight's argmax, so a
    plan can be built (and uploaded, in stream order) before that argmax is launched."""
    windows = list(windows)
    kv = [open_kv(w) for w in windows]
    words, n, offsets, scored = host_inputs(windows, kv)
    r = sum(w.logits + len(w.scores) for w in windows)
    host = torch.tensor(words, dtype=torch.int64, pin_memory=device.type == "cuda")
    dev = host.to(device, non_blocking=True)
    attention = backend.plan(kv)
    matmul = plan_matmul([len(w.tokens) for w in windows], solo, rowinv)  # rowinv: --deterministic
    ids, pos, rows, feeds = dev[:n], dev[n : 2 * n], dev[2 * n : 2 * n + r], dev[2 * n + r :]
    return StepPlan(windows, kv, ids, pos, rows, offsets, attention, matmul, feeds, score_offsets=scored)


def run_plan(model, plan: StepPlan, prev: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``model`` (a ``LlamaModel``) over ``plan``: fp32 logits ``[R, V]``. ``prev`` (device
    ``[R']``): the argmax of the step in flight, which fed windows read (``carry``)."""
    if plan.feeds is not None:
        carry(plan.ids, prev, plan.feeds)
    model.rope.ensure(max(k.start + k.rows for k in plan.kv))  # a no-op once the engine sized it
    return model(plan.ids, plan.positions, plan.logit_rows, plan.attention, plan.matmul)


def forward(model, windows: Sequence[Window], backend: AttentionBackend) -> tuple[StepPlan, torch.Tensor]:
    """Plan and run one step of ``model`` without an engine (the model tests): the plan and fp32
    logits ``[R, V]``. No window may have a ``feed``: there is no step in flight."""
    plan = plan_step(windows, backend, model.device)
    return plan, run_plan(model, plan)

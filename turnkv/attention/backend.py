"""Attention backends: a *plan* built once per step, then a *run* per layer (store, attend).

The model never sees caches. Each step the engine opens one ``KVWindow`` per conversation and hands
the list to ``backend.plan(windows)``; the returned ``StepAttention`` is what every layer calls:

    att = backend.plan(windows)           # once per step: host work, one upload at most
    for layer in layers:
        q = att.rope_store(layer, qk, v, cos, sin)  # RoPE on q and k; k, v -> each window's rows
        o = att.attend(layer, q, scale)   # q [N, Hq, D] -> [N, Hq, D], window-causal per sequence

Rows are flat: window ``b`` owns rows ``[q_start_b, q_start_b + rows_b)`` of ``N``, in the order
of ``windows``. ``att.labels`` names the route each window took (``fused_q1``, ``lse_prefill``...),
so a turn counts its own routes.

Invariants: nothing a layer calls touches the host beyond launching work (the fused backend's
plan is one table upload for all layers); a backend never reads or writes a row outside the
windows it was planned for.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Protocol

import torch

from turnkv.attention import cpu_native
from turnkv.attention.lse import CPU_FLASH_MIN_ROWS, concat_segments, lse_attention
from turnkv.attention.rope import apply_rope
from turnkv.attention.route import Verdict, single_attention, window_label
from turnkv.kv.cache import KVWindow


class StepAttention(Protocol):
    """One step's attention, planned for its windows; called once per layer."""

    labels: list[str]

    def rope_store(
        self, layer: int, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """RoPE on ``qk`` ``[N, Hq + Hkv, D]`` (q heads, then k heads; any row stride) at the rows'
        ``cos``, signed ``sin`` ``[N, D]``; stores k and ``v`` ``[N, Hkv, D]`` into every window of
        ``layer``; returns q ``[N, Hq, D]`` after RoPE."""
        ...

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new rows ``k``, ``v`` ``[N, Hkv, D]`` into every window of ``layer``."""
        ...

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[N, Hq, D]`` over each window's views of ``layer`` -> ``[N, Hq, D]`` in q's dtype."""
        ...


class AttentionBackend(Protocol):
    """Chosen once at load (``selfcheck.make_backend``); ``verdict`` is what ``/health`` reports."""

    name: str
    verdict: Verdict

    def plan(self, windows: Sequence[KVWindow]) -> StepAttention: ...


def row_starts(windows: Sequence[KVWindow]) -> list[int]:
    """The first flat row of each window (windows back to back)."""
    out, n = [], 0
    for w in windows:
        out.append(n)
        n += w.rows
    return out


class PortableStep:
    """Per-window loops over torch ops: ``single_attention`` for one view, ``lse_attention`` else."""

    def __init__(self, windows: Sequence[KVWindow]) -> None:
        self.windows = list(windows)
        self.starts = row_starts(self.windows)
        self.labels = [window_label("single" if len(w.views) == 1 else "lse", w.rows) for w in self.windows]
        self._rope: tuple = (None, None, None)  # (cos, cos[:, None], sin[:, None]) of this step
        # CPU decode and verify windows are many tiny matmuls: each runs on one thread, and the
        # windows are split over the cores (``_cpu_pool``). Measured with OpenMP waiting passively
        # (every parallel region woke sleeping threads) on the 2-core VM: 8 windows x 4 views x
        # 30 layers of 256-row matmuls took 171 ms per step on 2 OpenMP threads, 51 ms on one, and
        # 31 ms as two halves on two Python threads. Prefill windows (torch's flash
        # kernel) keep torch's threads.
        self.threads = 1
        if (
            self.windows
            and self.windows[0].views[0][0].device.type == "cpu"
            and max(w.rows for w in self.windows) < CPU_FLASH_MIN_ROWS
        ):
            self.threads = torch.get_num_threads()
        # CPU decode and verify windows go to ``lse.concat_segments`` straight away: where
        # ``single_attention`` and ``lse_attention`` would hand them (fewer rows than their flash
        # kernel takes; past the first chunk or over several views; the window's first row at
        # ``start``). Their checks are Python on every layer (2-core VM, one decode row over 100
        # keys, one thread: ``attend`` 39.5 -> 36.3 us, 34.2 with concat_segments' checks hoisted).
        self.concat = [_concat_route(w) for w in self.windows]
        # Every CPU window in C (``cpu_native``), prefill chunks too: one call per layer for all
        # of them, each view read as stored, and a row's bits those of the same row decoded
        # alone, so a prefix restored from the bank or the disk answers as recomputed. Where no
        # compiler is found: ``lse.concat_segments`` and, for prefill, torch's flash kernel.
        self.native: cpu_native.NativeStep | None = None
        self.others = list(range(len(self.windows)))  # the windows left to torch ops
        picked = [i for i, w in enumerate(self.windows) if _native_route(w)]
        if picked and cpu_native.library() is not None:
            self.native = cpu_native.NativeStep(
                [
                    (self.starts[i], self.windows[i].views, self.windows[i].start, self.windows[i].rows)
                    for i in picked
                ],
                threads=torch.get_num_threads(),
            )
            taken = set(picked)
            self.others = [i for i in range(len(self.windows)) if i not in taken]

    def rope_store(self, layer, qk, v, cos, sin) -> torch.Tensor:
        hq = qk.shape[1] - v.shape[1]
        if self._rope[0] is not cos:  # the step's tables as [N, 1, D], viewed once for all layers
            self._rope = (cos, cos[:, None], sin[:, None])
        qk = apply_rope(qk, self._rope[1], self._rope[2])  # q and k heads in one pass
        q, k = qk.split_with_sizes((hq, v.shape[1]), 1)
        self.store(layer, k, v)
        return q

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # the C kernel's windows in one call (2-core VM, 8 conversations: 16 copies a layer, ~2.5 ms
        # a step); the others as torch copies
        if self.native is not None and self.native.store(layer, k, v):
            rest = self.others
        elif len(self.windows) == 1:  # (no slices: each is a dispatch, ~1 us on a CPU)
            self.windows[0].write(layer, k.transpose(0, 1), v.transpose(0, 1))
            return
        else:
            rest = range(len(self.windows))
        for i in rest:
            s, w = self.starts[i], self.windows[i]
            w.write(layer, k[s : s + w.rows].transpose(0, 1), v[s : s + w.rows].transpose(0, 1))

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        if self.native is None:
            return self._attend_torch(layer, q, scale)
        out = torch.empty(q.shape, dtype=torch.float32)  # [N, Hq, D]
        q32 = q if q.dtype == torch.float32 and q.stride(-1) == 1 else q.float().contiguous()
        self.native.attend(layer, q32, out, scale)
        for i in self.others:  # windows over views the kernel cannot read (float16)
            s, w = self.starts[i], self.windows[i]
            out[s : s + w.rows] = self._attend(layer, q, scale, [s], [w], [self.concat[i]])
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _attend_torch(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        # one window keeps torch's threads: with OpenMP spinning briefly (turnkv/threads.py) its
        # matmuls over a long history gain from them (2-core VM, one view of 2048 keys: 209 us a
        # layer on one thread, 158 on two; 38 and 40 us over 64 keys)
        if self.threads <= 1 or len(self.windows) == 1:
            return self._attend(layer, q, scale, self.starts, self.windows, self.concat)
        parts = min(self.threads, len(self.windows))
        cut = [len(self.windows) * i // parts for i in range(parts + 1)]
        torch.set_num_threads(1)
        try:
            pool = _cpu_pool(self.threads - 1)
            jobs = [pool.submit(self._attend_job, layer, q, scale, a, b) for a, b in pairwise(cut[1:])]
            a = cut[1]
            first = self._attend(layer, q, scale, self.starts[:a], self.windows[:a], self.concat[:a])
            outs = [first, *(j.result() for j in jobs)]
        finally:
            torch.set_num_threads(self.threads)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_job(self, layer, q, scale, a, b) -> torch.Tensor:
        with torch.inference_mode():  # the engine thread's mode is thread-local
            return self._attend(layer, q, scale, self.starts[a:b], self.windows[a:b], self.concat[a:b])

    @staticmethod
    def _attend(
        layer: int,
        q: torch.Tensor,
        scale: float,
        starts: Sequence[int],
        windows: Sequence[KVWindow],
        concat: Sequence[bool] | None = None,
    ) -> torch.Tensor:
        """``windows`` (their first rows ``starts`` in ``q``) -> their rows ``[m, Hq, D]`` back to
        back; ``concat``: which go to ``concat_segments`` directly (default ``_concat_route``)."""
        outs = []
        for i, (s, w) in enumerate(zip(starts, windows, strict=True)):
            qs = (q if w.rows == q.shape[0] else q[s : s + w.rows]).transpose(0, 1)  # [Hq, m, D], a view
            views = w.layer_views(layer)
            if concat[i] if concat is not None else _concat_route(w):
                o = concat_segments(qs, views, scale, w.start)
                o = o if o.dtype == qs.dtype else o.to(qs.dtype)
            elif len(views) == 1:
                o = single_attention(qs, views[0][0], views[0][1], scale)
            else:
                o = lse_attention(qs, views, scale)
            outs.append(o.transpose(0, 1))  # [m, Hq, D]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _native_route(w: KVWindow) -> bool:
    """Whether window ``w`` takes the C kernel: a CPU window of any rows (prefill chunks too, so
    a row's bits never depend on the window it came in) over views the kernel reads (fp32 or
    bf16, head dim a multiple of 16)."""
    k = w.views[0][0]
    return all(cpu_native.supports(kk) and kk.dtype == k.dtype and vv.dtype == k.dtype for kk, vv in w.views)


def _concat_route(w: KVWindow) -> bool:
    """Whether ``single_attention`` / ``lse_attention`` would hand window ``w`` to
    ``concat_segments`` (see ``PortableStep.concat``)."""
    return (
        w.views[0][0].device.type == "cpu"
        and w.rows < CPU_FLASH_MIN_ROWS
        and (len(w.views) > 1 or w.start > 0)
    )


_POOL: ThreadPoolExecutor | None = None


def _cpu_pool(workers: int) -> ThreadPoolExecutor:
    """Threads that run slices of a step's CPU decode windows beside the engine thread (torch
    releases the GIL inside its ops). One pool per process, grown to the largest ``workers``."""
    global _POOL
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix="turnkv-attend")
    return _POOL


class PortableBackend:
    """The portable route on any torch device (``single`` / ``lse``)."""

    name = "portable"

    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict

    def plan(self, windows: Sequence[KVWindow]) -> PortableStep:
        return PortableStep(windows)

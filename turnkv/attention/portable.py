"""The portable backend: per-window torch ops, and on a CPU the C kernel, on any torch device.

``plan`` gives each window its route once (``portable_route``); ``attend`` then runs the C
kernel's windows in one call per layer (``cpu_native``) and the others window by window through
the function their route names (``attend_window``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import torch

from turnkv.attention import cpu_native
from turnkv.attention.backend import DecodeLaunch, row_starts
from turnkv.attention.lse import concat_segments, lse_attention
from turnkv.attention.rope import apply_rope
from turnkv.attention.routes import Path, Route, narrow
from turnkv.attention.sdpa import single_attention
from turnkv.attention.verdict import Verdict
from turnkv.kv.cache import KVWindow, Views
from turnkv.limits import MAX_WINDOW_ROWS


def portable_route(w: KVWindow, dtype: torch.dtype, native: bool) -> Route:
    """The route of window ``w`` when q is ``dtype``; ``native``: the C kernel is built and reads
    ``w``'s views (``_native_views``).

    Every CPU window goes to the C kernel where it can: prefill chunks too, so a row's bits never
    depend on the window it came in. Else a first chunk and any one-view window off a CPU take
    SDPA (``single``); a CPU's decode and verify windows take ``concat`` (CPU SDPA parallelises
    tiny problems over OpenMP threads, slower than the two matmuls), and so do several views off
    a CPU; a CPU's fp32 prefill chunk past its first takes torch's flash kernel per view (``lse``:
    faster than SDPA with an explicit mask). Figures: docs/BENCHMARKS.md, 'Figures moved out of
    code comments'. One segment and the contiguous layout take the same route, so they stay
    bit-identical."""
    name = "single" if len(w.views) == 1 else "lse"
    cpu = w.views[0][0].device.type == "cpu"
    if native:
        path = Path.NATIVE
    elif len(w.views) == 1 and (w.start == 0 or not cpu):
        path = Path.SINGLE
    elif not cpu or narrow(w.rows):
        path = Path.CONCAT
    elif dtype == torch.float32:
        path = Path.LSE
    else:  # a CPU's bf16 / fp16 prefill chunk past its first
        path = Path.SINGLE if len(w.views) == 1 else Path.CONCAT
    return Route(path, name, w.rows)


def _native_views(w: KVWindow) -> bool:
    """Whether the C kernel reads window ``w``'s views (fp32 or bf16, one dtype, head dim a
    multiple of 16; a CPU's)."""
    k = w.views[0][0]
    return all(cpu_native.supports(kk) and kk.dtype == k.dtype and vv.dtype == k.dtype for kk, vv in w.views)


def attend_window(route: Route, q: torch.Tensor, views: Views, scale: float, start: int) -> torch.Tensor:
    """q ``[Hq, M, D]`` of a window whose first row is ``start`` over one layer's ``views``, by
    the torch path of ``route`` -> ``[Hq, M, D]`` in q's dtype."""
    if route.path is Path.CONCAT:
        o = concat_segments(q, views, scale, start)
        return o if o.dtype == q.dtype else o.to(q.dtype)
    if route.path is Path.SINGLE:
        return single_attention(q, views[0][0], views[0][1], scale, start)
    if route.path is Path.LSE:  # (taken only by a CPU's fp32 prefill windows: torch's flash kernel)
        return lse_attention(q, views, scale, start, flash=True)
    raise ValueError(f"no torch path for the route {route.path.value}")


class PortableStep:
    """One step's windows over torch ops and the C kernel, by their routes (``portable_route``)."""

    def __init__(self, windows: Sequence[KVWindow], dtype: torch.dtype) -> None:
        self.windows = list(windows)
        self.starts = row_starts(self.windows)
        readable = [_native_views(w) for w in self.windows]
        built = any(readable) and cpu_native.library() is not None  # (no build for a GPU's steps)
        self.routes = [
            portable_route(w, dtype, ok and built) for w, ok in zip(self.windows, readable, strict=True)
        ]
        self._rope: tuple = (None, None, None)  # (cos, cos[:, None], sin[:, None]) of this step
        # CPU decode and verify windows are many tiny matmuls: each runs on one thread, and the
        # windows are split over the cores (``_cpu_pool``): with OpenMP waiting passively every
        # parallel region woke sleeping threads (docs/BENCHMARKS.md, 'Figures moved out of code
        # comments'). Prefill windows (torch's flash kernel) keep torch's threads.
        self.threads = 1
        cpu = self.windows and self.windows[0].views[0][0].device.type == "cpu"
        if cpu and all(narrow(w.rows) for w in self.windows):
            self.threads = torch.get_num_threads()
        # Every ``native`` window in one C call per layer, prefill chunks too: each view read as
        # stored, and a row's bits those of the same row decoded alone, so a prefix restored from
        # the bank or the disk answers as recomputed.
        self.native: cpu_native.NativeStep | None = None
        picked = [i for i, r in enumerate(self.routes) if r.path is Path.NATIVE]
        self.others = [i for i, r in enumerate(self.routes) if r.path is not Path.NATIVE]  # torch ops
        if picked:
            self.native = cpu_native.NativeStep(
                [
                    (self.starts[i], self.windows[i].views, self.windows[i].start, self.windows[i].rows)
                    for i in picked
                ],
                threads=torch.get_num_threads(),
            )

    def native_only(self) -> cpu_native.NativeStep | None:
        """The C attention's plan when it takes every window of the step (``cpu_decoder`` then
        runs the layers in one C call), else None."""
        return None if self.others else self.native

    def rope_store(self, layer, qk, v, cos, sin) -> torch.Tensor:
        hq = qk.shape[1] - v.shape[1]
        if self._rope[0] is not cos:  # the step's tables as [N, 1, D], viewed once for all layers
            self._rope = (cos, cos[:, None], sin[:, None])
        qk = apply_rope(qk, self._rope[1], self._rope[2])  # q and k heads in one pass
        q, k = qk.split_with_sizes((hq, v.shape[1]), 1)
        self.store(layer, k, v)
        return q

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # the C kernel's windows in one call, not two torch copies per window and layer; the others
        # as torch copies
        if self.native is not None and self.native.store(layer, k, v):
            rest = self.others
        elif len(self.windows) == 1:  # (no slices: each is a dispatch)
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
            out[s : s + w.rows] = self._attend(layer, q, scale, [s], [w], [self.routes[i]])
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _attend_torch(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        # one window keeps torch's threads: with OpenMP spinning briefly (turnkv/threads.py) its
        # matmuls over a long history gain from them (docs/BENCHMARKS.md, 'Figures moved out of
        # code comments')
        if self.threads <= 1 or len(self.windows) == 1:
            return self._attend(layer, q, scale, self.starts, self.windows, self.routes)
        parts = min(self.threads, len(self.windows))
        cut = [len(self.windows) * i // parts for i in range(parts + 1)]
        torch.set_num_threads(1)
        try:
            pool = _cpu_pool(self.threads - 1)
            jobs = [pool.submit(self._attend_job, layer, q, scale, a, b) for a, b in pairwise(cut[1:])]
            a = cut[1]
            first = self._attend(layer, q, scale, self.starts[:a], self.windows[:a], self.routes[:a])
            outs = [first, *(j.result() for j in jobs)]
        finally:
            torch.set_num_threads(self.threads)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_job(self, layer, q, scale, a, b) -> torch.Tensor:
        with torch.inference_mode():  # the engine thread's mode is thread-local
            return self._attend(layer, q, scale, self.starts[a:b], self.windows[a:b], self.routes[a:b])

    @staticmethod
    def _attend(
        layer: int,
        q: torch.Tensor,
        scale: float,
        starts: Sequence[int],
        windows: Sequence[KVWindow],
        routes: Sequence[Route],
    ) -> torch.Tensor:
        """``windows`` (their first rows ``starts`` in ``q``, their torch ``routes``) -> their
        rows ``[m, Hq, D]`` back to back."""
        outs = []
        for s, w, r in zip(starts, windows, routes, strict=True):
            qs = (q if w.rows == q.shape[0] else q[s : s + w.rows]).transpose(0, 1)  # [Hq, m, D], a view
            outs.append(attend_window(r, qs, w.layer_views(layer), scale, w.start).transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


_POOL: ThreadPoolExecutor | None = None


def _cpu_pool(workers: int) -> ThreadPoolExecutor:
    """Threads that run slices of a step's CPU decode windows beside the engine thread (torch
    releases the GIL inside its ops). One pool per process, grown to the largest ``workers``."""
    global _POOL
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix="turnkv-attend")
    return _POOL


class PortableBackend:
    """The portable routes on any torch device; ``dtype``: the model's compute dtype (q's), which
    a CPU prefill chunk's route depends on (``portable_route``)."""

    name = "portable"
    cuts_verify_windows = False  # a verify window attends as one window (``Engine.stage``)
    captures_graphs = False

    def __init__(self, verdict: Verdict, dtype: torch.dtype) -> None:
        self.verdict = verdict
        self.dtype = dtype

    def plan(
        self, windows: Sequence[KVWindow], launch: object = None, out: torch.Tensor | None = None
    ) -> PortableStep:
        if launch is not None or out is not None:
            raise ValueError("the portable backend captures no graphs")
        return PortableStep(windows, self.dtype)

    def verify_rows(self, start: int) -> int:
        return MAX_WINDOW_ROWS

    def scratch_bytes(self, heads: int, head_dim: int, rows: int, history: int) -> int:
        # the fp32 score and probability matrices of the largest segment (bounded by the history)
        return 2 * heads * rows * (history + rows) * 4

    def decode_launch(self, windows: Sequence[KVWindow]) -> DecodeLaunch | None:
        return None

    def mixed_launch(self, windows: Sequence[KVWindow]) -> None:
        return None

    def graph_table(self, batch: int) -> torch.Tensor:
        raise ValueError("the portable backend captures no graphs")

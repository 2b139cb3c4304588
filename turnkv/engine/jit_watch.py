"""What compiles and captures after the server said ready (``turnkv_jit_after_ready_total``).

Triton compiles (or loads from its disk cache: a first use in this process, which stalls the step
all the same and may not run inside a CUDA-graph capture) are seen through Triton's
``knobs.runtime.jit_post_compile_hook``; graph captures through the engine's own counters
(``graphs.captures``). ``WATCH`` is process-wide because Triton's hook is: ``install`` it once per
process (the composition root does), ``mark_ready`` when warm-up ends. A compile while a capture
is under way is counted apart (``in_capture``) and logged: it breaks the capture. Each compile
after ready is logged with its kernel, constexprs and specialization (``late``: what the warm-up
missed, by kind and key); steps whose graph the warm-up did not capture run eagerly once the
graphs are sealed (``graphs.StepGraphs.seal``) and are listed apart (``graph_misses``): they
capture nothing, so they are not counted here.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


def graph_misses(engine) -> dict:
    """Steps run eagerly after the warm-up because their graph was not captured, and their keys."""
    from turnkv.engine.graphs import describe

    graphs = getattr(engine, "graphs", None)
    missed = sorted(getattr(graphs, "missed", ()), key=repr)
    return {"steps": int(getattr(graphs, "misses", 0)), "keys": [describe(k) for k in missed[:16]]}


def graph_captures(engine) -> int:
    """CUDA graphs captured so far by ``engine``'s steps (``StepGraphs`` owns decode and mixed
    steps alike)."""
    graphs = getattr(engine, "graphs", None)  # StepGraphs: decode and mixed steps alike
    return 0 if graphs is None else int(getattr(graphs, "captures", 0))


@dataclass
class JitWatch:
    status: str = "off: not installed"  # "on", or why compiles are not seen
    compiles: int = 0  # every Triton kernel variant first used in this process
    in_capture: int = 0  # of which while a CUDA graph was being captured
    ready_compiles: int | None = None  # ``compiles`` when ``mark_ready`` ran (None: not ready)
    ready_captures: int = 0
    late: list[str] = field(default_factory=list)  # the first kernels compiled after ready, and their keys
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def install(self) -> str:
        """Chain a hook after Triton's ``jit_post_compile_hook`` (idempotent)."""
        if self.status == "on":
            return self.status
        try:
            from triton import knobs
        except Exception as exc:  # no Triton (CPU wheels), or one older than knobs (3.4)
            self.status = f"off: no triton.knobs ({type(exc).__name__})"
            return self.status
        before = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kw):
            self._seen(_describe(kw))
            return before(*args, **kw) if before is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        self.status = "on"
        return self.status

    def _seen(self, name: str) -> None:
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        with self._lock:
            self.compiles += 1
            self.in_capture += capturing
            after = self.ready_compiles is not None
            if after and len(self.late) < 32:
                self.late.append(name)
        if capturing:
            log.error("Triton compiled %s inside a CUDA-graph capture (the capture will fail)", name)
        elif after:
            log.warning("Triton compiled %s after ready (a step waited for it)", name)

    def mark_ready(self, engine) -> None:
        with self._lock:
            self.ready_compiles = self.compiles
            self.ready_captures = graph_captures(engine)

    def after_ready(self, engine) -> int:
        """Compiles plus graph captures since ``mark_ready`` (0 before it)."""
        if self.ready_compiles is None:
            return 0
        return self.compiles - self.ready_compiles + graph_captures(engine) - self.ready_captures


def _describe(kw: dict) -> str:
    """One compile in words: the kernel with its launch options and argument types, then its
    constexprs and the arguments Triton specialized (divisible by 16, equal to 1): what a
    warm-up must reproduce to have compiled the same variant."""
    text = str(kw.get("repr") or kw.get("key") or "?")
    compiled = kw.get("compile")
    if isinstance(compiled, dict):
        text += f" constexprs {compiled.get('constants')} attrs {compiled.get('configs')}"
    return text[:700]


WATCH = JitWatch()

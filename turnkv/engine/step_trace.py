"""A per-step timeline for profiling under load: ``TURNKV_STEP_TRACE=FILE`` appends one JSON line
per completed step (``bench/step_trace.py`` summarizes the file).

Host times are ``time.perf_counter()`` seconds: ``launch`` .. ``launched`` (stage and launch, the
forward enqueued or run), ``sync`` .. ``synced`` (waiting for the step's tokens), ``done`` (every
turn has taken its tokens). On CUDA two timing events bracket the step on its stream, so
``device_ms`` is the step's own GPU time and ``idle_ms`` the time the GPU sat idle between the
previous traced step's end and this step's start: what the host failed to keep queued. Off
(the default) it costs one attribute test per step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import IO

import torch


@dataclass
class Marks:
    """One step's marks, filled as it goes (``Pipeline``)."""

    launch: float
    start: torch.cuda.Event | None  # recorded before the step's first kernel (CUDA)
    replays: int = 0  # the graphs' replay count at launch
    graph: bool = False  # whether the step replayed a graph (set once launched)
    launched: float = 0.0
    end: torch.cuda.Event | None = None  # recorded after the copy of its tokens
    sync: float = 0.0
    synced: float = 0.0


class StepTrace:
    def __init__(self, path: str, cuda: bool) -> None:
        # line-buffered: a server stopped by a signal loses no step; open for the process's life
        self._out: IO[str] = open(path, "a", buffering=1)
        self._cuda = cuda
        self._pid = os.getpid()
        self._prev_end: torch.cuda.Event | None = None

    def begin(self, replays: int) -> Marks:
        start = None
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        return Marks(time.perf_counter(), start, replays)

    def end_event(self) -> torch.cuda.Event | None:
        """The event that ends the step (recorded by the caller after its last copy)."""
        return torch.cuda.Event(enable_timing=True) if self._cuda else None

    def write(self, m: Marks, rows: int, windows: int, prompt_rows: int) -> None:
        """After the step's tokens are taken (its events have completed). ``prompt_rows``: the
        rows of windows that skip some logits (prompt chunks; a one-row last chunk is not told
        apart from a decode row)."""
        rec = {
            "pid": self._pid,
            "trace": id(self),  # one per pipeline: the warm-up's steps are apart from the served ones
            "launch": m.launch,
            "launched": m.launched,
            "sync": m.sync,
            "synced": m.synced,
            "done": time.perf_counter(),
            "rows": rows,
            "windows": windows,
            "prompt_rows": prompt_rows,
            "graph": m.graph,
        }
        if m.start is not None and m.end is not None:
            rec["device_ms"] = round(m.start.elapsed_time(m.end), 4)
            if self._prev_end is not None:
                rec["idle_ms"] = round(max(0.0, self._prev_end.elapsed_time(m.start)), 4)
            self._prev_end = m.end
        self._out.write(json.dumps(rec) + "\n")


def from_env(cuda: bool) -> StepTrace | None:
    path = os.environ.get("TURNKV_STEP_TRACE", "")
    return StepTrace(path, cuda) if path else None

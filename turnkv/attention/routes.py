"""Route records: how each window of a step attends, decided once per step by its backend.

The backend is chosen once at load (``selfcheck.make_backend``); its ``plan`` then gives every
window of a step one ``Route``, which the step's kernels dispatch on and nothing after re-decides:

- ``fused`` backend (CUDA, verdict ``ok``): ``fused_narrow`` for decode and verify windows (one
  launch with flash-decoding splits), ``fused_wide`` for prefill chunks (a second launch in row
  blocks); one view or many, so no call pays a per-length plan (``fused.py``).
- portable backend (any device; ``portable.portable_route`` owns the choice): ``native`` (every
  CPU window whose views the C kernel reads, ``cpu_native``), ``concat`` (``lse.concat_segments``:
  every view's scores side by side, one softmax), ``single`` (torch SDPA on one view,
  ``sdpa.single_attention``) and ``lse`` (per-view partials from torch's CPU flash kernel merged by
  their log-sum-exp, ``lse.lse_attention``).

A window of at most ``MAX_WINDOW_ROWS`` rows is narrow (decode, verify), a wider one a prefill
chunk (``narrow``): the one threshold every route, label and kernel choice reads.

``Route.label`` is what a turn counts and ``/health`` reports: ``<name>_q<rows>`` for a narrow
window, ``<name>_prefill`` else, where ``name`` is ``fused`` on the fused backend and, on the
portable one, ``single`` for a window over one view and ``lse`` for several, whichever path runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from turnkv.limits import MAX_WINDOW_ROWS


class Path(Enum):
    """The kernel a window's attention runs through (see the module docstring)."""

    FUSED_NARROW = "fused_narrow"
    FUSED_WIDE = "fused_wide"
    NATIVE = "native"
    CONCAT = "concat"
    SINGLE = "single"
    LSE = "lse"


@dataclass(frozen=True)
class Route:
    """One window's route in one step: its ``path`` and the ``name`` its label counts under."""

    path: Path
    name: str  # "fused" | "single" | "lse"
    rows: int

    @property
    def label(self) -> str:
        return f"{self.name}_q{self.rows}" if narrow(self.rows) else f"{self.name}_prefill"


def narrow(rows: int) -> bool:
    """Whether a window of ``rows`` rows is a decode or verify window (else a prefill chunk)."""
    return rows <= MAX_WINDOW_ROWS

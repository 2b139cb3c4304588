"""The load-time support decision for the fused route, as ``/health.attention`` reports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Verdict:
    """The load-time support decision reported on ``/health.attention`` (``selfcheck.decide``).

    ``verdict`` is ``ok`` or a reason code (``no_cuda``, ``triton_missing``,
    ``head_dim_96_unsupported``, ``selfcheck_failed``, ``forced_lse``); ``route`` is the multi-segment
    route that follows from it (``fused`` only when ``verdict == "ok"``).
    """

    route: str = "lse"
    verdict: str = "no_cuda"
    reason: str = "the fused kernel needs a CUDA device"
    selfcheck: dict | None = None

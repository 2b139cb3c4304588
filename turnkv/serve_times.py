"""How long routing takes in this process, for ``/health.router`` of the replicas' front.

A module of its own because Ray Serve pickles the request router's module *by value*
(``RequestRouterConfig`` registers it with ``cloudpickle.register_pickle_by_value``): a deque
defined in ``serve_router`` would be a copy in the front's process, never the one its health
reads. The router reaches this module by name (modules are pickled by reference), so both write
to one place.
"""

from __future__ import annotations

from collections import deque

ROUTE_OF: deque[float] = deque(maxlen=4096)  # seconds per request computing its route (the front)
DECISIONS: deque[float] = deque(maxlen=4096)  # seconds per routing decision (the router)


def summary() -> dict:
    """p50/p99 in ms of the front's route computation (``route_of``) and of the router's
    decisions (``AffinityRouter.choose_replicas``); None before the first."""

    def pick(xs, q):
        xs = sorted(xs)
        return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None

    return {
        "requests": len(ROUTE_OF),
        "route_p50_ms": pick(ROUTE_OF, 0.5),
        "route_p99_ms": pick(ROUTE_OF, 0.99),
        "decisions": len(DECISIONS),
        "decide_p50_ms": pick(DECISIONS, 0.5),
        "decide_p99_ms": pick(DECISIONS, 0.99),
    }

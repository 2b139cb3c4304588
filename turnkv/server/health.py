"""``GET /health``: the JSON document of docs/DESIGN.md, built from the engine, the bank and the config.

Every key is always present (the list: docs/SERVER.md, 'Routes'); ``ram`` and ``disk`` are zeros
without their tier (``ram.reason`` says why it is off), and while a tensor-parallel rank is down ``status`` is ``unavailable``. Under tensor
parallelism the ``bank`` bytes are rank 0's: every rank holds the same rows' ``1/size`` share of
the KV heads.
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING

from turnkv.attention import cpu_native
from turnkv.bank.session_bank import SessionBank
from turnkv.bank.tiers import tier_health

if TYPE_CHECKING:
    from turnkv.engine.engine import Engine


def health(engine: Engine, bank: SessionBank, scheduler: dict) -> dict:
    """The /health document; ``scheduler`` is the scheduler's latest ``snapshot``."""
    info = engine.info
    verdict = info.verdict
    counters = engine.counters()
    selfcheck = verdict.selfcheck
    if is_dataclass(selfcheck) and not isinstance(selfcheck, type):
        selfcheck = asdict(selfcheck)
    s = bank.stats
    doc = {
        "status": "ok",
        "model": info.model_name,
        "device": info.device,
        "kv_dtype": info.kv_dtype,
        "kv_layout": info.kv_layout,
        "weights": info.weights,
        "attention": {
            "route": verdict.route,
            "verdict": verdict.verdict,
            "reason": verdict.reason,
            "selfcheck": selfcheck,
            # CPU decode windows: "ok" (the C kernel) or why they run as torch ops; None off a CPU
            "cpu_kernel": cpu_native.status() if str(info.device).startswith("cpu") else None,
        },
        "segments": {
            "seals": int(counters.get("seals", 0)),
            "merges": int(counters.get("merges", 0)),
            "max_segments": int(counters.get("max_segments", 0)),
            "route_counts": dict(scheduler.get("route_counts", {})),
        },
        "bank": {
            "entries": len(bank),
            "unique_bytes": bank.unique_bytes(live=False),
            "budget_bytes": bank.budget_bytes,
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "refusals": s.refusals,
        },
        **tier_health(bank.tier),  # "ram" and "disk"
        "speculation": engine.speculation.stats.health(),
        "deterministic": engine.deterministic_health(),  # --deterministic: the mode, its routes
        "scheduler": {k: v for k, v in scheduler.items() if k != "route_counts"},
        "tensor_parallel": _tensor_parallel(engine),
        "sampling_defaults": engine.sampling_defaults.doc(),
    }
    if doc["tensor_parallel"]["status"] != "ok":
        doc["status"] = "unavailable"  # new turns are refused (503)
    return doc


def _tensor_parallel(engine: Engine) -> dict:
    tp = getattr(engine, "tp", None)
    if tp is None:
        return {"size": 1, "status": "ok", "dead_ranks": [], "error": None}
    return tp.group.health.doc()


def server_health(srv) -> dict:
    """The ``/health`` document of a running ``Server``: the one builder that the route and the
    dashboard share, so their counts always match."""
    return health(srv.engine, srv.bank, {**srv.worker.scheduler.snapshot, **warm_doc(srv)})


def warm_doc(srv) -> dict:
    """``/health.scheduler``'s ``warm`` (the warm-up ran and marked the process ready),
    ``jit_after_ready`` (Triton compiles and graph captures since: 0 when warm-up covered every
    step), ``jit_late`` (what those were: kernel and key), ``graph_misses`` (steps run eagerly
    because the warm-up did not capture their graph, and the keys) and ``warmup`` (what it did:
    ``engine.warmup.WarmReport``)."""
    from turnkv.engine.jit_watch import WATCH, graph_misses

    report = getattr(srv, "warm_report", None)  # None: no warm-up ran (tests build apps directly)
    return {
        "warm": report is not None,
        "jit_after_ready": WATCH.after_ready(srv.engine) if report is not None else 0,
        "jit_status": WATCH.status,
        "jit_late": list(WATCH.late),
        "graph_misses": graph_misses(srv.engine),
        "warmup": report.doc() if report is not None else None,
    }

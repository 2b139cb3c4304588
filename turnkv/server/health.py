"""``GET /health``: the JSON document of docs/DESIGN.md, built from the engine, the bank and the config.

Keys (all always present): ``status``, ``model``, ``device``, ``kv_layout``, ``attention``
(``route``, ``verdict``, ``reason``, ``selfcheck``), ``segments`` (``seals``, ``merges``,
``max_segments``, ``route_counts``), ``bank`` (``entries``, ``unique_bytes``, ``budget_bytes``,
``hits``, ``misses``, ``evictions``, ``refusals``), ``disk`` (the disk tier is not built yet:
``enabled: false`` and zeros), ``speculation`` (zeros until speculation lands).
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass

from turnkv.bank.session_bank import SessionBank

DISK_KEYS = ("blocks", "bytes", "writes", "hits", "misses", "corrupt", "evictions")
SPECULATION_KEYS = ("drafted", "accepted", "windows")


def health(engine, bank: SessionBank, kv_layout: str, queue: dict | None = None) -> dict:
    """The /health document. ``queue`` (optional) adds the worker's ``busy``/``waiting``."""
    verdict = engine.router.verdict
    counters = engine.counters()
    selfcheck = verdict.selfcheck
    if is_dataclass(selfcheck) and not isinstance(selfcheck, type):
        selfcheck = asdict(selfcheck)
    s = bank.stats
    doc = {
        "status": "ok",
        "model": engine.model_name,
        "device": str(engine.shape.device),
        "kv_layout": kv_layout,
        "attention": {
            "route": verdict.route,
            "verdict": verdict.verdict,
            "reason": verdict.reason,
            "selfcheck": selfcheck,
        },
        "segments": {
            "seals": int(counters.get("seals", 0)),
            "merges": int(counters.get("merges", 0)),
            "max_segments": int(counters.get("max_segments", 0)),
            "route_counts": dict(counters.get("route_counts", {})),
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
        "disk": {"enabled": False, **dict.fromkeys(DISK_KEYS, 0)},
        "speculation": dict.fromkeys(SPECULATION_KEYS, 0),
    }
    if queue is not None:
        doc["queue"] = queue
    return doc

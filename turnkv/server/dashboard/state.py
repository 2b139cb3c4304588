"""``GET /dashboard/state``: one JSON document with everything the page draws.

Its keys, all always present, are listed in docs/SERVER.md ('Dashboard'). ``health`` is exactly
the ``/health`` document (built by the same function, ``server_health``), so every count on the
page is ``/health``'s; ``memory``, ``conversations`` and ``requests`` add what ``/health`` lacks
(``bankview``), ``history`` the last minutes (``history``), ``features`` the one classification
the page colours from (``features``). No token ids, no text, no session ids, no raw namespaces.
"""

from __future__ import annotations

import time

from turnkv.server.dashboard.bankview import LiveClock, bank_view
from turnkv.server.dashboard.features import features
from turnkv.server.dashboard.history import History, Sample, take_sample
from turnkv.server.health import server_health

SCHEMA = 1


class Dashboard:
    """The state behind the dashboard's routes for one ``Server`` (engine, bank, worker, metrics)."""

    def __init__(self, srv) -> None:
        self.srv = srv
        self.clock = LiveClock()
        self.started = time.time()
        self.history = History(lambda: self._read()[2])

    def _read(self) -> tuple[dict, dict, Sample]:
        """The /health document, the bank view, and a sample of both, read together."""
        bank = self.srv.bank
        doc = server_health(self.srv)
        view = bank_view(bank, self.clock)
        sample = take_sample(self.srv, doc, bank.unique_bytes(live=True), view["memory"]["logical_bytes"])
        view["memory"]["live_bytes"] = sample.live_bytes
        return doc, view, sample

    def state(self) -> dict:
        doc, view, sample = self._read()
        self.history.offer(sample)
        running, waiting = doc["scheduler"]["running"], doc["scheduler"]["waiting"]
        return {
            "schema": SCHEMA,
            "time": round(sample.t, 3),
            "uptime_s": round(sample.t - self.started, 1),
            "health": doc,
            "memory": view["memory"],
            "conversations": view["conversations"],
            "conversations_total": view["conversations_total"],
            "requests": {
                "running": running,
                "waiting": waiting,
                "live": view["live"],
                "live_rows_per_s": round(sum(t["rows_per_s"] for t in view["live"]), 1),
                "generated_tokens": sample.generated_tokens,
                "prefilled_tokens": sample.prefilled_tokens,
                "answers": sample.ttft_count,
                **self.history.rates(sample),
            },
            "history": self.history.series(),
            "features": [f.doc() for f in features(doc)],
        }

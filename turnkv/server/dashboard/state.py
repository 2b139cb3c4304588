"""``GET /dashboard/state``: one JSON document with everything the page draws.

Keys (all always present):

- ``schema`` (1), ``time`` (unix seconds), ``uptime_s``;
- ``health``: exactly the ``/health`` document (built by the same function, ``server_health``), so
  the bank, attention, segment, disk, speculation, queue and -- once the scheduler reports it --
  ``scheduler`` figures on the page are ``/health``'s;
- ``memory``: what ``/health`` lacks -- ``live_bytes`` (unique bytes of live turns beyond the bank,
  as ``/metrics``' ``turnkv_kv_live_bytes``), ``logical_bytes`` (what private copies would cost),
  ``bytes_per_row``, ``segments``, ``shared_segments``, ``shared_bytes``;
- ``conversations`` (the ``MAX_CONVERSATIONS`` most recently used; ``conversations_total`` counts
  all): ``id``, ``ns_hash``, ``rows``, ``own_bytes``, ``in_use``, ``protected``, ``segments`` (each
  ``id``, ``rows``, ``segment_rows``, ``bytes``, ``shared``);
- ``requests``: ``running`` and ``waiting`` (``/health.scheduler``'s), ``live`` turns (``ns_hash``, ``rows``, ``restored_rows``, ``priced_bytes``,
  ``age_s``, ``rows_per_s``) and ``live_rows_per_s`` (their sum), ``generated_tokens`` / ``prefilled_tokens`` / ``answers`` (finished turns, as ``/metrics``
  counts them), ``tokens_per_s``, ``prefill_tokens_per_s``, ``ttft_s`` (last minute), ``ttft_mean_s``;
- ``history``: the last five minutes, one column per series (see ``History.series``);
- ``features``: every on/off field of ``health`` classified (``key``, ``label``, ``tone``, ``text``,
  ``why``; see ``features``), so the page colours them from one decision.

No token ids, no text, no session ids, no raw namespaces (see ``bankview``).
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

"""``GET /metrics``: Prometheus text from one ``CollectorRegistry`` per app (tests start many apps).

Event metrics (requests, latencies, prefix-cache tokens) are recorded as turns finish; state
metrics (bank and live bytes, evictions, refusals, route counts) are read from the bank and the
engine at scrape time, so they can never drift from ``/health``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from turnkv.bank.breaks import REASONS
from turnkv.bank.session_bank import SessionBank
from turnkv.bank.tiers import tier_health

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _families(kind, rows):
    """One unlabelled ``kind`` family (counter or gauge) per ``(name, value, doc)``."""
    for name, value, doc in rows:
        f = kind(name, doc)
        f.add_metric([], value)
        yield f


def _counters(*rows: tuple[str, int, str]):
    return _families(CounterMetricFamily, rows)


def _gauges(*rows: tuple[str, int, str]):
    return _families(GaugeMetricFamily, rows)


class _StateCollector(Collector):
    def __init__(self, bank: SessionBank, scheduler: Callable[[], dict]) -> None:
        self.bank = bank
        self.scheduler = scheduler

    def collect(self):
        bank = self.bank
        banked = bank.unique_bytes(live=False)
        total = bank.unique_bytes(live=True)
        yield from _gauges(
            ("turnkv_kv_banked_bytes", banked, "Unique KV bytes held by the session bank"),
            (
                "turnkv_kv_live_bytes",
                max(total - banked, 0),
                "Unique KV bytes held by live requests beyond what the bank holds",
            ),
            ("turnkv_kv_budget_bytes", bank.budget_bytes, "Byte budget of the session bank"),
            ("turnkv_bank_entries", len(bank), "Snapshots in the session bank"),
        )
        s = bank.stats
        yield from _counters(
            ("turnkv_bank_evictions", s.evictions, "Bank entries evicted to make room"),
            ("turnkv_kv_refusals", s.refusals, "Turns refused with HTTP 507"),
            ("turnkv_bank_hits", s.hits, "Admitted turns that restored a banked prefix"),
            ("turnkv_bank_misses", s.misses, "Admitted turns that found no banked prefix"),
        )
        breaks = CounterMetricFamily(
            "turnkv_cache_breaks",
            "Admitted turns by why their reused prefix ended where it did (usage.cache_break.reason)",
            labels=["reason"],
        )
        for reason in REASONS:
            breaks.add_metric([reason], s.breaks.get(reason, 0))
        yield breaks
        yield from _tier_metrics(bank)
        c = CounterMetricFamily(
            "turnkv_attention_calls", "Attention calls by route and window", labels=["route"]
        )
        for label, n in sorted(self.scheduler().get("route_counts", {}).items()):
            c.add_metric([label], n)
        yield c


_DISK_GAUGES = {"blocks": "Blocks in the KV disk tier", "bytes": "Bytes of the KV disk tier's files"}
_DISK_COUNTERS = {
    "writes": "Blocks written to the KV disk tier",
    "write_failures": "Block writes that failed (disk full, I/O error)",
    "dropped_writes": "Blocks not written because the write queue was full",
    "hits": "Admitted turns extended with rows loaded from disk",
    "misses": "Admitted turns the disk tier could not extend",
    "corrupt": "Blocks whose bytes failed verification (checksum, truncated, foreign), removed",
    "vanished": "Blocks deleted between a restore's lookup and its read: a miss, not corrupt",
    "evictions": "Blocks evicted for the disk budget",
    "dedupe_hits": "Blocks not written because the disk tier already held them",
    "faults": "KV disk tier store calls that raised (a damaged index, I/O): each a miss or a dropped write",
}


_RAM_GAUGES = {
    "blocks": "Blocks in the host-RAM KV tier",
    "bytes": "Bytes of the host-RAM KV tier's blocks",
    "budget_bytes": "Byte budget of the host-RAM KV tier (0: off)",
}
_RAM_COUNTERS = {
    "hits": "Admitted turns extended with rows restored from host RAM",
    "misses": "Admitted turns host RAM could not extend",
    "hit_tokens": "Rows restored from host RAM",
    "evictions": "Blocks evicted for the host-RAM budget",
    "dedupe_hits": "Blocks not copied because host RAM already held them",
    "dropped": "Blocks host RAM had no free slot for (every slot pinned, copying or awaiting the disk)",
}


def _tier_metrics(bank: SessionBank):
    """``turnkv_disk_*`` and ``turnkv_ram_*``: the numbers of ``/health.disk`` and ``/health.ram``
    (zeros without the tier)."""
    tiers = tier_health(bank.tier)
    for name, gauges, counters in (
        ("disk", _DISK_GAUGES, _DISK_COUNTERS),
        ("ram", _RAM_GAUGES, _RAM_COUNTERS),
    ):
        h = tiers[name]
        yield from _gauges(*((f"turnkv_{name}_{k}", h[k], doc) for k, doc in gauges.items()))
        yield from _counters(*((f"turnkv_{name}_{k}", h[k], doc) for k, doc in counters.items()))


class _SpeculationCollector(Collector):
    """Context-copy speculation counters, read from the engine at scrape time (as ``/health``)."""

    def __init__(self, stats) -> None:
        self.stats = stats  # turnkv.engine.context_copy.SpeculationStats

    def collect(self):
        s = self.stats
        yield from _counters(
            ("turnkv_speculation_drafted_tokens", s.drafted, "Drafted tokens verified"),
            ("turnkv_speculation_accepted_tokens", s.accepted, "Drafted tokens the model accepted"),
            ("turnkv_speculation_windows", s.windows, "Decode windows that carried a draft"),
            ("turnkv_decode_forwards", s.forwards, "Decode windows (one row or a verify window)"),
            ("turnkv_decode_tokens", s.tokens, "Tokens those decode windows emitted"),
            ("turnkv_speculation_dropped_windows", s.dropped, "Windows run ahead after a rejected draft"),
        )
        drafted = CounterMetricFamily(
            "turnkv_speculation_window_drafted_tokens",
            "Drafted tokens by verify window rows",
            labels=["rows"],
        )
        accepted = CounterMetricFamily(
            "turnkv_speculation_window_accepted_tokens",
            "Accepted tokens by verify window rows",
            labels=["rows"],
        )
        for bucket, (_, d, a) in s.by_window.items():
            drafted.add_metric([f"<={bucket}"], d)
            accepted.add_metric([f"<={bucket}"], a)
        yield drafted
        yield accepted


class _WarmCollector(Collector):
    """Compiles and captures after ready (``engine.jit_watch``), read at scrape time."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        from turnkv.engine.jit_watch import WATCH

        yield from _counters(
            (
                "turnkv_jit_after_ready",
                WATCH.after_ready(self.engine),
                "Triton compiles and CUDA-graph captures after /health said ok (0 when warm-up covered them)",
            ),
            ("turnkv_jit_in_capture", WATCH.in_capture, "Triton compiles inside a CUDA-graph capture"),
        )


class Metrics:
    """The registry of one app and the event metrics the routes record."""

    def __init__(self, engine, bank: SessionBank, scheduler: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "turnkv_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.prefix_hit_tokens = Counter(
            "turnkv_prefix_cache_hit_tokens", "Prompt tokens served from the bank", registry=r
        )
        self.prefix_query_tokens = Counter(
            "turnkv_prefix_cache_query_tokens", "Prompt tokens of admitted turns", registry=r
        )
        self.prefilled_tokens = Counter("turnkv_prefilled_tokens", "Prompt rows computed", registry=r)
        self.generated_tokens = Counter("turnkv_generated_tokens", "Completion tokens", registry=r)
        self.ttft = Histogram(
            "turnkv_time_to_first_token_seconds",
            "Time from the start of the turn to the first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "turnkv_time_per_output_token_seconds",
            "Decode time per output token after the first",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "turnkv_queue_time_seconds",
            "Time a turn waited for admission (KV memory or a running slot)",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "turnkv_inter_token_latency_seconds",
            "Time between consecutive answer tokens of a turn",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.batch = Histogram(
            "turnkv_step_windows", "Conversations per step (batch size)", buckets=_BATCH_BUCKETS, registry=r
        )
        self.step_rows = Histogram(
            "turnkv_step_tokens", "Token rows computed per step", buckets=_ROW_BUCKETS, registry=r
        )
        r.register(_StateCollector(bank, scheduler))
        r.register(_SpeculationCollector(engine.speculation.stats))
        r.register(_WarmCollector(engine))

    def turn(self, stats) -> None:
        """Record one finished turn's ``TurnStats``."""
        self.prefix_hit_tokens.inc(stats.cached_tokens)
        self.prefix_query_tokens.inc(stats.prompt_tokens)
        self.prefilled_tokens.inc(stats.prefilled_tokens)
        self.generated_tokens.inc(stats.completion_tokens)
        if stats.completion_tokens:
            self.ttft.observe(stats.ttft_s)
        if stats.completion_tokens > 1 and stats.decode_s > 0:
            self.tpot.observe(stats.decode_s / (stats.completion_tokens - 1))
        self.queue.observe(stats.queue_s)
        for gap in stats.token_gaps_s:
            self.itl.observe(gap)

    def step(self, windows: int, rows: int, seconds: float) -> None:
        """Record one scheduler step (called on the engine thread)."""
        self.batch.observe(windows)
        self.step_rows.observe(rows)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

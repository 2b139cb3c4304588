"""The dashboard's state without a model: the bank's contents as segments, the history ring's
arithmetic, and ``/health.scheduler`` taking over the queue figures when a server reports it.

The bank is real (segments, snapshots, leases); only the engine and the worker are stand-ins for
what ``/health`` reads from them.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from turnkv.attention.route import Verdict
from turnkv.bank.session_bank import SessionBank
from turnkv.engine.context_copy import Speculation
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef, unique_bytes
from turnkv.server.dashboard import bankview, state
from turnkv.server.dashboard.bankview import LiveClock, bank_view, ns_hash
from turnkv.server.dashboard.history import History, Sample
from turnkv.server.metrics import Metrics

SHAPE = KVShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
ROW = SHAPE.bytes_per_row


def seg(first_token: int, rows: int) -> Segment:
    k = torch.zeros(SHAPE.num_layers, SHAPE.num_kv_heads, rows, SHAPE.head_dim)  # [L, Hkv, T, D]
    return Segment(k, k.clone(), tuple(range(first_token, first_token + rows)))


def snap(*refs: tuple[Segment, int]) -> SegmentedSnapshot:
    return SegmentedSnapshot(SegmentRef(s, n) for s, n in refs)


def new_bank() -> SessionBank:
    return SessionBank(1 << 30, ROW, lambda held: unique_bytes(*held))


@pytest.fixture
def banked():
    """A: [s1, s2]; B: the first 6 rows of s1, then s3 (a fork after a shared prompt); C: [s4] in
    another namespace."""
    s1, s2, s3, s4 = seg(0, 10), seg(100, 5), seg(200, 4), seg(300, 7)
    bank = new_bank()
    a = bank.insert("public", snap((s1, 10), (s2, 5)))
    b = bank.insert("public", snap((s1, 6), (s3, 4)))
    c = bank.insert("key:abc", snap((s4, 7)))
    return bank, (a, b, c), (s1, s2, s3, s4)


def test_conversations_are_lists_of_segments_with_sharing_marked(banked):
    bank, (a, b, c), (s1, s2, s3, s4) = banked
    v = bank_view(bank, LiveClock(), now=0.0)
    convs = {x["id"]: x for x in v["conversations"]}
    assert [x["id"] for x in v["conversations"]] == [c, b, a]  # most recently used first
    assert [(g["id"], g["rows"], g["segment_rows"], g["shared"]) for g in convs[a]["segments"]] == [
        (s1.id, 10, 10, True),
        (s2.id, 5, 5, False),
    ]
    assert [(g["id"], g["rows"], g["shared"]) for g in convs[b]["segments"]] == [
        (s1.id, 6, True),
        (s3.id, 4, False),
    ]
    assert convs[a]["rows"] == 15 and convs[b]["rows"] == 10 and convs[c]["rows"] == 7
    assert convs[a]["own_bytes"] == s2.nbytes and convs[b]["own_bytes"] == s3.nbytes
    assert convs[c]["own_bytes"] == s4.nbytes
    assert convs[a]["ns_hash"] == hashlib.sha256(b"public").hexdigest()[:8] != convs[c]["ns_hash"]
    m = v["memory"]
    assert m["logical_bytes"] == (15 + 10 + 7) * ROW
    assert m["segments"] == 4 and m["shared_segments"] == 1 and m["shared_bytes"] == s1.nbytes
    assert sum(x.nbytes for x in (s1, s2, s3, s4)) == bank.unique_bytes(live=False)
    assert v["conversations_total"] == 3 and v["live"] == []


def test_a_live_turn_shares_what_it_restored_and_shows_its_progress(banked):
    bank, (_, _, c), (*_, s4) = banked
    clock = LiveClock()
    lease = bank.admit("key:abc", [*range(300, 307), 999], reserve_rows=4)
    assert lease.cached == 7 and lease.entry_id == c
    v = bank_view(bank, clock, now=10.0)
    (conv_c,) = [x for x in v["conversations"] if x["id"] == c]
    assert conv_c["segments"][0]["id"] == s4.id
    assert conv_c["segments"][0]["shared"] and conv_c["own_bytes"] == 0
    assert conv_c["in_use"] and conv_c["protected"]
    turn = {"ns_hash": ns_hash("key:abc"), "restored_rows": 7, "priced_bytes": 5 * ROW}
    assert v["live"] == [{**turn, "rows": 7, "age_s": 0.0, "rows_per_s": 0.0}]
    lease.attach(SimpleNamespace(num_tokens=12))  # the worker's cache, 5 rows further on
    v = bank_view(bank, clock, now=12.5)
    assert v["live"] == [{**turn, "rows": 12, "age_s": 2.5, "rows_per_s": 2.0}]
    lease.live = None  # the stand-in holds no KV for finish() to measure
    bank.finish(lease, None)
    v = bank_view(bank, clock, now=13.0)
    assert v["live"] == [] and clock.first_seen == {}
    (conv_c,) = [x for x in v["conversations"] if x["id"] == c]
    assert not conv_c["segments"][0]["shared"] and not conv_c["in_use"]


def test_only_the_most_recent_conversations_are_listed(monkeypatch):
    monkeypatch.setattr(bankview, "MAX_CONVERSATIONS", 3)
    bank = new_bank()
    ids = [bank.insert("public", snap((seg(1000 * i, 2), 2))) for i in range(5)]
    v = bank_view(bank, LiveClock())
    assert [x["id"] for x in v["conversations"]] == ids[::-1][:3]
    assert v["conversations_total"] == 5
    assert v["memory"]["logical_bytes"] == 5 * 2 * ROW  # every entry counts, listed or not


def _sample(t: float, **kw) -> Sample:
    zero = dict.fromkeys(
        ("banked_bytes", "live_bytes", "logical_bytes", "entries", "hits", "misses", "evictions", "refusals"),
        0,
    )
    base = {**zero, "generated_tokens": 0, "prefilled_tokens": 0, "ttft_sum_s": 0.0, "ttft_count": 0}
    return Sample(t=t, **{**base, **kw})


def test_history_series_and_rates():
    h = History(sample=None, interval_s=1.0, window_s=5)
    for i, (gen, hits, ttft_sum, ttft_n) in enumerate(
        [(0, 0, 0, 0), (10, 1, 0.5, 1), (10, 1, 0.5, 1), (40, 3, 1.5, 3)]
    ):
        h.offer(
            _sample(1000.0 + 2 * i, generated_tokens=gen, hits=hits, ttft_sum_s=ttft_sum, ttft_count=ttft_n)
        )
    h.offer(_sample(1006.5))  # too soon after the last: not kept
    s = h.series()
    assert s["t"] == [1000.0, 1002.0, 1004.0, 1006.0]
    assert s["generated_tok_s"] == [0.0, 5.0, 0.0, 15.0]
    assert s["hits"] == [0, 1, 0, 2]
    r = h.rates(h.ring[-1])
    assert r["tokens_per_s"] == pytest.approx(30 / 4)  # the samples within the last 5 s: t=1002..1006
    assert r["ttft_mean_s"] == 0.5 and r["ttft_s"] == 0.5
    for i in range(10):  # the ring keeps window_s / interval_s samples
        h.offer(_sample(2000.0 + i))
    assert len(h.ring) == 5 and h.ring[0].t == 2005.0
    assert History(sample=None).rates(_sample(1.0))["ttft_s"] is None


class _Srv:
    """What the dashboard reads of a ``Server``: a real bank and metrics, stand-in engine and worker."""

    def __init__(self) -> None:
        self.bank = new_bank()
        info = SimpleNamespace(
            model_name="m",
            device="cpu",
            kv_dtype="bfloat16",
            kv_layout="segmented",
            verdict=Verdict(),
            weights={"held": "dequant", "note": "--weights dequant", "matmul": None},
        )
        self.engine = SimpleNamespace(
            info=info,
            counters=lambda: {"seals": 0, "merges": 0, "max_segments": 0},
            speculation=Speculation(),
        )
        sched = {"running": 5, "waiting": 2, "step_ms": 12.5, "rows_per_step": 40, "route_counts": {}}
        self.worker = SimpleNamespace(scheduler=SimpleNamespace(snapshot=sched))
        self.metrics = Metrics(self.engine, self.bank, lambda: sched)


def test_state_takes_running_and_waiting_from_the_scheduler():
    srv = _Srv()
    dash = state.Dashboard(srv)
    s = dash.state()
    assert (s["requests"]["running"], s["requests"]["waiting"]) == (5, 2)
    assert s["requests"]["live"] == [] and s["requests"]["live_rows_per_s"] == 0
    assert s["health"]["scheduler"]["step_ms"] == 12.5  # shown as /health has it
    srv.metrics.generated_tokens.inc(7)
    assert dash.state()["requests"]["generated_tokens"] == 7

"""The dashboard's state without a model: the bank's contents as segments, the history ring's
arithmetic, ``/health.scheduler`` taking over the queue figures when a server reports it, and the
status fields classified in one place (``features``): what is normal on this device is never
shown as a warning.

The bank is real (segments, snapshots, leases); only the engine and the worker are stand-ins for
what ``/health`` reads from them.
"""

from __future__ import annotations

import copy
import hashlib
from types import SimpleNamespace

import pytest
import torch

from turnkv.attention.verdict import Verdict
from turnkv.bank.records import Reservation
from turnkv.bank.session_bank import SessionBank
from turnkv.engine.context_copy import Speculation
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import Segment, SegmentedSnapshot, SegmentRef, unique_bytes
from turnkv.models.generation import SamplingDefaults, resolve
from turnkv.server.dashboard import bankview, state
from turnkv.server.dashboard.bankview import LiveClock, bank_view, ns_hash
from turnkv.server.dashboard.features import features
from turnkv.server.dashboard.history import History, Sample
from turnkv.server.health import server_health
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
    lease = bank.admit("key:abc", [*range(300, 307), 999], Reservation(4))
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
            sampling_defaults=resolve(SamplingDefaults(), SamplingDefaults()),
            deterministic_health=lambda: {"mode": "off", "matmul": "cpu", "attention": "portable"},
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


def test_state_classifies_the_health_fields_it_shows():
    s = state.Dashboard(_Srv()).state()
    assert s["features"] == [f.doc() for f in features(s["health"])]
    by_key = {f["key"]: f for f in s["features"]}
    assert set(by_key) == {
        "server",
        "attention",
        "selfcheck",
        "cpu_kernel",
        "graphs",
        "run_ahead",
        "speculation",
        "weights",
        "ram",
        "disk",
        "tensor_parallel",
    }
    assert all(f["tone"] in ("ok", "off", "warn", "bad") and f["text"] and f["why"] for f in s["features"])
    assert (
        by_key["attention"]["tone"] == "off" and "no GPU" in by_key["attention"]["text"]
    )  # Verdict(): no_cuda


def _cpu_doc() -> dict:
    """A CPU server's /health as the real builder makes it, with the scheduler's CPU figures."""
    srv = _Srv()
    srv.worker.scheduler.snapshot.update(
        graphs={"status": "off: no CUDA (cpu)", "captures": 0, "replays": 0},
        run_ahead={"enabled": False, "steps": 0},
    )
    return server_health(srv)


def _doc(**patches) -> dict:
    """``_cpu_doc()`` with ``a__b=value`` setting ``doc[a][b]``."""
    doc = copy.deepcopy(_cpu_doc())
    for path, v in patches.items():
        *outer, last = path.split("__")
        d = doc
        for k in outer:
            d = d[k]
        d[last] = v
    return doc


def _tones(doc: dict) -> dict[str, tuple[str, str]]:
    return {f.key: (f.tone, f.text) for f in features(doc)}


def test_a_cpu_server_in_its_normal_state_shows_no_warning():
    doc = _doc(attention__cpu_kernel="ok")
    t = _tones(doc)
    assert doc["attention"]["verdict"] == "no_cuda" and doc["device"] == "cpu"
    assert {k for k, (tone, _) in t.items() if tone in ("warn", "bad")} == set()
    for key in ("attention", "graphs"):  # off because this machine has no GPU: neutral, in words
        assert t[key] == ("off", "off — no GPU"), key
    assert t["selfcheck"][0] == t["run_ahead"][0] == t["disk"][0] == t["tensor_parallel"][0] == "off"
    assert t["ram"][0] == "off"  # auto on a CPU device: the bank is already in host memory
    assert t["server"] == ("ok", "serving") and t["cpu_kernel"] == ("ok", "on")


GPU = {
    "device": "cuda:0",
    "attention__cpu_kernel": None,
    "weights": {"held": "dequant", "note": "", "matmul": None},
}
NOT_FUSED = "off: the attention route is not fused ({})"


@pytest.mark.parametrize(
    ("patches", "key", "tone", "text"),
    [
        # the fused route on a GPU, and what keeps it off there
        ({**GPU, "attention__verdict": "ok", "attention__route": "fused"}, "attention", "ok", "on"),
        ({**GPU, "attention__verdict": "triton_missing"}, "attention", "warn", "off — triton missing"),
        (
            {**GPU, "attention__verdict": "head_dim_96_unsupported"},
            "attention",
            "warn",
            "off — head dim 96 unsupported",
        ),
        ({**GPU, "attention__verdict": "forced_lse"}, "attention", "off", "off — --attention lse"),
        ({**GPU, "attention__verdict": "selfcheck_failed"}, "attention", "bad", "off — self-check failed"),
        ({**GPU, "attention__selfcheck": {"passed": True}}, "selfcheck", "ok", "passed"),
        ({**GPU, "attention__selfcheck": {"passed": False}}, "selfcheck", "bad", "failed"),
        ({**GPU}, "cpu_kernel", "off", "not used — GPU"),
        # CUDA graphs and run-ahead follow their cause
        ({**GPU, "scheduler__graphs": {"status": "on"}}, "graphs", "ok", "on"),
        (
            {**GPU, "scheduler__graphs": {"status": "off: --cuda-graphs off"}},
            "graphs",
            "off",
            "off — --cuda-graphs off",
        ),
        (
            {
                **GPU,
                "attention__verdict": "triton_missing",
                "scheduler__graphs": {"status": NOT_FUSED.format("x")},
            },
            "graphs",
            "warn",
            "off — attention not fused",
        ),
        (
            {
                **GPU,
                "attention__verdict": "forced_lse",
                "scheduler__graphs": {"status": NOT_FUSED.format("x")},
            },
            "graphs",
            "off",
            "off — attention not fused",
        ),
        ({"scheduler__run_ahead": {"enabled": True, "steps": 3}}, "run_ahead", "ok", "on"),
        (
            {**GPU, "scheduler__graphs": {"status": "on"}, "scheduler__run_ahead": {"enabled": False}},
            "run_ahead",
            "off",
            "off — --run-ahead off",
        ),
        # the CPU's own kernels
        (
            {"attention__cpu_kernel": "torch ops (no C compiler ('cc' not found; set CC))"},
            "cpu_kernel",
            "warn",
            "off — not built",
        ),
        (
            {"attention__cpu_kernel": "off (TURNKV_CPU_KERNEL)"},
            "cpu_kernel",
            "off",
            "off — TURNKV_CPU_KERNEL",
        ),
        ({"weights": {"held": "packed", "note": "self-check ok", "matmul": "c"}}, "weights", "ok", "on"),
        (
            {"weights": {"held": "dequant", "note": "--weights dequant", "matmul": None}},
            "weights",
            "off",
            "off — --weights dequant",
        ),
        ({"weights": {"held": "dequant", "note": "", "matmul": None}}, "weights", "off", "off"),
        (
            {
                "weights": {
                    "held": "dequant",
                    "note": "torch 2.5 has no aten.x (needs torch>=2.6)",
                    "matmul": None,
                }
            },
            "weights",
            "warn",
            "off — see why",
        ),
        (
            {"weights": {"held": "mixed", "note": "self-check failed for a.weight", "matmul": "c"}},
            "weights",
            "warn",
            "partly",
        ),
        (
            {
                **GPU,
                "weights": {"held": "dequant", "note": "packed weights run on CPU, the device is cuda:0"},
            },
            "weights",
            "off",
            "not used — GPU",
        ),
        # speculation off is a choice (a flag, tensor parallelism), never a fault
        ({"speculation__status": "off: --speculate off"}, "speculation", "off", "off — --speculate off"),
        ({"speculation__status": "off: tensor parallelism (each rank ...)"}, "speculation", "off", "off"),
        # the disk tier, tensor parallelism, the server
        ({"disk__enabled": True}, "disk", "ok", "on"),
        ({"disk__enabled": True, "disk__corrupt": 2}, "disk", "warn", "on — with errors"),
        # its store raises (a damaged index): lookups are misses, prompts recomputed
        (
            {"disk__enabled": True, "disk__degraded": "an index lookup failed"},
            "disk",
            "warn",
            "degraded — recomputing",
        ),
        (
            {"tensor_parallel": {"size": 2, "status": "ok", "dead_ranks": [], "error": None}},
            "tensor_parallel",
            "ok",
            "on — 2 GPUs",
        ),
        (
            {
                "status": "unavailable",
                "tensor_parallel": {"size": 2, "status": "down", "dead_ranks": [1], "error": "gone"},
            },
            "tensor_parallel",
            "bad",
            "down",
        ),
        ({"status": "unavailable"}, "server", "bad", "unavailable"),
    ],
)
def test_each_status_field_gets_one_tone(patches, key, tone, text):
    assert _tones(_doc(**patches))[key] == (tone, text)


def test_features_of_a_partial_document_do_not_raise():
    """An older or stand-in /health (fields missing) still classifies: nothing is guessed as fine."""
    t = _tones({})
    assert t["server"][0] == "bad"
    assert t["attention"] == t["graphs"] == t["speculation"] == ("off", "—")

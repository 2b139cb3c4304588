"""The replica router's decisions and the front's failure events, without a Ray cluster.

Spec (oracle: a dict of which replica made which response): a request naming a
``previous_response_id`` is ranked first to the replica that made the response, whether the
router routed that request itself or only read the replica's published keys; when that replica is
gone (not among Serve's candidates) every live replica is offered instead. A chained request's
chain starts at its response, so two chains sending the same new input do not match each other.
New conversations on idle replicas are offered to each first in turn. A stream whose replica died
ends with one event each API's own SDK reads as its error. The front's health is ``ok`` only when
every expected replica answers ``ok`` with its store answering.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("ray")

from turnkv.serve_ray import failure_body, merge_health, stream_failure
from turnkv.serve_router import AffinityRouter, response_key, route_of

REPLICAS = ["r-a", "r-b", "r-c"]


class Candidate:
    """What Serve's ``RunningReplica`` shows a router: its id and its published stats."""

    def __init__(self, uid: str, stats: dict | None = None) -> None:
        self.replica_id = SimpleNamespace(unique_id=uid)
        self.routing_stats = stats or {}


def pending(route: dict) -> SimpleNamespace:
    return SimpleNamespace(
        args=(), kwargs={"route": route}, routing_context=SimpleNamespace(should_backoff=False)
    )


def router() -> AffinityRouter:
    r = object.__new__(AffinityRouter)  # Serve's own state is not what is under test
    r.initialize_state()
    return r


def follow_up(response_id: str, text: str = "And then?") -> dict:
    body = {"model": "default", "input": text, "previous_response_id": response_id}
    return route_of("/v1/responses", {}, json.dumps(body).encode())


def first_rank(r: AffinityRouter, route: dict, live: list[str], stats=None) -> list[str]:
    ranks = r._choose([Candidate(u, (stats or {}).get(u)) for u in live], pending(route))
    return [c.replica_id.unique_id for c in ranks[0]]


ops = st.lists(
    st.tuples(st.sampled_from(["make", "follow"]), st.integers(0, 30), st.sampled_from(REPLICAS)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from([None, *REPLICAS]))
def test_a_follow_up_goes_where_its_response_was_made(steps, dead):
    r, maker = router(), {}
    live = [u for u in REPLICAS if u != dead]
    for op, n, where in steps:
        rid = f"resp_{n}"
        if op == "make" and where in live:  # the front names the id; Serve put it on `where`
            route = route_of("/v1/responses", {}, b'{"model": "default", "input": "Hi"}') | {"response": rid}
            r.on_request_routed(pending(route), SimpleNamespace(unique_id=where), None)
            maker[rid] = where
        elif op == "follow":
            got = first_rank(r, follow_up(rid), live)
            if maker.get(rid) in live:
                assert got == [maker[rid]]
            else:  # never made, or its maker is gone: the live replicas, least loaded first
                assert sorted(got) == sorted(live)


def test_new_conversations_on_idle_replicas_take_them_in_turn():
    """Serve takes the first of equally loaded replicas: each is first in turn."""
    r = router()
    firsts = {
        r._choose([Candidate(u) for u in REPLICAS], pending(follow_up(f"new_{i}")))[0][0] for i in range(3)
    }
    assert {c.replica_id.unique_id for c in firsts} == set(REPLICAS)


def test_a_published_response_routes_without_the_router_having_sent_it():
    """Another front (or this one, restarted) routed it: the replica's published keys tell."""
    stats = {"r-b": {"responses": [response_key("resp_x")]}, "r-a": {"keys": []}}
    assert first_rank(router(), follow_up("resp_x"), ["r-a", "r-b"], stats) == ["r-b"]


def test_chains_with_the_same_new_input_do_not_match():
    a, b = follow_up("resp_a")["keys"], follow_up("resp_b")["keys"]
    plain = route_of("/v1/responses", {}, b'{"model": "default", "input": "And then?"}')["keys"]
    assert a[0] == response_key("resp_a") and not {*a} & {*b} and not {*a} & {*plain}


def _events(raw: bytes) -> list[tuple[str | None, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            fields = dict(line.split(": ", 1) for line in block.splitlines())
            out.append((fields.get("event"), json.loads(fields["data"])))
    return out


def test_a_dead_replicas_stream_ends_with_its_apis_error_event():
    from anthropic.types import ErrorResponse
    from openai.types import ErrorObject
    from openai.types.responses import ResponseErrorEvent

    [(kind, ev)] = _events(stream_failure("/v1/responses", 7, "gone"))
    assert kind == "error" and ResponseErrorEvent.model_validate(ev).sequence_number == 7
    [(kind, ev)] = _events(stream_failure("/v1/messages", 3, "gone"))
    assert kind == "error" and ErrorResponse.model_validate(ev).error.message == "gone"
    for path in ("/v1/chat/completions", "/v1/completions"):
        [(kind, ev)] = _events(stream_failure(path, 3, "gone"))
        assert kind is None and ErrorObject.model_validate(ev["error"]).code == "replica_failed"
    assert ErrorResponse.model_validate(failure_body("/v1/messages", "gone")).type == "error"


def test_the_fronts_health_names_a_replica_whose_store_does_not_answer():
    def replica(rid: str, degraded=None, status="ok") -> dict:
        return {"replica": rid, "status": status, "disk": {"enabled": True, "degraded": degraded}}

    assert merge_health([replica("a"), replica("b")], 2) == {
        "status": "ok",
        "replicas": 2,
        "expected": 2,
        "degraded": {},
    }
    down = merge_health([replica("a"), replica("b", "Redis redis://x is unreachable")], 2)
    assert down["status"] == "degraded" and down["degraded"] == {"b": "Redis redis://x is unreachable"}
    assert merge_health([replica("a")], 2)["status"] == "degraded"  # one did not answer
    assert merge_health([replica("a"), replica("b", status="unavailable")], 2)["status"] == "degraded"

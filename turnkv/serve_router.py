"""Conversation affinity for replicas on Ray Serve: a request goes where its conversation lives.

``route_of`` turns a request into its *chain*: keys chained over its messages, ``key(i) =
SHA-256(key(i-1), message i)`` under a root of the namespace (API key, ``cache_salt``, model), so
a follow-up (the history plus a reply and a new message) shares its first keys with every earlier
turn of its conversation and nothing with another tenant's. ``X-Session-Id`` adds a key of its
own as a hint. A Responses request chained by ``previous_response_id`` carries only its new
input, so its chain starts at the response's key (``response_key``): the front names each new
response's id before routing (``route["response"]``), the router notes that key with the replica
it chose, and the replica publishes the ids it made, so a follow-up naming the id goes where the
id was made (at once: no wait for the replica's next publication).

:class:`AffinityRouter` is Ray Serve's request-router extension point (``RequestRouter``). It
ranks the replica holding the longest prefix of the request's chain first, then the others by
queue length: Serve takes the first rank with a free slot (``max_ongoing_requests`` bounds each
replica's queue), so a saturated holder falls back to the least loaded replica (equals in turn,
so that new conversations spread over idle replicas). What a replica
holds is what the router sent it (known at once) joined with what each replica publishes
(``record_routing_stats``: the chain keys it served and the response keys it made, newest last;
a replacement replica publishes none). A replica that died is dropped from the tables when Serve
reports it (``on_replica_actor_died``), and Serve never offers it as a candidate again, so a
conversation held by it goes to the least loaded live replica, which restores it from the shared
block store (and a response id from the shared response store, docs/REPLICAS.md).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Sequence

from turnkv import serve_times

KEEP_KEYS = 65536  # chain keys the router remembers (about 100 bytes each)
ROOT = "turnkv.route/1"


def response_key(response_id: str) -> str:
    """The key of a Responses id: its conversation, held where the response was made."""
    return hashlib.sha256(f"{ROOT}|response|{response_id}".encode()).hexdigest()


def chain_keys(namespace: str, items: Sequence, start: str | None = None) -> list[str]:
    """``key(i)`` of each prefix ``items[: i + 1]`` (messages or input items, as JSON), chained
    on from ``start`` (a response's key) or from the namespace's root."""
    key = start or hashlib.sha256(f"{ROOT}|{namespace}".encode()).hexdigest()
    keys = []
    for item in items:
        h = hashlib.sha256(bytes.fromhex(key))
        h.update(json.dumps(item, sort_keys=True, separators=(",", ":")).encode())
        key = h.hexdigest()
        keys.append(key)
    return keys


def route_of(path: str, headers: dict[str, str], body: bytes) -> dict:
    """``{"keys": chain, "hint": key or None}`` for a request (empty for one without a conversation)."""
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    auth = headers.get("authorization") or headers.get("x-api-key") or ""
    ns = f"{hashlib.sha256(auth.encode()).hexdigest()}|{doc.get('model')}|{doc.get('cache_salt')}"
    items = doc.get("messages") or doc.get("input") or doc.get("prompt") or []
    if isinstance(items, str):
        items = [items]
    if isinstance(doc.get("system"), str | list):
        items = [{"system": doc["system"]}, *items]
    items = items if isinstance(items, list) else [items]
    prev = doc.get("previous_response_id")
    if isinstance(prev, str) and prev:  # only the new input: it continues the response's chain
        start = response_key(prev)
        keys = [start, *chain_keys(ns, items, start=start)]
    else:
        keys = chain_keys(ns, items)
    hint = None
    if sid := headers.get("x-session-id"):
        hint = hashlib.sha256(f"session|{ns}|{sid}".encode()).hexdigest()
    return {"keys": keys, "hint": hint}


def lookup_keys(route: dict) -> list[str]:
    """The keys a request is matched on, shortest prefix first (the hint counts least)."""
    return [*([route["hint"]] if route.get("hint") else []), *route.get("keys", ())]


def made_keys(route: dict) -> list[str]:
    """What the replica serving ``route`` holds afterwards: its keys and the response it makes."""
    made = [response_key(route["response"])] if route.get("response") else []
    return [*lookup_keys(route), *made]


class Holders:
    """Key -> the replica last given it (bounded, least recently used forgotten first)."""

    def __init__(self, keep: int = KEEP_KEYS) -> None:
        self.keep = keep
        self._at: OrderedDict[str, str] = OrderedDict()

    def note(self, keys: Sequence[str], replica: str) -> None:
        for key in keys:
            self._at[key] = replica
            self._at.move_to_end(key)
        while len(self._at) > self.keep:
            self._at.popitem(last=False)

    def best(self, keys: Sequence[str], alive: set[str], published: dict[str, set[str]]) -> str | None:
        """The live replica holding the longest prefix of ``keys`` (deepest key first)."""
        for key in reversed(keys):
            rid = self._at.get(key)
            if rid in alive:
                return rid
            for other, held in published.items():
                if other in alive and key in held:
                    return other
        return None

    def forget(self, replica: str) -> None:
        for key in [k for k, r in self._at.items() if r == replica]:
            del self._at[key]


def _router_base():
    from ray.serve.request_router import FIFOMixin, RequestRouter

    return FIFOMixin, RequestRouter


FIFOMixin, RequestRouter = _router_base()


class AffinityRouter(FIFOMixin, RequestRouter):
    """Longest-prefix affinity with least-loaded fallback (see the module docstring)."""

    def initialize_state(self, policy: str = "affinity", **kwargs) -> None:
        self.policy = policy  # "affinity" or "round_robin" (the benchmark's baseline)
        self.holders = Holders()
        self._turn = 0
        self._sets: dict[str, tuple[dict, set[str]]] = {}  # replica -> (its stats, their keys)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        t0 = time.perf_counter()
        ranks = self._choose(candidate_replicas, pending_request)
        if "nth" not in _route(pending_request):
            serve_times.DECISIONS.append(time.perf_counter() - t0)  # by the module (see serve_times)
        return ranks

    def _choose(self, candidate_replicas, pending_request):
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        route = _route(pending_request)
        if "nth" in route:  # /health and /metrics ask each replica in turn
            return [[ordered[route["nth"] % len(ordered)]]]
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if self.policy == "round_robin":
            self._turn += 1
            first = ordered[self._turn % len(ordered)]
            return [[first], [r for r in ordered if r is not first]]
        alive = {r.replica_id.unique_id for r in ordered}
        published = {r.replica_id.unique_id: self._published(r) for r in ordered}
        rid = self.holders.best(lookup_keys(route), alive, published)
        rest = [r for r in ordered if r.replica_id.unique_id != rid]
        if rest:  # Serve takes the least loaded of a rank, the first of equals: rotate the equals,
            self._turn += 1  # or new conversations on idle replicas would all go to the first
            k = self._turn % len(rest)
            rest = rest[k:] + rest[:k]
        if rid is None:
            ranks = [rest]  # nobody holds it: Serve picks the less loaded of two
        else:
            holder = next(r for r in ordered if r.replica_id.unique_id == rid)
            ranks = [[holder], rest]
        return ranks

    def _published(self, replica) -> set[str]:
        """The keys ``replica`` published (a set built once per publication, not per request)."""
        stats = replica.routing_stats
        seen = self._sets.get(replica.replica_id.unique_id)
        if seen is None or seen[0] is not stats:
            seen = (stats, {*stats.get("keys", ()), *stats.get("responses", ())})
            self._sets[replica.replica_id.unique_id] = seen
        return seen[1]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        route = _route(pending_request)
        if "nth" not in route:  # known at once, before the replica publishes it
            self.holders.note(made_keys(route), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.holders.forget(replica_id.unique_id)
        self._sets.pop(replica_id.unique_id, None)


def _route(pending_request) -> dict:
    if pending_request is None:
        return {}
    route = pending_request.kwargs.get("route")
    if route is None and len(pending_request.args) > 1:
        route = pending_request.args[1]
    return route if isinstance(route, dict) else {}

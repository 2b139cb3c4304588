"""turnkv replicas on Ray Serve: one OpenAI-compatible endpoint in front of N turnkv servers.

On a cluster of your own (``ray start --head`` and workers; docs/REPLICAS.md)::

    import ray
    from ray import serve
    from turnkv.config import EngineConfig
    from turnkv.serve_ray import app

    ray.init(address="auto")
    cfg = EngineConfig(model="default", disk_store="redis://10.0.0.5:6379/0")
    serve.run(app(cfg, replicas=8, gpus_per_replica=1), route_prefix="/")

``turnkv serve --replicas N`` does the same on a local Ray instance (``serve_replicas``).

Each :class:`Replica` is a whole turnkv server (``runtime.build`` and ``server.app.create_app``)
inside a Serve replica actor, one per GPU (``ray_actor_options={"num_gpus": tp}`` under
``--tensor-parallel tp``); its routes run in-process through ASGI (``forward``), so every route
works as on one server, streaming included: the response's head and then its body chunks come
back through a streaming ``DeploymentHandle``. :class:`Front` is the ingress: it computes the
request's route (``serve_router.route_of``) and passes it beside the request, which
:class:`~turnkv.serve_router.AffinityRouter` reads; for ``POST /v1/responses`` the route names
the id the response will have (the replica's server takes it from the ASGI scope), so the router
knows where a ``previous_response_id`` lives as soon as it routed the request that makes it. ``/health`` and ``/metrics`` ask every replica
and show each one. A replica that dies mid-stream ends only its streams (an error event in
the stream, or a 503 before the head); Serve stops routing to it and starts a replacement.
With a shared ``--disk-store`` every replica restores every conversation.
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from collections import deque
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from turnkv import serve_times
from turnkv.config import EngineConfig
from turnkv.serve_router import lookup_keys, response_key, route_of
from turnkv.server.messages_stream import anthropic_body
from turnkv.server.openai_responses import RESPONSE_ID
from turnkv.server.responses_stream import new_id
from turnkv.server.schemas import ApiError

PUBLISH_KEYS = 4096  # chain keys a replica publishes to the router (its newest)
PUBLISH_RESPONSES = 4096  # response keys it publishes (apart: long chains do not push them out)
STATS_PERIOD_S = 0.5  # how often Serve collects them


class Replica:
    """One turnkv server (engine, bank, tiers, routes) inside a Ray Serve replica."""

    def __init__(self, cfg: dict) -> None:
        from turnkv.runtime import build
        from turnkv.server.app import create_app

        self.cfg = EngineConfig(**cfg)
        self.rt = build(self.cfg, "serve", progress=False)
        self.app = create_app(self.rt)
        self.keys: deque[str] = deque(maxlen=PUBLISH_KEYS)
        self.responses: deque[str] = deque(maxlen=PUBLISH_RESPONSES)
        try:
            self.id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (a test)
            self.id = f"local-{os.getpid()}"

    def record_routing_stats(self) -> dict:
        """What the router reads (``RunningReplica.routing_stats``): the chain keys served here
        and the keys of the responses made here."""
        return {"keys": list(self.keys), "responses": list(self.responses)}

    async def forward(self, req: dict, route: dict) -> AsyncIterator:
        """Run one HTTP request through this server's app: yields the head
        ``{"status", "headers", "replica"}``, then the body's chunks (bytes)."""
        self.keys.extend(lookup_keys(route))
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": req["body"], "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": req["method"],
            "scheme": "http",
            "path": req["path"],
            "raw_path": req["path"].encode(),
            "root_path": "",
            "query_string": req["query"].encode(),
            "headers": [(k.encode(), v.encode()) for k, v in req["headers"]],
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
        }
        if route.get("response"):  # the id the front chose for the response made here
            scope[RESPONSE_ID] = route["response"]
        task = asyncio.create_task(self.app(scope, receive, out.put))
        try:
            while True:
                getter = asyncio.create_task(out.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    task.result()  # the app ended without a response: raise what it raised
                    return
                msg = getter.result()
                if msg["type"] == "http.response.start":
                    headers = [(k.decode(), v.decode()) for k, v in msg.get("headers", ())]
                    if route.get("response") and msg["status"] == 200:
                        self.responses.append(response_key(route["response"]))
                    yield {"status": msg["status"], "headers": headers, "replica": self.id}
                elif msg["type"] == "http.response.body":
                    if body := msg.get("body", b""):
                        yield body
                    if not msg.get("more_body", False):
                        return
        finally:
            gone.set()  # the client went away: the app cancels the turn (it banks what it computed)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 5)

    def pid(self) -> int:
        return os.getpid()


async def _collect(gen) -> tuple[dict, bytes]:
    head, chunks = None, []
    async for item in gen:
        if head is None:
            head = item
        else:
            chunks.append(item)
    return head, b"".join(chunks)


def _front(replicas_n: int):
    api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @serve.deployment
    @serve.ingress(api)
    class Front:
        def __init__(self, replica) -> None:
            self.replica = replica.options(stream=True)

        async def _each(self, path: str) -> list[tuple[dict, bytes]]:
            got: dict[str, tuple[dict, bytes]] = {}
            for i in range(replicas_n):
                req = {
                    "method": "GET",
                    "path": path,
                    "query": "",
                    "headers": [("host", "127.0.0.1")],
                    "body": b"",
                }
                with contextlib.suppress(Exception):
                    head, body = await _collect(self.replica.forward.remote(req, {"nth": i}))
                    got[head["replica"]] = (head, body)
            return list(got.values())

        @api.get("/health")
        async def health(self):
            each = [{"replica": h["replica"], **json.loads(b)} for h, b in await self._each("/health")]
            body = merge_health(each, replicas_n) | {"router": serve_times.summary(), "each": each}
            return JSONResponse(body, status_code=200 if each else 503)

        @api.get("/metrics")
        async def metrics(self):
            return Response(
                _merge_metrics(await self._each("/metrics")), media_type="text/plain; version=0.0.4"
            )

        @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        async def forward(self, path: str, request: Request):
            body = await request.body()
            headers = [(k, v) for k, v in request.headers.items()]
            t0 = time.perf_counter()
            route = route_of(request.url.path, dict(request.headers), body)
            if request.method == "POST" and request.url.path == "/v1/responses":
                route["response"] = new_id("resp")  # the router notes where it is made
            serve_times.ROUTE_OF.append(time.perf_counter() - t0)  # by the module: Front is pickled by value
            req = {"method": request.method, "path": request.url.path, "query": request.url.query}
            req |= {"headers": headers, "body": body}
            gen = self.replica.forward.remote(req, route)
            try:
                head = await gen.__anext__()
            except Exception as exc:  # the replica died before answering
                why = f"the replica failed before answering: {type(exc).__name__}"
                return JSONResponse(failure_body(request.url.path, why), 503)
            headers = {
                k: v for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")
            }
            headers["x-turnkv-replica"] = head["replica"]
            sse = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(
                _rest(gen, request.url.path if sse else None), status_code=head["status"], headers=headers
            )

    return Front


async def _rest(gen, sse_path: str | None) -> AsyncIterator[bytes]:
    """The body's chunks; when the replica dies mid-stream, one clean error event in the shape of
    ``sse_path``'s API ends this stream only (a body that is not a stream just ends)."""
    events = 0
    try:
        async for chunk in gen:
            events += chunk.count(b"\n\n")  # the replica's app sends whole events
            yield chunk
    except Exception as exc:
        if sse_path is not None:
            yield stream_failure(
                sse_path, events, f"the replica serving this stream failed: {type(exc).__name__}"
            )


def failure_body(path: str, message: str) -> dict:
    """A 503 for a replica that failed, in the error shape of ``path``'s API."""
    err = ApiError(503, message, "server_error", code="replica_failed")
    return anthropic_body(err) if path.startswith("/v1/messages") else err.body()


def stream_failure(path: str, events: int, message: str) -> bytes:
    """The event that ends a stream whose replica died, as each API ends a failed stream: the
    Responses API's ``error`` event (numbered after the ``events`` sent), Anthropic's ``event:
    error``, else OpenAI's ``data: {"error": ...}`` (what a chat or completion stream sends)."""
    if path.startswith("/v1/responses"):
        ev = {"type": "error", "code": "replica_failed", "message": message, "param": None}
        data = json.dumps(ev | {"sequence_number": events})
        return f"event: error\ndata: {data}\n\n".encode()
    body = json.dumps(failure_body(path, message))
    return (
        f"event: error\ndata: {body}\n\n" if path.startswith("/v1/messages") else f"data: {body}\n\n"
    ).encode()


def merge_health(each: list[dict], expected: int) -> dict:
    """The front's ``/health`` over its replicas' own: ``ok`` when all answered ``ok`` with their
    stores answering; ``degraded`` names each replica's store that does not (a Redis down: they
    serve from their bank and RAM tier meanwhile)."""
    down = {e["replica"]: e["disk"]["degraded"] for e in each if (e.get("disk") or {}).get("degraded")}
    ok = len(each) == expected and all(e.get("status") == "ok" for e in each) and not down
    return {
        "status": "ok" if ok else "degraded",
        "replicas": len(each),
        "expected": expected,
        "degraded": down,
    }


def _merge_metrics(each: list[tuple[dict, bytes]]) -> str:
    """Every replica's samples with a ``replica`` label; each metric's HELP and TYPE once."""
    seen, lines = set(), []
    for head, body in each:
        label = f'replica="{head["replica"]}"'
        for line in body.decode().splitlines():
            if line.startswith("#"):
                if line not in seen:
                    seen.add(line)
                    lines.append(line)
                continue
            if not line.strip():
                continue
            name, _, rest = line.partition(" ")
            if "{" in name:
                name = name.replace("{", "{" + label + ",", 1)
            else:
                name = f"{name}{{{label}}}"
            lines.append(f"{name} {rest}")
    return "\n".join(lines) + "\n"


def app(
    cfg: EngineConfig,
    replicas: int,
    gpus_per_replica: float = 0,
    policy: str = "affinity",
    max_queue: int = 0,
):
    """The Serve application: ``replicas`` turnkv servers behind one endpoint. ``max_queue`` bounds
    each replica's ongoing requests (0: ``cfg.max_running``); past it the router falls back."""
    from ray.serve.config import RequestRouterConfig

    replica = serve.deployment(Replica).options(
        name="turnkv-replica",
        num_replicas=replicas,
        ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": 0},
        max_ongoing_requests=max_queue or cfg.max_running,
        request_router_config=RequestRouterConfig(
            request_router_class="turnkv.serve_router.AffinityRouter",
            request_router_kwargs={"policy": policy},
            request_routing_stats_period_s=STATS_PERIOD_S,
        ),
        health_check_period_s=2,
    )
    front = _front(replicas).options(name="turnkv-front", ray_actor_options={"num_cpus": 0})
    return front.bind(replica.bind(dataclasses.asdict(cfg)))


def serve_replicas(cfg: EngineConfig, replicas: int, policy: str = "affinity") -> None:
    """``turnkv serve --replicas N``: a local Ray instance, N replicas, the endpoint on --host/--port."""
    import signal
    import threading

    import ray

    gpus = 0
    if cfg.device != "cpu":
        import torch

        gpus = cfg.tensor_parallel if torch.cuda.is_available() else 0
    if not cfg.disk_store and not cfg.no_disk:  # one directory every replica writes and restores
        from turnkv.bank.disk import disk_dir

        cfg = dataclasses.replace(cfg, disk_store=f"dir:{disk_dir(cfg.disk_dir) / 'shared'}")
    if gpus == 0 and cfg.threads == 0:  # replicas on one CPU share its cores
        cfg = dataclasses.replace(cfg, threads=max(1, (os.cpu_count() or 1) // replicas))
    ray.init(include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(app(cfg, replicas, gpus, policy), name="turnkv", route_prefix="/")
    print(
        f"turnkv: serving {replicas} replicas of {cfg.model} on http://{cfg.host}:{cfg.port}/v1 (Ray Serve)",
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()

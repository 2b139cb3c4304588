"""Two replicas of the default model on Ray Serve behind one endpoint (one Ray cluster per module).

Spec: follow-ups of interleaved conversations land on the replica that served their first turn
and reuse its cache (``cached_tokens`` covering the first turn's prompt, as on one server); a
killed replica's conversation continues on the other replica, restored from the shared block
store (``cached_tokens`` from its blocks) with the greedy text of a recompute, and no request is
sent to the dead replica; /health and /metrics show each replica.
"""

from __future__ import annotations

import time

import pytest
from redis_helpers import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

N_CONV = 8


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    from turnkv.config import EngineConfig
    from turnkv.serve_ray import app

    shared = tmp_path_factory.mktemp("shared")
    cfg = EngineConfig(
        model="default", device="cpu", weights="dequant", threads=1, disk_store=f"dir:{shared}"
    )
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app(cfg, 2), name="turnkv", route_prefix="/")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        yield client
    serve.shutdown()
    ray.shutdown()


def system(i: int) -> str:
    return f"You are assistant number {i}. " + " ".join(
        f"Rule {j}: answer briefly about topic {i}-{j}." for j in range(40)
    )


def chat(client, messages, salt=None) -> tuple[str, str, dict]:
    body = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    doc = r.json()
    return r.headers["x-turnkv-replica"], doc["choices"][0]["message"]["content"], doc["usage"]


def test_follow_ups_land_on_their_replica_and_reuse_its_cache(endpoint):
    convs = [
        [{"role": "system", "content": system(i)}, {"role": "user", "content": f"Hi {i}"}]
        for i in range(N_CONV)
    ]
    first = []
    for msgs in convs:
        rid, text, usage = chat(endpoint, msgs)
        msgs.append({"role": "assistant", "content": text})
        msgs.append({"role": "user", "content": "And then?"})
        first.append((rid, usage))
    for msgs, (rid, usage) in zip(
        convs, first, strict=True
    ):  # interleaved: every first turn, then follow-ups
        again, _, u2 = chat(endpoint, msgs)
        assert again == rid
        assert u2["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"]
    h = endpoint.get("/health").json()
    assert h["replicas"] == 2 and {e["replica"] for e in h["each"]} >= {rid for rid, _ in first}
    m = endpoint.get("/metrics").text
    assert all(f'replica="{rid}"' in m for rid, _ in first)


def test_a_killed_replicas_conversation_resumes_elsewhere_from_the_shared_store(endpoint):
    msgs = [{"role": "system", "content": system(99)}, {"role": "user", "content": "Hello"}]
    rid, text, _ = chat(endpoint, msgs)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Tell me more."}]
    time.sleep(1.0)  # the write behind of its blocks
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(rid)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    other, again, usage = chat(endpoint, msgs)
    assert other != rid
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 256  # whole blocks from the store
    _, cold, cold_usage = chat(endpoint, msgs, salt="recompute")
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0 and again == cold
    for _ in range(4):  # never to the dead replica again
        assert chat(endpoint, msgs)[0] != rid

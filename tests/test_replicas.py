"""Two replicas of the default model on Ray Serve behind one endpoint (one Ray cluster per module).

Spec: follow-ups of interleaved conversations land on the replica that served their first turn
and reuse its cache (``cached_tokens`` covering the first turn's prompt, as on one server), and
so do Responses chains that send only ``previous_response_id`` and the new input (through the
openai SDK); a replica killed mid-stream ends its stream with one error event while the other
replica's stream completes; its conversations continue on the other replica, restored from the
shared block store (``cached_tokens`` from its blocks) with the greedy text of a recompute, its
response ids found in the shared response store, and no request is sent to the dead replica;
/health and /metrics show each replica.
"""

from __future__ import annotations

import json
import threading
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
    auth = {"authorization": "Bearer none"}  # the key the openai SDK sends: one namespace to the router
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, headers=auth) as client:
        yield client
    serve.shutdown()
    ray.shutdown()


def system(i: int) -> str:
    return f"You are assistant number {i}. " + " ".join(
        f"Rule {j}: answer briefly about topic {i}-{j}." for j in range(40)
    )


def chat(client, messages, salt=None, session=None) -> tuple[str, str, dict]:
    body = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    r = client.post("/v1/chat/completions", json=body, headers={"x-session-id": session} if session else {})
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
    assert len({rid for rid, _ in first}) == 2  # new conversations spread over both replicas
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


def openai_client(endpoint, session=None):
    openai = pytest.importorskip("openai")
    headers = {"x-session-id": session} if session else None
    base = str(endpoint.base_url).rstrip("/") + "/v1"
    return openai.OpenAI(base_url=base, api_key="none", max_retries=0, default_headers=headers)


def respond(client, instructions, text, previous=None):
    """One Responses turn (``previous``: the response it continues): (replica, response)."""
    raw = client.responses.with_raw_response.create(
        model="default",
        instructions=instructions,
        input=text,
        previous_response_id=previous,
        max_output_tokens=8,
        temperature=0,
    )
    return raw.headers["x-turnkv-replica"], raw.parse()


def test_responses_chains_follow_their_previous_response_id(endpoint):
    """Only the new input and the id travel: the id's replica answers, from its own cache."""
    client = openai_client(endpoint)
    chains = [(system(20 + i), *respond(client, system(20 + i), f"Hi {i}")) for i in range(3)]
    assert len({rid for _, rid, _ in chains}) == 2  # on both replicas
    for _ in range(2):  # interleaved, every chain the same new input
        for k, (instructions, rid, prev) in enumerate(chains):
            again, resp = respond(client, instructions, "And then?", prev.id)
            assert again == rid
            assert resp.usage.input_tokens_details.cached_tokens >= prev.usage.input_tokens
            chains[k] = (instructions, rid, resp)


def stream(endpoint, messages, session, tokens, out: dict) -> None:
    """A chat stream's replica, its events (JSON) and whether it ended with ``[DONE]``."""
    body = {"model": "default", "messages": messages, "max_tokens": tokens, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    with endpoint.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": session}) as r:
        out["replica"] = r.headers["x-turnkv-replica"]
        out["events"], out["done"] = [], False
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                out["events"].append(json.loads(line[6:]))


def test_a_replica_killed_mid_stream(endpoint):
    """Its stream ends with one error event, the other replica's completes; its chat and its
    Responses chain continue on the other replica from the shared stores; nothing goes to it."""
    msgs = [{"role": "system", "content": system(99)}, {"role": "user", "content": "Hello"}]
    rid, text, _ = chat(endpoint, msgs, session="doomed")
    responses = openai_client(endpoint, session="doomed")
    where, made = respond(responses, system(98), "Hello")
    assert where == rid  # the session's hint
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Tell me more."}]
    time.sleep(1.0)  # the write behind of their blocks
    doomed, other = {}, {}
    threads = [threading.Thread(target=stream, args=(endpoint, msgs, "doomed", 400, doomed))]
    threads[0].start()
    while len(doomed.get("events", ())) < 3:  # it streams on the doomed replica
        time.sleep(0.05)

    def side(i: int) -> list[dict]:  # each try a conversation of its own: an equal one would follow
        return [{"role": "user", "content": f"Count to a hundred, bystander {i}."}]  # the first's replica

    i = next(i for i in range(8) if chat(endpoint, side(i), session=f"by-{i}")[0] != rid)
    bystander = f"by-{i}"
    threads.append(threading.Thread(target=stream, args=(endpoint, side(i), bystander, 48, other)))
    threads[1].start()  # on the other replica, where its session is
    while len(other.get("events", ())) < 3:
        time.sleep(0.05)
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(rid)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    for th in threads:
        th.join(120)
    assert doomed["replica"] == rid and other["replica"] != rid
    assert not doomed["done"] and doomed["events"][-1]["error"]["code"] == "replica_failed"
    assert all("error" not in ev for ev in doomed["events"][:-1])
    assert other["done"] and other["events"][-1]["choices"][0]["finish_reason"] == "length"

    again_at, again, usage = chat(endpoint, msgs)
    assert again_at != rid
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 256  # whole blocks from the store
    _, cold, cold_usage = chat(endpoint, msgs, salt="recompute")
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0 and again == cold
    at, resp = respond(responses, system(98), "And then?", made.id)  # the shared response store
    assert at != rid and resp.usage.input_tokens_details.cached_tokens >= 256
    for _ in range(4):  # never to the dead replica again
        assert chat(endpoint, msgs)[0] != rid

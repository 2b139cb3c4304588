"""The Responses-API stores (``bank.response_store`` in SQLite, ``bank.response_store_redis`` in
a real ``redis-server``): records round-trip, belong to a namespace, survive reopening the file
or are seen by another process's store, and are bounded by a TTL, a count and a byte cap, oldest
first; a Redis that does not answer raises ``ResponseStoreDown`` (a ``ConnectionError``)."""

from __future__ import annotations

import pytest
from redis_helpers import free_port, redis_server

from turnkv.bank.response_store import FILE_NAME, ResponseStore, StoredResponse


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "redis"])
def make(request):
    """``make(**bounds)``: a fresh store of each kind (Redis: its database flushed)."""
    if request.param == "sqlite":
        return ResponseStore
    from turnkv.bank.response_store_redis import RedisResponseStore

    url = request.getfixturevalue("redis_url")

    def fresh(**kw) -> RedisResponseStore:
        store = RedisResponseStore(url, **kw)
        store._redis.flushdb()
        return store

    return fresh


def record(rid: str, created: float, ns: str = "public", tokens: int = 10) -> StoredResponse:
    return StoredResponse(
        rid,
        ns,
        created,
        "fp",
        list(range(tokens)),
        "<chain text>",
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        "be brief",
        None,
        {"id": rid, "object": "response"},
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_record_round_trips_in_its_namespace_only(make):
    store = make()
    rec = record("resp_a", 1.0e12)
    store.put(rec)
    assert store.get("resp_a", "public") == rec
    assert store.get("resp_a", "key:other") is None
    assert not store.delete("resp_a", "key:other")
    assert store.delete("resp_a", "public") and store.get("resp_a", "public") is None
    assert not store.delete("resp_a", "public")


def test_records_survive_reopening_the_file(tmp_path):
    store = ResponseStore.beside(tmp_path)
    store.put(record("resp_a", 1.0e12, tokens=5000))
    store.close()
    again = ResponseStore.beside(tmp_path)
    assert (tmp_path / FILE_NAME).exists() and again.get("resp_a", "public").chain == list(range(5000))


def test_the_ttl_expires_records_on_read_and_on_put(make):
    clock = Clock()
    store = make(ttl_s=60, clock=clock)
    store.put(record("old", clock.now))
    clock.now += 61
    assert store.get("old", "public") is None
    store.put(record("new", clock.now))
    assert store.counts()[0] == 1


def test_the_count_and_byte_caps_evict_oldest_first(make):
    store = make(max_records=3)
    for i in range(5):
        store.put(record(f"r{i}", 1.0e12 + i))
    assert [store.get(f"r{i}", "public") is not None for i in range(5)] == [False, False, True, True, True]
    one = len(record("x", 0, tokens=20000).blob())
    store.close()
    store = make(max_bytes=int(2.5 * one))
    for i in range(4):
        store.put(record(f"r{i}", 1.0e12 + i, tokens=20000))
    n, nbytes = store.counts()
    assert n == 2 and nbytes <= 2.5 * one
    assert store.get("r3", "public") is not None and store.get("r1", "public") is None


def test_another_replicas_redis_store_finds_a_record_and_a_dead_redis_raises(redis_url):
    from turnkv.bank.response_store_redis import RedisResponseStore, ResponseStoreDown

    one, other = RedisResponseStore(redis_url, prefix="t2:"), RedisResponseStore(redis_url, prefix="t2:")
    one.put(record("resp_shared", 1.0e12, tokens=5000))
    assert other.get("resp_shared", "public").chain == list(range(5000))
    assert other.delete("resp_shared", "public") and one.get("resp_shared", "public") is None
    dead = RedisResponseStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    with pytest.raises(ConnectionError, match="unreachable"):
        dead.get("resp_shared", "public")
    with pytest.raises(ResponseStoreDown):
        dead.put(record("resp_x", 1.0e12))


def test_a_chain_history_keeps_the_chain_ids_and_crosses_to_other_ranks():
    """``ChainHistory`` (what ``previous_response_id`` banks): the chain's ids as they were, then
    the rest of the conversation's text tokenized; a text that does not continue the chain is
    tokenized whole; its spec rebuilds it on another rank."""
    from tool_models import tool_tokenizer

    from turnkv.chat_format.history import ChainHistory, ChatHistory, history_from_spec, history_spec

    tok = tool_tokenizer("qwen25")
    first = ChatHistory(tok, [{"role": "user", "content": "hi"}])
    chain, chain_text = first("hello"), first.text("hello")
    chain = [*chain[:-1], 7]  # ids the bank held that a fresh tokenization would not give
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rest = ChatHistory(tok, [*messages, {"role": "user", "content": "more"}])
    history = ChainHistory(tok, tuple(chain), chain_text, rest)
    text = rest.text("ok")
    assert text.startswith(chain_text)
    assert history("ok") == [*chain, *tok.encode(text[len(chain_text) :])]
    assert history.continued("something else") == tok.encode("something else")
    again = history_from_spec(history_spec(history), tok)
    assert again == history and again("ok") == history("ok")
    messages_turn = ChatHistory(tok, messages, None, "hermes", 1, calls_as_input=True)
    assert history_from_spec(history_spec(messages_turn), tok) == messages_turn  # keeps calls_as_input

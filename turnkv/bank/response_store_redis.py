"""Stored Responses-API responses in Redis: what replicas sharing a Redis block store share.

The same records, bounds and answers as ``response_store.ResponseStore`` (its SQLite file lives
in a disk tier's directory; replicas over ``--disk-store redis://...`` have none in common), so a
``previous_response_id`` made on a replica that died is found on another. A record is a Redis
hash ``<prefix>r:<id>`` (namespace, created, fingerprint, the zlib blob); the index is a sorted
set by creation (``<prefix>r:created``), the sizes a hash and their sum a counter. ``put`` is one
Lua script (write, then drop what the TTL expired and the oldest past the count and byte caps),
atomic on the server, so concurrent replicas keep the caps. A Redis that does not answer raises
:class:`ResponseStoreDown` (a ``ConnectionError``): the routes answer 503, a finished response
that could not be stored is logged.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from turnkv.bank.response_store import MAX_BYTES, MAX_RECORDS, TTL_S, StoredResponse

# KEYS: record, created zset, size hash, total counter; ARGV: id, ns, created, fp, body, nbytes,
# cutoff (created before it: expired), max records, max bytes, record prefix
_PUT = """
local old = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('HSET', KEYS[1], 'ns', ARGV[2], 'created', ARGV[3], 'fp', ARGV[4], 'body', ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[6])
redis.call('INCRBY', KEYS[4], tonumber(ARGV[6]) - old)
local function drop(id)
  local n = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('DEL', ARGV[10] .. id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('DECRBY', KEYS[4], n)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[7])) do drop(id) end
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[8])
    or tonumber(redis.call('GET', KEYS[4]) or '0') > tonumber(ARGV[9]) do
  drop(redis.call('ZRANGE', KEYS[2], 0, 0)[1])
end
return 1
"""

# KEYS: record, created zset, size hash, total counter; ARGV: id, ns
_DELETE = """
if redis.call('HGET', KEYS[1], 'ns') ~= ARGV[2] then return 0 end
local n = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DECRBY', KEYS[4], n)
return 1
"""


class ResponseStoreDown(ConnectionError):
    """The Redis holding the responses did not answer."""


class RedisResponseStore:
    """``ResponseStore``'s interface over Redis at ``url`` (keys under ``prefix``)."""

    def __init__(
        self,
        url: str,
        prefix: str = "turnkv:",
        ttl_s: float = TTL_S,
        max_records: int = MAX_RECORDS,
        max_bytes: int = MAX_BYTES,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
    ) -> None:
        import redis

        self.url = url
        self.ttl_s, self.max_records, self.max_bytes, self.clock = ttl_s, max_records, max_bytes, clock
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._rec = prefix + "r:"
        self._index = [prefix + "r:created", prefix + "r:size", prefix + "r:bytes"]
        self._put, self._del = self._redis.register_script(_PUT), self._redis.register_script(_DELETE)

    def _call(self, fn, *args, **kw):
        import redis

        try:
            return fn(*args, **kw)
        except redis.RedisError as exc:
            raise ResponseStoreDown(f"the response store at {self.url} is unreachable ({exc})") from exc

    def put(self, rec: StoredResponse) -> None:
        body = rec.blob()
        args = [rec.id, rec.namespace, repr(rec.created), rec.fingerprint, body, len(body)]
        args += [repr(self.clock() - self.ttl_s), self.max_records, self.max_bytes, self._rec]
        self._call(self._put, keys=[self._rec + rec.id, *self._index], args=args)

    def get(self, id: str, namespace: str) -> StoredResponse | None:
        """The live record ``id`` of ``namespace`` (another namespace's is not found)."""
        ns, created, fp, body = self._call(self._redis.hmget, self._rec + id, "ns", "created", "fp", "body")
        if ns is None or ns.decode() != namespace or float(created) < self.clock() - self.ttl_s:
            return None
        return StoredResponse.from_row(id, namespace, float(created), fp.decode(), body)

    def delete(self, id: str, namespace: str) -> bool:
        return bool(self._call(self._del, keys=[self._rec + id, *self._index], args=[id, namespace]))

    def counts(self) -> tuple[int, int]:
        """(records, bytes) held now."""
        n = self._call(self._redis.zcard, self._index[0])
        return int(n), int(self._call(self._redis.get, self._index[2]) or 0)

    def close(self) -> None:
        self._redis.close()


__all__ = ["RedisResponseStore", "ResponseStoreDown"]

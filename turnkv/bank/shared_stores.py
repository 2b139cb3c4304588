"""Block stores that several turnkv processes (replicas, machines) share: a directory and Redis.

Both implement ``disk_store.BlockStore``, so the disk tier (``bank.disk``) writes behind and
restores through them unchanged, and every read is verified (``disk_blocks``: checksum, key,
parent, depth, tokens) whatever the store. ``--disk-store`` picks one (``open_store``):

- ``dir:PATH`` (:class:`SharedDirStore`): one safetensors file per block under
  ``PATH/blocks/<key[:2]>/<key>.safetensors``, no lock and no index file: the listing *is* the
  index. Names are content-addressed (the key hashes the whole prefix), so two writers of one key
  write the same bytes; each writes a temp file of its own (host, pid and a counter in its name),
  fsyncs it and renames it into place, so a reader sees a whole block or none. A file's mtime is
  its last use; any process's eviction may take any block, and a block deleted by another
  process between a lookup and its read is ``BlockGone`` (a clean miss).
- ``redis://host:port/db`` (:class:`RedisStore`): blocks as Redis strings, and the index (size,
  depth, last use) in two hashes and a sorted set, each change one Lua script (atomic on the
  server). The byte budget is the tier's ``--disk-bytes``, least recently used first, like the
  directory's. A Redis that does not answer raises on the call (the tier counts a fault, says so
  on ``/health.disk.degraded`` and recomputes); after a connection error calls fail at once for
  ``RETRY_S`` so that a dead Redis does not cost each request a timeout.

Pins (``pinned``) are per process: they keep this process's eviction off a restore's blocks;
another process's eviction can still take them, which the restore reads as ``BlockGone``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path

from turnkv.bank.disk_blocks import Block, BlockError, decode_block, decode_bytes, encode_block, write_block
from turnkv.bank.disk_files import write_durable
from turnkv.bank.disk_index import SUFFIX
from turnkv.bank.disk_store import BlockGone, BlockInfo, leading

RETRY_S = 5.0  # after a connection error, Redis calls fail at once for this long
TEMP_AGE_S = 600.0  # a temp file older than this is a dead writer's (reconcile removes it)
RESCAN_S = 5.0  # the shared directory is listed again for its size at most this often


def open_store(spec: str, suffix: str = ""):
    """The store ``--disk-store`` names: ``dir:PATH`` or ``redis://...``; ``suffix`` keeps a
    tensor-parallel rank's shard apart (a subdirectory, a key prefix)."""
    if spec.startswith("dir:"):
        root = Path(spec[4:]).expanduser()
        return SharedDirStore(root / suffix if suffix else root)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, prefix=f"turnkv{':' + suffix if suffix else ''}:")
    raise ValueError(f"--disk-store must be dir:PATH or redis://host:port/db (got {spec!r})")


def _pin_keys(pins: Counter, mu: threading.Lock, keys: list[str]):
    with mu:
        pins.update(keys)
    try:
        yield
    finally:
        with mu:
            pins.subtract(keys)
            for key in keys:
                if pins[key] <= 0:
                    pins.pop(key, None)


class SharedDirStore:
    """A :class:`BlockStore` in a directory that many processes write and read at once."""

    memory_index = False  # other processes write it: every lookup goes to the directory

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser()
        self.blocks = self.root / "blocks"
        self.blocks.mkdir(parents=True, exist_ok=True)
        self.target = f"dir:{self.root}"
        self._mu = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._facts: dict[str, tuple[str, str, int]] = {}  # key -> (parent, context, depth): immutable
        self._nbytes = self._count = 0
        self._scanned = 0.0
        self._scan()

    def path(self, key: str) -> Path:
        return self.blocks / key[:2] / (key + SUFFIX)

    def put(self, block: Block, at: float | None = None) -> int:
        return self.put_many([block], at)[0]

    def put_many(self, blocks: Sequence[Block], at: float | Sequence[float] | None = None) -> list[int]:
        """Store ``blocks`` (used at ``at``: one time, or one per block) durably as one batch
        (``disk_files``: temp files fsynced, then renamed: readers see a whole block or none);
        returns each block's bytes written (0 for one already there)."""
        sizes = [0] * len(blocks)
        times = list(at) if isinstance(at, Sequence) else [at] * len(blocks)
        todo = {b.key: i for i, b in enumerate(blocks) if not self.path(b.key).exists()}
        items = []
        for i in todo.values():
            final = self.path(blocks[i].key)
            final.parent.mkdir(parents=True, exist_ok=True)
            items.append((final, partial(write_block, blocks[i])))
        if not items:
            return sizes
        written = write_durable(items)
        now = time.time()
        for i, n in zip(todo.values(), written, strict=True):
            b, when = blocks[i], times[i] or now
            with contextlib.suppress(OSError):  # the LRU order is the mtime; gone: evicted already
                os.utime(self.path(b.key), (when, when))
            with self._mu:
                self._facts[b.key] = (b.parent, b.context, b.depth)
                self._nbytes += n
                self._count += 1
            sizes[i] = n
        return sizes

    def get(self, key: str, into: tuple | None = None) -> Block:
        path = self.path(key)
        if not path.exists():
            raise BlockGone(f"block {key[:12]} is not in {self.root}")
        try:
            block = decode_block(str(path), key, into)
        except BlockError as exc:
            if not path.exists():  # another process deleted it under the read
                raise BlockGone(f"block {key[:12]} was deleted before it was read ({exc})") from exc
            raise
        with self._mu:
            self._facts[key] = (block.parent, block.context, block.depth)
        return block

    def has(self, key: str) -> bool:
        return self.path(key).exists()

    def run_length(self, keys: Sequence[str]) -> int:
        return leading(self.has(k) for k in keys)

    def delete(self, key: str) -> None:
        path = self.path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        with self._mu:
            self._nbytes -= size
            self._count -= 1

    def pinned(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        return contextlib.contextmanager(_pin_keys)(self._pins, self._mu, list(keys))

    def iterate(self) -> Iterator[BlockInfo]:
        for key, path, st in self._listing():
            facts = self._facts_of(key, path)
            if facts is not None:
                yield BlockInfo(key, *facts, st.st_size, st.st_mtime)

    def touch(self, keys: Iterable[str], at: float | None = None) -> None:
        now = at or time.time()
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.path(key), (now, now))

    def evict(self, budget_bytes: int) -> int:
        if self._nbytes <= budget_bytes and time.monotonic() - self._scanned < RESCAN_S:
            return 0
        infos = list(self.iterate())  # other processes' writes count too
        total = sum(i.nbytes for i in infos)
        with self._mu:
            self._nbytes, self._count, self._scanned = total, len(infos), time.monotonic()
        evicted = 0
        for info in sorted(infos, key=lambda i: (i.last_access, -i.depth)):
            if total <= budget_bytes:
                break
            if info.key in self._pins:
                continue
            self.delete(info.key)
            total -= info.nbytes
            evicted += 1
        return evicted

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def count(self) -> int:
        return self._count

    def close(self) -> None:
        pass

    def reconcile(self, adopt: bool = True) -> dict[str, int]:
        """Remove temp files of writers dead for ``TEMP_AGE_S`` (younger ones may be another
        process's write in flight); the counts ``LocalDirStore.reconcile`` reports."""
        out = dict.fromkeys(
            ("temp_files", "orphan_files", "missing_files", "bad_size", "adopted", "bad_entries"), 0
        )
        now = time.time()
        for tmp in self.blocks.glob("*/.*.tmp"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > TEMP_AGE_S:
                    tmp.unlink()
                    out["temp_files"] += 1
        self._scan()
        return out

    def _scan(self) -> None:
        sizes = [st.st_size for _, _, st in self._listing()]
        with self._mu:
            self._nbytes, self._count, self._scanned = sum(sizes), len(sizes), time.monotonic()

    def _listing(self) -> Iterator[tuple[str, Path, os.stat_result]]:
        with contextlib.suppress(FileNotFoundError):
            for sub in os.scandir(self.blocks):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    for entry in os.scandir(sub.path):
                        if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                            with contextlib.suppress(FileNotFoundError):
                                yield entry.name[: -len(SUFFIX)], Path(entry.path), entry.stat()

    def _facts_of(self, key: str, path: Path) -> tuple[str, str, int] | None:
        """(parent, context, depth) from the file's header (cached: a key's block never changes)."""
        if key in self._facts:
            return self._facts[key]
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                md = json.loads(f.read(min(n, 1 << 20))).get("__metadata__") or {}
            facts = (md["parent"], md["context"], int(md["depth"]))
        except (OSError, ValueError, KeyError, AttributeError):
            return None  # being deleted, or bad: a read finds out and removes it
        with self._mu:
            self._facts[key] = facts
        return facts


# KEYS: block, lru, size, depth, bytes; ARGV: data, score, nbytes, depth, info
_PUT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[6])
  redis.call('HSET', KEYS[3], ARGV[6], ARGV[3])
  redis.call('HSET', KEYS[4], ARGV[6], ARGV[4] .. ' ' .. ARGV[5])
  redis.call('INCRBY', KEYS[5], ARGV[3])
  return 1
end
return 0
"""
# KEYS: block, lru, size, depth, bytes; ARGV: key
_DELETE = """
local size = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if size then redis.call('DECRBY', KEYS[5], size) return 1 end
return 0
"""
# KEYS: lru, depth; ARGV: at, keys...
_TOUCH = """
for i = 2, #ARGV do
  local d = redis.call('HGET', KEYS[2], ARGV[i])
  if d then
    local depth = tonumber(string.match(d, '^%d+'))
    redis.call('ZADD', KEYS[1], 'XX', tonumber(ARGV[1]) - depth * 0.0001, ARGV[i])
  end
end
return 0
"""


def _score(at: float, depth: int) -> float:
    """LRU order with one chain's deepest blocks first among those used at one moment."""
    return at - depth * 1e-4


class StoreDown(ConnectionError):
    """Redis failed to answer within ``RETRY_S``: calls fail at once until then."""


class RedisStore:
    """A :class:`BlockStore` in a Redis server (blocks and index); shared by every process using it."""

    memory_index = False  # every lookup asks the server

    def __init__(self, url: str, prefix: str = "turnkv:", timeout_s: float = 2.0) -> None:
        import redis

        self.target, self.prefix = url, prefix
        # reads of 1 MiB, not redis-py's 64 KiB: a block is tens of MiB, and the parser's Python loop
        # per read costs CPU (a get: 3.1 -> 2.6 CPU s/GB; docs/BENCHMARKS.md, "Restore stages")
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, socket_read_size=1 << 20
        )
        p = prefix
        self._lru, self._size, self._depth, self._bytes = p + "lru", p + "size", p + "depth", p + "bytes"
        self._block = p + "b:"
        self._put, self._del, self._touch = (self._redis.register_script(s) for s in (_PUT, _DELETE, _TOUCH))
        self._mu = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._down_until = 0.0
        self._reason = ""
        self._nbytes = self._count = 0  # the last answer (``nbytes``/``count`` never raise)

    def _call(self, fn, *args, **kw):
        import redis

        if time.monotonic() < self._down_until:
            raise StoreDown(f"Redis {self.target} is unreachable ({self._reason}); retrying in a few s")
        try:
            return fn(*args, **kw)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._down_until, self._reason = time.monotonic() + RETRY_S, f"{type(exc).__name__}: {exc}"
            raise StoreDown(f"Redis {self.target} is unreachable ({self._reason})") from exc

    def _keys(self, key: str) -> list[str]:
        return [self._block + key, self._lru, self._size, self._depth, self._bytes]

    def _args(self, block: Block, data: bytes, at: float | None) -> list:
        info = f"{block.parent} {block.context}"
        return [data, _score(at or time.time(), block.depth), len(data), block.depth, info, block.key]

    def put(self, block: Block, at: float | None = None) -> int:
        data = encode_block(block)
        return (
            len(data)
            if self._call(self._put, keys=self._keys(block.key), args=self._args(block, data, at))
            else 0
        )

    def put_many(self, blocks: Sequence[Block], at: float | Sequence[float] | None = None) -> list[int]:
        """One round trip for the batch (a pipeline, not a transaction): each block is still its
        own atomic script, so a block is whole or absent whatever happens to the others."""
        times = at if isinstance(at, Sequence) else [at] * len(blocks)
        if not blocks:
            return []
        pipe = self._redis.pipeline(transaction=False)
        sizes = []
        for block, t in zip(blocks, times, strict=True):
            data = encode_block(block)
            self._put(keys=self._keys(block.key), args=self._args(block, data, t), client=pipe)
            sizes.append(len(data))
        done = self._call(pipe.execute)
        return [n if ok else 0 for n, ok in zip(sizes, done, strict=True)]

    def get(self, key: str, into: tuple | None = None) -> Block:
        data = self._call(self._redis.get, self._block + key)
        if data is None:
            raise BlockGone(f"block {key[:12]} is not in Redis {self.target}")
        return decode_bytes(data, key, into)

    def has(self, key: str) -> bool:
        return bool(self._call(self._redis.exists, self._block + key))

    def run_length(self, keys: Sequence[str]) -> int:
        """One round trip for the whole run (a pipeline of EXISTS), not one per block."""
        if not keys:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._block + key)
        return leading(self._call(pipe.execute))

    def delete(self, key: str) -> None:
        self._call(self._del, keys=self._keys(key), args=[key])

    def pinned(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        return contextlib.contextmanager(_pin_keys)(self._pins, self._mu, list(keys))

    def iterate(self) -> Iterator[BlockInfo]:
        rows = self._call(self._redis.zrange, self._lru, 0, -1, withscores=True)
        keys = [k.decode() for k, _ in rows]
        sizes = self._call(self._redis.hmget, self._size, keys) if keys else []
        facts = self._call(self._redis.hmget, self._depth, keys) if keys else []
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._block + key)
        there = self._call(pipe.execute) if keys else []
        for key, (_, score), size, fact, held in zip(keys, rows, sizes, facts, there, strict=True):
            if not held:  # its bytes went without the index (FLUSH, Redis's own maxmemory): drop it
                self.delete(key)
                continue
            if size is None or fact is None:
                continue
            depth, parent, context = fact.decode().split(" ")
            yield BlockInfo(key, parent, context, int(depth), int(size), score + int(depth) * 1e-4)

    def touch(self, keys: Iterable[str], at: float | None = None) -> None:
        keys = list(keys)
        if keys:
            self._call(self._touch, keys=[self._lru, self._depth], args=[at or time.time(), *keys])

    def evict(self, budget_bytes: int) -> int:
        evicted = 0
        while (total := int(self._call(self._redis.get, self._bytes) or 0)) > budget_bytes:
            progress = False
            for raw in self._call(self._redis.zrange, self._lru, 0, 63):
                key = raw.decode()
                if key in self._pins:
                    continue
                size = int(self._call(self._redis.hget, self._size, key) or 0)
                self.delete(key)
                evicted += 1
                progress = True
                total -= size
                if total <= budget_bytes:
                    break
            if not progress:  # only pinned blocks left over the budget: later evictions take them
                break
        return evicted

    @property
    def nbytes(self) -> int:
        with contextlib.suppress(Exception):
            self._nbytes = int(self._call(self._redis.get, self._bytes) or 0)
        return self._nbytes

    @property
    def count(self) -> int:
        with contextlib.suppress(Exception):
            self._count = int(self._call(self._redis.zcard, self._lru))
        return self._count

    def close(self) -> None:
        self._redis.close()

    def reconcile(self, adopt: bool = True) -> dict[str, int]:
        """Nothing to reconcile: each change is one atomic script on the server."""
        return dict.fromkeys(
            ("temp_files", "orphan_files", "missing_files", "bad_size", "adopted", "bad_entries"), 0
        )

"""Where blocks live: the :class:`BlockStore` interface and its local-directory implementation.

``LocalDirStore(root)`` keeps one safetensors file per block under ``root/blocks/<key[:2]>/`` and an
SQLite index (WAL) of every block's key, parent, context, size and last access in
``root/index.sqlite``. A write is durable before it is visible: temp file, write, flush, fsync,
rename, fsync the directory, and only then the index row. A crash therefore leaves at most a
temp file or a file without a row; :meth:`LocalDirStore.reconcile` (run on open) removes both and
drops rows whose file is missing or has the wrong size. One process owns a directory at a time
(an ``flock`` on ``root/lock``); another gets :class:`StoreBusy`.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from turnkv.bank.disk_blocks import Block, BlockError, decode_block, encode_block

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1  # of the index; an index of another version is rebuilt (its files are dropped)
SUFFIX = ".safetensors"
_tmp_ids = itertools.count()


@dataclass(frozen=True)
class BlockInfo:
    key: str
    parent: str
    context: str
    depth: int
    nbytes: int  # size of the file
    last_access: float  # unix time of the last write or read


class StoreBusy(Exception):
    """Another process holds the store's directory."""


class BlockStore(Protocol):
    """A keyed store of immutable blocks.

    Invariants: ``get(key)`` returns exactly the block that ``put`` stored under ``key`` or raises
    ``BlockError`` (never other bytes); a block is visible to ``has``/``get``/``iterate`` only once it
    is durable; ``put`` of a key already stored is a no-op; ``delete`` of an absent key is a no-op.
    ``nbytes`` and ``count`` are what ``iterate`` sums to. ``evict(budget)`` deletes least recently
    used blocks until ``nbytes <= budget`` and returns how many it deleted; among blocks used at the
    same moment (one conversation's chain) the deepest go first, so a chain loses its end, never
    the head that every later block needs.
    """

    def put(self, block: Block, at: float | None = None) -> int:
        """Store ``block`` as used at ``at`` (default now); returns the bytes written (0 if it was
        there). Raises ``OSError`` when the write fails (nothing is then visible)."""
        ...

    def get(self, key: str, pin: bool = False, into: tuple | None = None) -> Block:
        """The verified block, its ``k``/``v`` read into ``into`` (CPU views) when given, else into
        private memory (pinned with ``pin``); raises ``BlockError``."""
        ...

    def has(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def iterate(self) -> Iterator[BlockInfo]: ...

    def touch(self, keys: Iterable[str], at: float | None = None) -> None:
        """Mark ``keys`` used at ``at`` (default now), for least-recently-used eviction."""
        ...

    def evict(self, budget_bytes: int) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def count(self) -> int: ...

    def close(self) -> None: ...


class LocalDirStore:
    """A :class:`BlockStore` in a local directory; thread-safe (one lock around the index)."""

    def __init__(self, root: str | os.PathLike, lock: bool = True) -> None:
        self.root = Path(root).expanduser()
        self.blocks = self.root / "blocks"
        self.blocks.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._take_lock() if lock else None
        self._mu = threading.RLock()
        self._db = sqlite3.connect(self.root / "index.sqlite", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # a row lost to a power cut only orphans a durable file, which reconcile removes
        self._db.execute("PRAGMA synchronous=NORMAL")
        if self._db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
            self._db.execute("DROP TABLE IF EXISTS blocks")
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS blocks (key TEXT PRIMARY KEY, parent TEXT NOT NULL, "
            "context TEXT NOT NULL, depth INTEGER NOT NULL, nbytes INTEGER NOT NULL, "
            "last_access REAL NOT NULL)"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS blocks_lru ON blocks(last_access, depth)")
        self._nbytes, self._count = 0, 0
        self._recount()

    # -- the interface ----------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.blocks / key[:2] / (key + SUFFIX)

    def put(self, block: Block, at: float | None = None) -> int:
        if self.has(block.key):
            return 0
        data = encode_block(block)
        final = self.path(block.key)
        final.parent.mkdir(exist_ok=True)
        tmp = final.parent / f".{block.key}.{os.getpid()}.{next(_tmp_ids)}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        with self._mu:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO blocks VALUES (?, ?, ?, ?, ?, ?)",
                (block.key, block.parent, block.context, block.depth, len(data), at or time.time()),
            )
            if cur.rowcount:
                self._nbytes += len(data)
                self._count += 1
        return len(data)

    def get(self, key: str, pin: bool = False, into: tuple | None = None) -> Block:
        """The verified block; a key with no row, a missing file or a bad file raise ``BlockError``."""
        if not self.has(key):
            raise BlockError(f"block {key[:12]} is not in the index")
        path = self.path(key)
        if not path.is_file():
            raise BlockError(f"block {key[:12]} is in the index but its file {path} is missing")
        return decode_block(str(path), key, pin, into)

    def has(self, key: str) -> bool:
        with self._mu:
            return self._db.execute("SELECT 1 FROM blocks WHERE key = ?", (key,)).fetchone() is not None

    def delete(self, key: str) -> None:
        with self._mu:
            row = self._db.execute("SELECT nbytes FROM blocks WHERE key = ?", (key,)).fetchone()
            if row is not None:
                self._db.execute("DELETE FROM blocks WHERE key = ?", (key,))
                self._nbytes -= row[0]
                self._count -= 1
        with contextlib.suppress(OSError):  # a directory we cannot write: the row is gone anyway
            self.path(key).unlink(missing_ok=True)

    def iterate(self) -> Iterator[BlockInfo]:
        with self._mu:
            rows = self._db.execute(
                "SELECT key, parent, context, depth, nbytes, last_access FROM blocks"
            ).fetchall()
        for row in rows:
            yield BlockInfo(*row)

    def touch(self, keys: Iterable[str], at: float | None = None) -> None:
        now = at or time.time()
        with self._mu:
            self._db.executemany("UPDATE blocks SET last_access = ? WHERE key = ?", [(now, k) for k in keys])

    def evict(self, budget_bytes: int) -> int:
        evicted = 0
        with self._mu:
            if self._nbytes <= budget_bytes:
                return 0
            rows = self._db.execute(
                "SELECT key, nbytes FROM blocks ORDER BY last_access, depth DESC"
            ).fetchall()
            over = self._nbytes - budget_bytes
            for key, size in rows:
                if over <= 0:
                    break
                self.delete(key)
                over -= size
                evicted += 1
        return evicted

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def count(self) -> int:
        return self._count

    def close(self) -> None:
        with self._mu:
            self._db.close()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    # -- start-up --------------------------------------------------------------------------------
    def reconcile(self) -> dict[str, int]:
        """Make the index and the files agree. Returns counts: ``temp_files`` and ``orphan_files``
        removed, ``missing_files`` (rows whose file is gone) and ``bad_size`` (rows whose file has
        another size) dropped."""
        out = {"temp_files": 0, "orphan_files": 0, "missing_files": 0, "bad_size": 0}
        with self._mu:
            rows = dict(self._db.execute("SELECT key, nbytes FROM blocks").fetchall())
            on_disk: set[str] = set()
            for sub in self.blocks.iterdir():
                if not sub.is_dir():
                    out["orphan_files"] += _unlink(sub)
                    continue
                for f in sub.iterdir():
                    if f.name.endswith(".tmp"):
                        out["temp_files"] += _unlink(f)
                    elif f.name.endswith(SUFFIX) and f.name.removesuffix(SUFFIX) in rows:
                        key = f.name.removesuffix(SUFFIX)
                        on_disk.add(key)
                        if f.stat().st_size != rows[key]:
                            out["bad_size"] += 1
                            self.delete(key)
                    else:
                        out["orphan_files"] += _unlink(f)
            for key in rows.keys() - on_disk:
                out["missing_files"] += 1
                self.delete(key)
            self._recount()
        return out

    # -- internals -------------------------------------------------------------------------------
    def _recount(self) -> None:
        n, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM blocks").fetchone()
        self._count, self._nbytes = int(n), int(total)

    def _take_lock(self):
        try:
            import fcntl
        except ImportError:  # no flock on this platform: one process per directory is on the user
            return None
        f = open(self.root / "lock", "a+")  # held open for the store's lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            f.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise StoreBusy(
                    f"the KV disk cache {self.root} is in use by another turnkv process; "
                    f"pass --disk-dir to use another directory or --no-disk"
                ) from exc
            raise
        return f


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except OSError:
        return 0

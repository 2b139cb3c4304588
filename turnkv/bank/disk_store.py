"""Where blocks live: the :class:`BlockStore` interface and its local-directory implementation.

``LocalDirStore(root)`` keeps one safetensors file per block under ``root/blocks/<key[:2]>/`` and an
SQLite index (WAL) of every block's key, parent, context, size and last access in
``root/index.sqlite``. A write is durable before it is visible: temp file, write, flush, fsync,
rename, fsync the directory, and only then the index row. A crash therefore leaves at most a
temp file or a file without a row; :meth:`LocalDirStore.reconcile` (run on open by the tier)
removes temp files, adopts a file without a row that verifies, and drops rows whose file is
missing or has the wrong size. The files are the truth: a lost or damaged index is rebuilt from
them on open (``disk_index``), never a reason to delete one. A write makes the directories it
needs (``blocks/`` deleted at run time) and replaces an entry of the wrong kind in its way (a
directory where a block file goes), counting it. One process owns a directory at a time (an
``flock`` on ``root/lock``); another gets :class:`StoreBusy`.

A block a reader has looked up can still go before it is read; :meth:`LocalDirStore.pinned` keeps
the store's own eviction off the keys a restore holds (the writer thread evicts while restores
read), and ``get`` tells a block deleted meanwhile by anything else (another reader that found it
bad, ``DIR/blocks`` emptied by hand) apart from a bad one: :class:`BlockGone`, a miss.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from turnkv.bank.disk_blocks import Block, BlockError, decode_block, write_block
from turnkv.bank.disk_files import write_durable
from turnkv.bank.disk_index import (
    INDEX,
    SUFFIX,
    Rebuild,
    open_db,
    open_index,
    rebuild,
    remove,
    scan,
    verified_row,
)

log = logging.getLogger(__name__)


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


class BlockGone(BlockError):
    """The block was deleted after it was looked up (evicted, cleared, its file removed, removed
    as bad by another reader): a miss; nothing is wrong with what the store holds."""


class BlockStore(Protocol):
    """A keyed store of immutable blocks.

    Invariants: ``get(key)`` returns exactly the block that ``put`` stored under ``key`` or raises
    ``BlockError`` (never other bytes; ``BlockGone`` when the key or its file is no longer there);
    a block is visible to ``has``/``get``/``iterate`` only once it is durable; ``put`` of a key
    already stored is a no-op; ``delete`` of an absent key is a no-op.
    ``nbytes`` and ``count`` are what ``iterate`` sums to. ``evict(budget)`` deletes least recently
    used blocks until ``nbytes <= budget`` and returns how many it deleted; among blocks used at the
    same moment (one conversation's chain) the deepest go first, so a chain loses its end, never
    the head that every later block needs. It never deletes a ``pinned`` key (``delete`` does: a
    bad block must go), so the store may stay over its budget until the pin ends.
    """

    def put(self, block: Block, at: float | None = None) -> int:
        """Store ``block`` as used at ``at`` (default now); returns the bytes written (0 if it was
        there). Raises ``OSError`` when the write fails (nothing is then visible)."""
        ...

    def put_many(self, blocks: Sequence[Block], at: float | Sequence[float] | None = None) -> list[int]:
        """``put`` of each of ``blocks`` at once: durable together, then visible together."""
        ...

    def get(self, key: str, into: tuple | None = None) -> Block:
        """The verified block, its ``k``/``v`` read into ``into`` (CPU views whose ``[256, D]``
        planes are contiguous) when given, else into private memory; raises ``BlockError``."""
        ...

    # ``has`` and ``run_length`` answer from keys kept in memory, not the index: a miss then proves
    # nothing about a failing store (``DiskReader.extend`` does not clear ``degraded`` on one)
    memory_index: bool

    def has(self, key: str) -> bool: ...

    def run_length(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the store holds (one round trip where it can)."""
        ...

    def delete(self, key: str) -> None: ...

    def pinned(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        """Keep ``evict`` off ``keys`` (stored or not) while the context lasts; pins nest."""
        ...

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
    """A :class:`BlockStore` in a local directory; thread-safe (one lock around the index).

    An unusable index is rebuilt from the block files on open (``rebuilt`` then says how); with
    ``repair=False`` (implied by ``lock=False``: no rebuild without the lock) it raises
    ``IndexDamaged`` instead.
    """

    def __init__(self, root: str | os.PathLike, lock: bool = True, repair: bool = True) -> None:
        self.root = Path(root).expanduser()
        self.blocks = self.root / "blocks"
        self.blocks.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._take_lock() if lock else None
        self._mu = threading.RLock()
        # with the lock this process is the directory's one writer, so the index's keys are known
        # here: ``has`` and ``run_length`` (asked on the engine thread) answer from memory, never
        # waiting behind a writer's transaction (``disk_writer``'s module docstring)
        self.memory_index = lock
        self._keys: set[str] = set()
        self._pins: Counter[str] = Counter()  # key -> restores holding it (``pinned``)
        self.bad_entries = 0  # entries of the wrong kind that writes replaced
        try:
            self._db, self.rebuilt = open_index(self.root, repair=repair and lock)
        except BaseException:
            self._release()
            raise
        self._nbytes, self._count = 0, 0
        self._recount()

    # -- the interface ----------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.blocks / key[:2] / (key + SUFFIX)

    def put(self, block: Block, at: float | None = None) -> int:
        return self.put_many([block], at)[0]

    def put_many(self, blocks: Sequence[Block], at: float | Sequence[float] | None = None) -> list[int]:
        """Store ``blocks`` (used at ``at``: one time, or one per block) durably as one batch (``disk_files``: their files written, fsynced
        and renamed together), then their index rows in one transaction; returns each block's
        bytes written (0 for one already stored). Raises ``OSError`` with nothing visible."""
        sizes = [0] * len(blocks)
        todo = {b.key: i for i, b in enumerate(blocks) if not self.has(b.key)}  # one file per key
        items = []
        for i in todo.values():
            final = self.path(blocks[i].key)
            self._make_way(final.parent, stat.S_ISDIR)
            final.parent.mkdir(parents=True, exist_ok=True)  # blocks/ itself may have been deleted
            self._make_way(final, stat.S_ISREG)
            items.append((final, partial(write_block, blocks[i])))
        if not items:
            return sizes
        written = write_durable(items)  # durable before visible: the rows come after
        now = time.time()
        ats = list(at) if isinstance(at, Sequence) else [at or now] * len(blocks)
        with self._mu:
            self._db.execute("BEGIN")
            try:
                for i, n in zip(todo.values(), written, strict=True):
                    b = blocks[i]
                    cur = self._db.execute(
                        "INSERT OR IGNORE INTO blocks VALUES (?, ?, ?, ?, ?, ?)",
                        (b.key, b.parent, b.context, b.depth, n, ats[i] or now),
                    )
                    if cur.rowcount:
                        self._nbytes += n
                        self._count += 1
                        self._keys.add(b.key)
                        sizes[i] = n
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._recount()
                raise  # the files stay: reconcile adopts them at the next start
        return sizes

    def get(self, key: str, into: tuple | None = None) -> Block:
        """The verified block; a bad file raises ``BlockError``, a key whose row or file is gone
        (before or during the read) ``BlockGone``."""
        if not self.has(key):
            raise BlockGone(f"block {key[:12]} is no longer in the index")
        path = self.path(key)
        try:
            return decode_block(str(path), key, into)
        except BlockError as exc:
            # ``delete`` drops the row, then the file: either one gone means the block was deleted
            # (evicted, cleared, removed by hand or by another reader), not that its bytes are bad
            if not self.has(key) or _gone(path):
                raise BlockGone(f"block {key[:12]} was deleted before it was read ({exc})") from exc
            raise

    def has(self, key: str) -> bool:
        if self.memory_index:
            return key in self._keys
        with self._mu:
            return self._db.execute("SELECT 1 FROM blocks WHERE key = ?", (key,)).fetchone() is not None

    def run_length(self, keys: Sequence[str]) -> int:
        if self.memory_index:
            return leading(k in self._keys for k in keys)
        n = 0
        for lo in range(0, len(keys), 500):  # under SQLite's bound on a statement's parameters
            part = keys[lo : lo + 500]
            with self._mu:
                sql = f"SELECT key FROM blocks WHERE key IN ({','.join('?' * len(part))})"
                held = {k for (k,) in self._db.execute(sql, list(part))}
            n += leading(k in held for k in part)
            if n < lo + len(part):
                break
        return n

    def delete(self, key: str) -> None:
        with self._mu:
            row = self._db.execute("SELECT nbytes FROM blocks WHERE key = ?", (key,)).fetchone()
            if row is not None:
                self._db.execute("DELETE FROM blocks WHERE key = ?", (key,))
                self._nbytes -= row[0]
                self._count -= 1
            self._keys.discard(key)
        remove(self.path(key))  # a directory we cannot write: the row is gone anyway

    @contextlib.contextmanager
    def pinned(self, keys: Iterable[str]) -> Iterator[None]:
        keys = list(keys)
        with self._mu:
            self._pins.update(keys)
        try:
            yield
        finally:
            with self._mu:
                self._pins.subtract(keys)
                for key in keys:
                    if self._pins[key] <= 0:
                        self._pins.pop(key, None)

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
        """Drop least recently used blocks until the store fits ``budget_bytes``: their rows in one
        transaction under the lock, then their files outside it (unlinking a large file waits on
        a busy disk, and lookups must not wait with it). A reader that finds a row gone, or its
        file, takes it as deleted (``get``: ``BlockGone``)."""
        victims: list[str] = []
        with self._mu:
            if self._nbytes <= budget_bytes:
                return 0
            rows = self._db.execute(
                "SELECT key, nbytes FROM blocks ORDER BY last_access, depth DESC"
            ).fetchall()
            over, sizes = self._nbytes - budget_bytes, 0
            for key, size in rows:
                if over <= 0:
                    break
                if key in self._pins:  # a restore is reading it: a later eviction takes it
                    continue
                victims.append(key)
                over -= size
                sizes += size
            if not victims:  # every candidate is pinned
                return 0
            self._db.execute("BEGIN")
            try:
                self._db.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in victims])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._nbytes -= sizes
            self._count -= len(victims)
            self._keys.difference_update(victims)
        for key in victims:
            remove(self.path(key))
        return len(victims)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def count(self) -> int:
        return self._count

    def close(self) -> None:
        with self._mu:
            self._db.close()
        self._release()

    # -- start-up and repair ---------------------------------------------------------------------
    def reconcile(self, adopt: bool = True) -> dict[str, int]:
        """Make the index and the files agree. Returns counts: ``temp_files`` removed,
        ``adopted`` (files without a row that verify, given one; with ``adopt`` only),
        ``orphan_files`` (files without a row that do not) and ``bad_entries`` (anything else under
        ``blocks/``) removed, ``missing_files`` (rows whose file is gone) and ``bad_size`` (rows
        whose file has another size) dropped."""
        out = dict.fromkeys(("temp_files", "orphan_files", "missing_files", "bad_size"), 0)
        out |= {"adopted": 0, "bad_entries": 0}
        with self._mu:
            rows = dict(self._db.execute("SELECT key, nbytes FROM blocks").fetchall())
            on_disk: set[str] = set()
            for entry in scan(self.blocks):
                if entry.kind == "temp":
                    out["temp_files"] += remove(entry.path)
                elif entry.kind == "bad":
                    out["bad_entries"] += remove(entry.path)
                elif entry.key in rows:
                    on_disk.add(entry.key)
                    if _size(entry.path) != rows[entry.key]:
                        out["bad_size"] += 1
                        self.delete(entry.key)
                elif adopt and isinstance(row := verified_row(entry.path, entry.key), tuple):
                    self._db.execute("INSERT OR IGNORE INTO blocks VALUES (?, ?, ?, ?, ?, ?)", row)
                    out["adopted"] += 1
                else:
                    out["orphan_files"] += remove(entry.path)
            for key in rows.keys() - on_disk:
                out["missing_files"] += 1
                self.delete(key)
            self._recount()
        return out

    def rebuild(self) -> Rebuild:
        """Rebuild the index from the block files (``turnkv cache repair``), keeping the rows'
        last access; the lock must be held."""
        with self._mu:
            kept = dict(self._db.execute("SELECT key, last_access FROM blocks").fetchall())
            self._db.close()
            try:
                report = rebuild(self.root, "sound (rebuilt as asked)", kept)
            finally:
                self._db = open_db(self.root / INDEX)
            self._recount()
        return report

    # -- internals -------------------------------------------------------------------------------
    def _make_way(self, path: Path, kind) -> None:
        """Remove what stands at ``path`` unless it is of ``kind`` (``stat.S_ISDIR``/``S_ISREG``):
        a directory where a block file goes would fail its write forever."""
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if not kind(mode) and remove(path):
            with self._mu:
                self.bad_entries += 1
            log.warning(
                "KV disk cache: removed %s, which stood where a block's %s goes",
                path,
                "directory" if kind is stat.S_ISDIR else "file",
            )

    def _release(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def _recount(self) -> None:
        n, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM blocks").fetchone()
        self._count, self._nbytes = int(n), int(total)
        self._keys = {k for (k,) in self._db.execute("SELECT key FROM blocks")}

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


def leading(held: Iterable[bool]) -> int:
    """How many of ``held``, from the first, are true (a store's ``run_length``; stops at the
    first false, so a lazy ``held`` asks no further)."""
    return sum(1 for _ in itertools.takewhile(bool, held))


def _gone(path: Path) -> bool:
    """Nothing at ``path`` (an entry that cannot be examined is there, only unreadable)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1

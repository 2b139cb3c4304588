"""The disk tier's SQLite index: used when sound, else moved aside and rebuilt from the block files.

``index.sqlite`` only makes lookups fast: every block file names itself (key, parent, context,
depth, checksum; ``disk_blocks``), so the index can always be rebuilt from ``blocks/``, and losing
it is never a reason to delete a block. :func:`open_index` checks the index first (``PRAGMA
quick_check``, its schema version, its table). One that is missing while block files exist,
empty, of another schema or damaged (truncated, a garbage header or page) is rebuilt
(:func:`rebuild`): a damaged file and its ``-wal``/``-shm`` are moved aside to
``index.sqlite.damaged-<time>``, every block file is read and verified (checksum and metadata, on
several threads), those that fail are removed and counted (a file of another format version, an
older turnkv's, apart: it is no damage), the new index is written to a temp file, fsynced and
renamed into place, and one line with the counts is logged. A crash at any
point leaves the old index or none, and no index means the next start rebuilds again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sqlite3
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from turnkv.bank.disk_blocks import BlockError, OtherVersion, decode_block

log = logging.getLogger(__name__)

INDEX = "index.sqlite"
SCHEMA_VERSION = 1  # of the index; an index of another version is rebuilt from the blocks
SUFFIX = ".safetensors"
SIDE_FILES = ("-wal", "-shm")  # SQLite's companions of the index in WAL mode
COLUMNS = "key, parent, context, depth, nbytes, last_access"
VERIFY_THREADS = max(1, min(8, os.cpu_count() or 1))  # a block's checksum runs without the GIL
_KEY = re.compile(r"[0-9a-f]{64}")
# errors that say the index cannot be reached now, not that it is damaged: never rebuild for them
_NOT_DAMAGE = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_READONLY")
_NOT_DAMAGE += ("SQLITE_IOERR", "SQLITE_NOMEM", "SQLITE_FULL", "SQLITE_AUTH", "SQLITE_INTERRUPT")


class IndexDamaged(Exception):
    """The index cannot be used as it is and the caller asked not to rebuild it; nothing changed."""

    def __init__(self, root: Path, problem: str) -> None:
        self.problem = problem
        self.block_files = block_files(root)
        super().__init__(
            f"the KV disk cache index {root / INDEX} is {problem}; its {self.block_files} block files "
            f"are kept: `turnkv cache repair` rebuilds the index from them (so does the next "
            f"`turnkv serve`)"
        )


@dataclass(frozen=True)
class Rebuild:
    """What a rebuild found and did."""

    reason: str  # what was wrong with the index: "missing", "empty", "damaged (...)", ...
    kept: int  # block files verified and indexed
    dropped: int  # block files that failed verification, removed
    other_version: int  # block files of another format version (never looked up here), removed
    bad_entries: int  # entries of the wrong kind under blocks/ (a directory at a block's path), removed
    temp_files: int  # writes a crash cut short, removed
    seconds: float
    moved_to: str | None  # where the damaged index went (None: nothing worth keeping)


@dataclass(frozen=True)
class Entry:
    """One entry under ``blocks/``: a block file at its key's path, a temp file, or anything else."""

    kind: Literal["block", "temp", "bad"]
    path: Path
    key: str = ""


def scan(blocks: Path) -> Iterator[Entry]:
    """Every entry under ``blocks/`` (none when it is missing), classified; nothing is read."""
    try:
        subs = sorted(blocks.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return
    for sub in subs:
        if not _is(sub, stat.S_ISDIR):
            yield Entry("bad", sub)
            continue
        try:
            names = sorted(sub.iterdir())
        except OSError:  # unreadable: its blocks are misses (removing it fails just the same)
            yield Entry("bad", sub)
            continue
        for f in names:
            key = f.name.removesuffix(SUFFIX)
            if f.name.endswith(".tmp"):
                yield Entry("temp", f)
            elif (
                f.name.endswith(SUFFIX)
                and _KEY.fullmatch(key)
                and key[:2] == sub.name
                and _is(f, stat.S_ISREG)
            ):
                yield Entry("block", f, key)
            else:
                yield Entry("bad", f)


def block_files(root: Path) -> int:
    """How many block files ``root/blocks`` holds (unverified)."""
    return sum(1 for e in scan(root / "blocks") if e.kind == "block")


def verified_row(path: Path, key: str) -> tuple | BlockError:
    """The index row of the block file ``path`` (its mtime as the last access), or why the file
    is not block ``key`` (``OtherVersion``: a block of another format version)."""
    try:
        block = decode_block(str(path), key)
        st = path.stat()
    except BlockError as exc:
        return exc
    except OSError as exc:
        return BlockError(f"unreadable: {type(exc).__name__}: {exc}")
    return (key, block.parent, block.context, block.depth, st.st_size, st.st_mtime)


def remove(path: Path) -> int:
    """Remove a file, link or directory tree; 1 if it went, 0 if it could not."""
    try:
        if _is(path, stat.S_ISDIR):
            shutil.rmtree(path)
        else:
            path.unlink()
        return 1
    except OSError:
        return 0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the existing index ``path`` (never creates one), thread-shared, autocommit."""
    uri = Path(os.path.abspath(path)).as_uri() + "?mode=rw"
    return sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)


def problem(path: Path) -> str | None:
    """What makes the index at ``path`` unusable, or None when it is sound. Raises
    ``sqlite3.Error`` or ``OSError`` when it cannot be read now (busy, no permission), which is
    no damage. Side files that the check itself created are removed again."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        return "damaged (not a regular file)"
    if st.st_size == 0:
        return "empty"
    try:
        with _peek(path) as db:
            check = db.execute("PRAGMA quick_check").fetchall()
            if check != [("ok",)]:
                return f"damaged ({_first_line(check[0][0]) if check else 'quick_check said nothing'})"
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                return f"of schema version {version}, not {SCHEMA_VERSION}"
            db.execute(f"SELECT {COLUMNS} FROM blocks LIMIT 1").fetchall()
    except sqlite3.DatabaseError as exc:
        if (getattr(exc, "sqlite_errorname", None) or "").startswith(_NOT_DAMAGE):
            raise
        return f"damaged ({_first_line(str(exc))})"
    return None


def open_index(root: Path, repair: bool = True) -> tuple[sqlite3.Connection, Rebuild | None]:
    """The index of the store at ``root`` (its lock held), rebuilt first when it is unusable; the
    report is None when nothing was rebuilt (a sound index, or a new directory). With
    ``repair=False`` an unusable index raises :class:`IndexDamaged` instead (a new directory,
    which has no block files, still gets an empty index)."""
    path = root / INDEX
    why = problem(path)
    report = None
    if why is not None:
        if not repair and not (why == "missing" and block_files(root) == 0):
            raise IndexDamaged(root, why)
        report = rebuild(root, why)
        if why == "missing" and report.kept + report.dropped + report.other_version + report.bad_entries == 0:
            report = None  # a new directory: nothing was lost
    return open_db(path), report


def open_db(path: Path) -> sqlite3.Connection:
    """The store's connection to its (sound) index: WAL, synchronous=NORMAL."""
    db = connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    # a row lost to a power cut only leaves a durable file without a row, which reconcile adopts
    db.execute("PRAGMA synchronous=NORMAL")
    return db


def rows_of(root: Path, sql: str) -> list[tuple]:
    """The rows of ``sql`` over the sound index at ``root``, without taking its lock and without
    changing anything (``turnkv cache stats`` beside a running server); a directory without an
    index or block files has none. Raises :class:`IndexDamaged`."""
    path = root / INDEX
    why = problem(path)
    if why == "missing" and block_files(root) == 0:
        return []
    if why is not None:
        raise IndexDamaged(root, why)
    with _peek(path) as db:
        return db.execute(sql).fetchall()


def rebuild(root: Path, reason: str, last_access: dict[str, float] | None = None) -> Rebuild:
    """Rebuild the index of ``root`` (its lock held, no connection open) from the block files.

    ``last_access`` (key -> time) carries the rows of a sound index; otherwise whatever rows of
    the old index still read are used, else each file's mtime (its write)."""
    t0 = time.monotonic()
    path = root / INDEX
    if last_access is None:
        last_access = _salvage(path) if reason.startswith("damaged") else {}
    moved = _move_aside(path) if reason.startswith("damaged") else None
    for stale in root.glob(INDEX + ".rebuild-*"):  # a rebuild a crash cut short
        remove(stale)
    temp = bad = dropped = other = 0
    found: list[Entry] = []
    for entry in scan(root / "blocks"):
        if entry.kind == "block":
            found.append(entry)
        elif entry.kind == "temp":
            temp += remove(entry.path)
        else:
            bad += remove(entry.path)
    rows = []
    with ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="turnkv-disk-rebuild") as pool:
        for entry, row in zip(found, pool.map(lambda e: verified_row(e.path, e.key), found), strict=True):
            if isinstance(row, OtherVersion):
                other += 1
                remove(entry.path)
            elif isinstance(row, BlockError):
                dropped += 1
                remove(entry.path)
            else:
                rows.append((*row[:5], last_access.get(entry.key, row[5])))
    tmp = root / f"{INDEX}.rebuild-{os.getpid()}"
    _write(tmp, rows)
    _install(tmp, path)
    report = Rebuild(reason, len(rows), dropped, other, bad, temp, time.monotonic() - t0, moved)
    if reason != "missing" or rows or dropped or other or bad:
        log.warning(
            "KV disk cache %s: the index was %s; rebuilt it from the block files in %.2f s: %d kept, "
            "%d dropped (failed verification), %d of another format version (written by another "
            "turnkv; not damage), %d bad entries and %d temp files removed%s",
            root,
            reason,
            report.seconds,
            report.kept,
            dropped,
            other,
            bad,
            temp,
            f"; the old index is at {moved}" if moved else "",
        )
    return report


# -- internals -------------------------------------------------------------------------------------
def _is(path: Path, kind) -> bool:
    try:
        return kind(os.lstat(path).st_mode)
    except OSError:
        return False


def _first_line(text: str) -> str:
    return text.replace("*** in database main ***", "").strip().splitlines()[0] if text.strip() else text


def _sides(path: Path) -> list[Path]:
    return [path.with_name(path.name + s) for s in SIDE_FILES]


@contextlib.contextmanager
def _peek(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection for reading ``path``; the side files it creates on a damaged index (a sound
    one removes its own on close) are removed afterwards."""
    before = [p for p in _sides(path) if not p.exists()]
    db = connect(path)
    try:
        yield db
    finally:
        db.close()
        for p in before:
            remove(p)


def _salvage(path: Path) -> dict[str, float]:
    """``key -> last_access`` of whatever rows of a damaged index still read (often all)."""
    try:
        with _peek(path) as db:
            return {str(k): float(t) for k, t in db.execute("SELECT key, last_access FROM blocks")}
    except (sqlite3.Error, OSError, ValueError, TypeError):
        return {}


def _move_aside(path: Path) -> str:
    """Rename the damaged index and its side files to ``index.sqlite.damaged-<time>[-n]``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while any(p.exists() for p in (dest, *_sides(dest))):
        dest = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
        n += 1
    for src, dst in zip((path, *_sides(path)), (dest, *_sides(dest)), strict=True):
        if src.exists():
            os.replace(src, dst)
    fsync_dir(path.parent)
    return str(dest)


def _write(tmp: Path, rows: list[tuple]) -> None:
    """A complete index of ``rows`` in ``tmp``, durable (no journal: ``tmp`` is not the index yet)."""
    remove(tmp)
    db = sqlite3.connect(tmp, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute(
            "CREATE TABLE blocks (key TEXT PRIMARY KEY, parent TEXT NOT NULL, context TEXT NOT NULL, "
            "depth INTEGER NOT NULL, nbytes INTEGER NOT NULL, last_access REAL NOT NULL)"
        )
        db.execute("CREATE INDEX blocks_lru ON blocks(last_access, depth)")
        db.execute("BEGIN")
        db.executemany(f"INSERT INTO blocks ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)", rows)
        db.execute("COMMIT")
    finally:
        db.close()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` over ``path``; side files of the old index go first (the new
    one must not inherit a stale WAL)."""
    for side in _sides(path):
        if side.exists():
            side.unlink()
    os.replace(tmp, path)
    fsync_dir(path.parent)

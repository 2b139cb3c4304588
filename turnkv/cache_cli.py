"""``turnkv cache stats | verify | clear | repair``: the KV disk tier's directory, for its user.

``stats`` reads the index (a running server may hold the directory meanwhile) and changes nothing.
``verify``, ``clear`` and ``repair`` need the directory to themselves (stop the server first):
``verify`` reconciles the index with the files and reads every block, checking its checksum and
metadata, and removes the bad ones; ``clear`` removes every block; ``repair`` rebuilds the index
from the block files, verifying each (what a server does at start with an unusable index).

Exit codes: 0 when all was well; 1 when ``verify`` or ``repair`` removed anything (a bad block, a
temp or stray file, a row without its file), and when ``stats`` or ``verify`` find the index
missing (beside block files), empty or damaged: one line says so and names ``repair``; 2 when the
command cannot run (a server holds the directory, an I/O error).
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections import Counter
from pathlib import Path

from turnkv.bank.disk import disk_dir as resolve_disk_dir
from turnkv.bank.disk_blocks import BlockError
from turnkv.bank.disk_index import IndexDamaged, rows_of
from turnkv.bank.disk_store import LocalDirStore, StoreBusy

# counts of what ``verify`` and ``repair`` removed (any of them non-zero: exit code 1)
REMOVED = ("bad", "dropped", "temp_files", "orphan_files", "missing_files", "bad_size", "bad_entries")


def cache_main(action: str, disk_dir: str, as_json: bool) -> int:
    root = resolve_disk_dir(disk_dir)
    try:
        out = _run(action, root)
    except IndexDamaged as exc:  # stats, verify: report it in one line, change nothing
        if as_json:
            print(json.dumps({"dir": str(root), "index": exc.problem, "error": str(exc)}))
        print(f"turnkv: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, sqlite3.Error) as exc:  # unreadable, not a directory, busy: one line, exit 2
        raise ValueError(f"the KV disk cache {root}: {exc}") from None
    if as_json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 1 if action in ("verify", "repair") and any(out.get(k) for k in REMOVED) else 0


def _run(action: str, root: Path) -> dict:
    if action == "stats":
        return stats(root)
    else:
        try:
            store = LocalDirStore(root, repair=action != "verify")  # clear and repair rebuild first
        except StoreBusy:  # its own message suggests serve's flags, which cache does not take
            raise ValueError(
                f"the KV disk cache {root} is in use by another turnkv process; stop it before "
                f"`turnkv cache {action}` (`turnkv cache stats` reads it while a server runs), "
                f"or pass --disk-dir for another directory"
            ) from None
        try:
            return {"verify": verify, "clear": clear, "repair": repair}[action](store)
        finally:
            store.close()


def stats(root: Path) -> dict:
    """Blocks, bytes and models (contexts) in the index; raises ``IndexDamaged``."""
    rows = rows_of(root, "SELECT context, nbytes FROM blocks")
    return {
        "dir": str(root),
        "blocks": len(rows),
        "bytes": sum(n for _, n in rows),
        "contexts": len(Counter(c for c, _ in rows)),  # distinct (model, dtype, geometry) combinations
    }


def verify(store: LocalDirStore) -> dict:
    """Reconcile, then read and check every block; bad blocks are removed."""
    fixed = store.reconcile()
    good = bad = 0
    for info in list(store.iterate()):
        try:
            block = store.get(info.key)
            if block.parent != info.parent or block.context != info.context or block.depth != info.depth:
                raise BlockError("the file disagrees with its index row")
            good += 1
        except BlockError:
            bad += 1
            store.delete(info.key)
    return {"dir": str(store.root), "good": good, "bad": bad, **fixed}


def clear(store: LocalDirStore) -> dict:
    """Remove every block (and any temp or orphaned file)."""
    infos = list(store.iterate())
    for info in infos:
        store.delete(info.key)
    store.reconcile(adopt=False)  # a file that would not unlink must not come back as a block
    return {"dir": str(store.root), "removed_blocks": len(infos), "freed_bytes": sum(i.nbytes for i in infos)}


def repair(store: LocalDirStore) -> dict:
    """Rebuild the index from the block files (the store rebuilt an unusable one on open)."""
    report = store.rebuilt
    index = report.reason if report is not None else "ok"
    if report is None:
        report = store.rebuild()
    return {
        "dir": str(store.root),
        "index": index,
        "kept": report.kept,
        "dropped": report.dropped,
        "other_version": report.other_version,  # removed, not a fault: never looked up since
        "bad_entries": report.bad_entries,
        "temp_files": report.temp_files,
        "seconds": round(report.seconds, 3),
        "moved_to": report.moved_to,
    }

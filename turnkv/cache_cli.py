"""``turnkv cache stats | verify | clear``: the KV disk tier's directory, for its user.

``stats`` reads the index (a running server may hold the directory meanwhile).
``verify`` and ``clear`` need the directory to themselves (stop the server first): ``verify``
reconciles the index with the files and reads every block, checking its checksum and metadata,
and removes the bad ones (exit code 1 when it removed any); ``clear`` removes every block.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from turnkv.bank.disk import disk_dir as resolve_disk_dir
from turnkv.bank.disk_blocks import BlockError
from turnkv.bank.disk_store import LocalDirStore, StoreBusy


def cache_main(action: str, disk_dir: str, as_json: bool) -> int:
    root = resolve_disk_dir(disk_dir)
    if action == "stats":
        out = stats(root)
    else:
        try:
            store = LocalDirStore(root)
        except StoreBusy:  # its own message suggests serve's flags, which cache does not take
            raise ValueError(
                f"the KV disk cache {root} is in use by another turnkv process; stop it before "
                f"`turnkv cache {action}` (`turnkv cache stats` reads it while a server runs), "
                f"or pass --disk-dir for another directory"
            ) from None
        try:
            out = verify(store) if action == "verify" else clear(store)
        finally:
            store.close()
    if as_json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 1 if action == "verify" and out["bad"] else 0


def stats(root: Path) -> dict:
    """Blocks, bytes and models (contexts) in the index."""
    if not (root / "index.sqlite").is_file():
        return {"dir": str(root), "blocks": 0, "bytes": 0, "contexts": 0}
    store = LocalDirStore(root, lock=False)
    try:
        infos = list(store.iterate())
    finally:
        store.close()
    contexts = Counter(i.context for i in infos)
    return {
        "dir": str(root),
        "blocks": len(infos),
        "bytes": sum(i.nbytes for i in infos),
        "contexts": len(contexts),  # distinct (model, dtype, geometry) combinations
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
    store.reconcile()
    return {"dir": str(store.root), "removed_blocks": len(infos), "freed_bytes": sum(i.nbytes for i in infos)}

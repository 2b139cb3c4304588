"""A batch of block files made durable together: written, fsynced, renamed into place.

The disk tier's writer used to pay one file fsync, one directory fsync and one index commit per
block, one block at a time; its rate was a fraction of what the device writes with fsync
(docs/DISK.md, "The writer"). Here a batch of blocks is written to temp files first, each file's
writeback started as soon as its bytes are in (``POSIX_FADV_DONTNEED`` on a dirty file starts the
writeback without waiting), so the device writes them back to back; then every file is fsynced
(by then mostly a wait for I/O already in flight), renamed to its final name, and each distinct
directory fsynced once. The caller commits the index rows only after this returns (one
transaction for the batch): a block is durable before it is visible.

A crash at any moment leaves temp files (removed by reconcile), block files whose rename was
durable but whose row was not committed (adopted by reconcile after they verify), and nothing
half-written under a block's name (renamed only after its fsync). A failure removes what this
batch wrote and raises: nothing of it is visible.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from turnkv.bank.disk_index import fsync_dir

_tmp_ids = itertools.count()
_HOST = socket.gethostname()  # a shared directory has writers on several machines


def _start_writeback(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):  # Linux: starts the writeback of dirty pages, does not wait
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_durable(items: Sequence[tuple[Path, Callable[[Path], None]]]) -> list[int]:
    """Write each ``(final path, write)`` as a file durably (see the module docstring); returns
    the sizes. ``write(temp path)`` writes one file; they run here, one at a time."""
    open_files: list = []
    staged: list[tuple[Path, Path]] = []  # (temp, final)
    renamed: list[Path] = []
    sizes: list[int] = []
    try:
        for final, write in items:
            tmp = final.parent / f".{final.stem}.{_HOST}.{os.getpid()}.{next(_tmp_ids)}.tmp"
            staged.append((tmp, final))
            write(tmp)
            f = open(tmp, "rb")  # closed after its fsync, below
            open_files.append(f)
            _start_writeback(f.fileno())
            sizes.append(os.fstat(f.fileno()).st_size)
        for f in open_files:  # the device has been writing these since their bytes went in
            os.fsync(f.fileno())
            f.close()
        for tmp, final in staged:
            os.replace(tmp, final)
            renamed.append(final)
        for parent in dict.fromkeys(final.parent for _, final in staged):
            fsync_dir(parent)
    except BaseException:
        for f in open_files:
            with contextlib.suppress(OSError):
                f.close()
        for tmp, final in staged:  # nothing of a failed batch stays: no row will name it
            with contextlib.suppress(OSError):
                (final if final in renamed else tmp).unlink()
        raise
    return sizes

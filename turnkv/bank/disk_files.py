"""A batch of block files made durable together: written, fsynced, renamed into place.

The disk tier's writer used to pay one file fsync, one directory fsync and one index commit per
block, one block at a time; its rate was a fraction of what the device writes with fsync
(docs/DISK.md, "The writer"). Here a batch of blocks is written to temp files first, each file's
writeback started as soon as its bytes are in (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: starts
it without waiting), so the device writes them back to back; then every file is fsynced (by then
mostly a wait for I/O already in flight), renamed to its final name, and each distinct directory
fsynced once. The caller commits the index rows only after this returns (one transaction for the
batch): a block is durable before it is visible.

The written pages stay in the page cache (clean after the fsync, reclaimable like any): a replica
on this host that restores the blocks next (a restart, a neighbour taking over a dead one's
conversations) reads them at memory speed. The writer started the writeback with
``POSIX_FADV_DONTNEED`` before, which also drops every page already clean when it runs: on the
2-core CPU VM only 40 % of 16 just-written 32 MiB blocks were still in the page cache (``fincore``),
the rest a restore read from the disk (docs/DISK.md, "The writer").

A crash at any moment leaves temp files (removed by reconcile), block files whose rename was
durable but whose row was not committed (adopted by reconcile after they verify), and nothing
half-written under a block's name (renamed only after its fsync). A failure removes what this
batch wrote and raises: nothing of it is visible.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from turnkv.bank.disk_index import fsync_dir

_tmp_ids = itertools.count()
_HOST = socket.gethostname()  # a shared directory has writers on several machines


_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start the writeback of the range's dirty pages


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux; Python's ``os`` lacks it), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages back without waiting and without dropping them from
    the page cache (where there is no ``sync_file_range`` the fsync after does the whole write)."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a failure is the fsync's to report


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

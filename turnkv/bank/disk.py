"""The disk tier behind the session bank: finished turns written behind, restored after a restart.

The bank calls these methods (see ``SessionBank.tier``; on a server through ``bank.tiers.TierChain``):

- ``write_behind`` / ``write_host`` / ``queued`` / ``flush``: the write-behind, in ``bank.disk_writer``;
- ``extend``: the restore, in ``bank.disk_reader``.

Block keys (``disk_blocks``) chain the model fingerprint, the KV dtype and geometry, the
namespace and every token id before a block's end, so a block is found only by a request of the
same model, dtype and namespace whose tokens agree with it up to the block's last row.

Failures never reach a request: an unusable directory disables the tier at start (logged), a
write error is counted in ``write_failures`` and logged once, a bad block is a miss. A store call
that raises at run time (a damaged ``index.sqlite``, an I/O error) is a miss too: the lookup
finds nothing (the prompt is recomputed) and a write behind is dropped; each is counted in
``faults``, ``/health.disk.degraded`` gives the reason until a lookup goes through the store again (not a miss from the keys in memory),
and one warning is logged when the tier becomes degraded.

Under tensor parallelism every rank has a tier of its own (its KV heads' shard of the same
blocks, in a directory of its own) and every rank's bank must decide alike, so ``agree`` (the
minimum over ranks) is set: a restore takes the run of blocks that every rank holds and read
intact, and a queued write starts copying its rows to host memory at once (on CUDA on a stream
of its own: ``_copy_now``) instead of holding the snapshot until the writer gets to it (what a
queued write holds would otherwise depend on when each rank's writer finishes, and the bank
counts it).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from turnkv.bank.disk_blocks import block_context
from turnkv.bank.disk_log import EveryMinute
from turnkv.bank.disk_reader import LOAD_THREADS, DiskReader
from turnkv.bank.disk_staging import Staging
from turnkv.bank.disk_store import BlockStore, LocalDirStore
from turnkv.bank.disk_writer import QUEUE_BLOCKS, WRITERS, DiskWriter
from turnkv.kv.cache import KVShape

log = logging.getLogger(__name__)

DISK_KEYS = (
    "blocks",
    "bytes",
    "budget_bytes",
    "queued",
    "writes",
    "write_failures",
    "dropped_writes",
    "hits",
    "misses",
    "hit_tokens",
    "corrupt",
    "vanished",
    "evictions",
    "dedupe_hits",
    "faults",
)


def default_disk_dir() -> Path:
    """``$XDG_CACHE_HOME/turnkv/kv``, else ``~/.cache/turnkv/kv``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "turnkv" / "kv"


def disk_dir(directory: str | os.PathLike | None) -> Path:
    """The directory ``--disk-dir`` names (``~`` expanded), or ``default_disk_dir()``."""
    return Path(directory).expanduser() if directory else default_disk_dir()


def disabled_health() -> dict:
    """``/health.disk`` without a tier: ``enabled: false``, nothing degraded and zeros."""
    return {"enabled": False, "degraded": None, "restore_gbps": 0.0, **dict.fromkeys(DISK_KEYS, 0)}


@dataclass
class DiskStats:
    writes: int = 0  # blocks written
    write_failures: int = 0  # blocks whose write failed (disk full, I/O error)
    dropped_writes: int = 0  # blocks not queued because the queue was full
    hits: int = 0  # admissions the tier extended
    misses: int = 0  # admissions with whole blocks beyond memory that the tier could not extend
    hit_tokens: int = 0  # rows loaded from disk into admitted turns
    corrupt: int = 0  # blocks whose bytes failed verification (checksum, truncated, foreign), removed
    vanished: int = 0  # blocks looked up and gone by their read (file or row deleted): a clean miss
    evictions: int = 0  # blocks removed for the byte budget
    dedupe_hits: int = 0  # blocks not written because the store already held them
    faults: int = 0  # store calls that raised at run time: each lookup a miss, each write dropped
    restore_bytes: int = 0  # bytes of the restores that loaded rows ...
    restore_s: float = 0.0  # ... and their time (lookup, reads, checks, the copies' launch)


@dataclass
class DiskTier(DiskReader, DiskWriter):
    """Write-behind and restore of 256-token blocks in a :class:`BlockStore`; thread-safe."""

    store: BlockStore
    fingerprint: str
    shape: KVShape
    budget_bytes: int
    queue_blocks: int = QUEUE_BLOCKS
    load_threads: int = LOAD_THREADS
    writers: int = WRITERS
    batch_blocks: int | None = None  # blocks per batch (None: BATCH_BYTES' worth; 1: one per fsync)
    stats: DiskStats = field(default_factory=DiskStats)
    name = "disk"
    # tensor parallelism: the minimum of a count over every rank (a collective that every rank's
    # bank reaches at the same admission); see the module docstring
    agree: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        self.context = block_context(self.fingerprint, self.shape)
        self._cv = threading.Condition()
        self._warned: set[str] = set()
        self._every = EveryMinute(log)  # warnings that could repeat per block
        self.degraded: str | None = None  # why the last store call raised (None: the store answers)
        self._pool: ThreadPoolExecutor | None = None  # the readers (``DiskReader._readers``)
        # a CUDA restore's pinned ring, allocated now: the first restore must not pay for pinning
        cuda = torch.device(self.shape.device).type == "cuda"
        self._staging = Staging(self.shape, self.load_threads) if cuda else None
        self._start_writers()

    @classmethod
    def open(
        cls, where: str | os.PathLike | BlockStore, fingerprint: str, shape: KVShape, budget_bytes: int, **kw
    ):
        """A tier over ``where`` (a ``BlockStore``, or a directory: ``LocalDirStore``), reconciled
        and fitted to ``budget_bytes``. Raises ``StoreBusy`` or ``OSError``/``sqlite3.Error`` for a
        directory it cannot use. A store that fails its first eviction (a Redis that does not
        answer) still opens, degraded: its calls are faults until it answers."""
        store = where if hasattr(where, "get") else LocalDirStore(where)
        fixed = store.reconcile()
        tier = cls(store, fingerprint, shape, budget_bytes, **kw)
        tier.stats.corrupt += fixed["bad_size"]
        tier.stats.vanished += fixed["missing_files"]
        try:
            tier.stats.evictions += store.evict(budget_bytes)
        except Exception as exc:
            tier._fault("the store at start", exc)
        if any(fixed.values()):
            log.warning("KV disk cache %s reconciled at start: %s", where, fixed)
        return tier

    # -- reporting --------------------------------------------------------------------------------
    def health(self) -> dict:
        """``/health.disk``: ``enabled`` and the counters of ``DISK_KEYS``."""
        with self._cv:
            facts = asdict(self.stats) | {"queued": self._queued}
        facts |= {"blocks": self.store.count, "bytes": self.store.nbytes, "budget_bytes": self.budget_bytes}
        rate = facts["restore_bytes"] / facts["restore_s"] / 1e9 if facts["restore_s"] > 0 else 0.0
        return {"enabled": True, "degraded": self.degraded, "restore_gbps": round(rate, 3)} | {
            k: int(facts[k]) for k in DISK_KEYS
        }

    def _fault(self, what: str, exc: BaseException) -> None:
        """A store call raised: its caller takes it as a miss (or drops the write). Counted, the
        reason on ``/health.disk.degraded``, one warning when the tier becomes degraded."""
        reason = f"{what} failed: {type(exc).__name__}: {exc}"
        with self._cv:
            self.stats.faults += 1
            first, self.degraded = self.degraded is None, reason
        if first:
            log.warning(
                "KV disk cache degraded: %s; lookups are misses (prompts are recomputed) and writes "
                "are dropped while the store fails (disk.degraded, disk.faults)",
                reason,
            )
        else:
            log.debug("KV disk cache: %s", reason)

    def _answers(self) -> None:
        """A lookup went through the store without a fault: it is no longer degraded."""
        if self.degraded is not None:
            with self._cv:
                self.degraded = None
            log.warning("KV disk cache: the store answers again; no longer degraded")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind in self._warned:
            log.debug(message)
            return
        self._warned.add(kind)
        log.warning(message)


def open_tier(
    directory: str | os.PathLike | None,
    fingerprint: str,
    shape: KVShape,
    budget_bytes: int,
    store: str = "",
    suffix: str = "",
    **kw,
) -> DiskTier | None:
    """``DiskTier.open`` for the server over ``--disk-store`` (``shared_stores.open_store``; ``""``:
    this process's ``--disk-dir``): a store it cannot use disables the tier (one warning)."""
    try:
        if store:
            from turnkv.bank.shared_stores import open_store

            where = open_store(store, suffix)
        else:
            where = disk_dir(directory)
        return DiskTier.open(where, fingerprint, shape, budget_bytes, **kw)
    except Exception as exc:  # busy, unwritable, not a directory, a broken index
        log.warning("KV disk cache disabled: %s (%s)", exc, type(exc).__name__)
        return None


def rank_dir(directory: str | os.PathLike | None, size: int, rank: int | str) -> Path:
    """The disk tier of rank ``rank`` of a tensor-parallel group of ``size`` under ``--disk-dir``
    (each rank holds its KV heads' shard of every block; ``rank`` "*" names them all)."""
    return disk_dir(directory) / f"tp{size}-rank{rank}"

"""The session bank: finished turns kept under a byte budget, found again by their token ids.

A client resends the whole conversation every turn. The bank recognises it by tokens: a radix tree
per cache namespace (API key + ``cache_salt``) maps every banked token sequence, and a request gets
the longest common prefix with *anything* banked in its namespace, at token granularity. The hit is
``snapshot.prefix(n)``: for the segmented layout a list of references (the last one may cover only
part of a segment), so a follow-up, a fork, a regeneration and an edit of an earlier turn all
restore without copying a row.

Memory is counted as *unique* bytes over the bank and the live requests (a segment held by many
snapshots counts once); the layout supplies that measure. Admission prices a turn before it does
any work: new prompt rows + reserved output rows, times bytes per row, plus prefill activations,
plus, when the layout copies on restore (``contiguous``), the restored history. It evicts idle
entries least recently used to make room, and refuses (:class:`Refused`, HTTP 507) when even that
would not be enough -- in which case nothing is evicted.

Invariants:
- Rows a live request restored are never freed: its :class:`Lease` holds (and the accounting
  counts) the prefix it restored. An entry in use -- one whose every row a live request
  continues from -- is pinned and never evicted; an entry that shares only a prefix with the
  request (a fork, a regeneration, a shared system prompt) may lose the rest of its rows.
- With a session id, a session's newest entry is never evicted (its older ones may be).
- A refusal evicts nothing.
- Entries are keyed by tokens only; the session id never decides what matches.
- An entry whose tokens are a strict prefix of another idle entry's in the same namespace is
  dropped when the longer one is banked (everything it could serve, the longer one serves).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from turnkv.bank.token_index import TokenIndex
from turnkv.kv.cache import KVCache, Snapshot

# Measures the unique bytes of KV rows held by snapshots and live caches (each segment once).
Measure = Callable[[Iterable[object]], int]

AUTO_SHARE_CUDA = 0.80  # of the device memory free after the weights are loaded
AUTO_SHARE_CPU = 0.50  # of the RAM the OS reports available at start
LOOKUP_CANDIDATES = 16  # entries weighed when several share the longest prefix


class LowerTier(Protocol):
    """A slower store of KV rows behind the bank (``turnkv.bank.disk.DiskTier``).

    ``extend`` returns a snapshot of more leading rows of ``tokens`` than ``prefix`` holds (``prefix``
    possibly cut shorter, plus rows it loaded), or None; it never returns rows it did not verify.
    ``write_behind`` queues a finished turn's rows and returns at once. ``held`` lists the
    snapshots its queued writes keep alive. ``health`` is ``/health.disk``; ``close`` finishes the
    queued writes.
    """

    def extend(self, namespace: str, tokens: Sequence[int], prefix: Snapshot | None) -> Snapshot | None: ...

    def write_behind(self, namespace: str, snapshot: Snapshot) -> None: ...

    def held(self) -> list[Snapshot]: ...

    def health(self) -> dict: ...

    def close(self) -> None: ...


class Refused(Exception):
    """A turn that cannot fit the budget even after evicting every idle entry (HTTP 507)."""

    def __init__(self, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(
            f"KV memory exhausted: this turn needs {needed_bytes} bytes but only {available_bytes} "
            f"bytes of the bank budget can be freed; retry with a shorter prompt or a smaller max_tokens"
        )
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


@dataclass
class BankEntry:
    """One banked snapshot. ``last_used`` is a logical clock (larger is more recent)."""

    id: int
    namespace: str
    snapshot: Snapshot
    tokens: tuple[int, ...]
    last_used: int
    in_use: int = 0


@dataclass
class Lease:
    """An admitted turn: what it restores from, what it was priced, and its live cache.

    ``snapshot`` is ``None`` on a miss; otherwise it holds the first ``cached`` tokens of the prompt.
    ``snapshot`` stays counted until :meth:`SessionBank.finish`; the entry it came from is pinned
    until then when the request uses all of its rows (``pinned``).
    """

    namespace: str
    session: str | None
    entry_id: int | None
    cached: int
    snapshot: Snapshot | None
    needed_bytes: int
    pinned: bool = False
    live: KVCache | None = None
    done: bool = False

    def attach(self, cache: KVCache) -> None:
        """Count this live cache in the bank's unique bytes until the turn finishes."""
        self.live = cache


@dataclass
class BankStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refusals: int = 0
    inserts: int = 0
    hit_tokens: int = 0  # prompt tokens served from the bank
    query_tokens: int = 0  # prompt tokens of every admitted or refused turn
    peak_bytes: int = 0  # most unique bytes seen at the end of a turn (bank + live + new snapshot)


@dataclass
class SessionBank:
    """Banked snapshots per namespace under ``budget_bytes`` of unique KV memory.

    ``measure`` returns the unique bytes of a collection of snapshots and live caches (the layout's
    ``unique_bytes``); ``bytes_per_row`` is one token across all layers; ``copy_on_restore`` makes
    admission price the restored history (the contiguous layout copies it). ``tier`` (optional):
    admission asks it to extend the memory hit (rows it loads are held by the lease and priced
    like the rest of the restored prefix), every finished turn is written behind to it, and the
    snapshots its queue holds count as used memory.
    """

    budget_bytes: int
    bytes_per_row: int
    measure: Measure
    copy_on_restore: bool = False
    stats: BankStats = field(default_factory=BankStats)
    tier: LowerTier | None = None

    def __post_init__(self) -> None:
        self._entries: dict[int, BankEntry] = {}
        self._index: dict[str, TokenIndex] = {}
        self._leases: list[Lease] = []
        self._newest: dict[tuple[str, str], int] = {}  # (namespace, session) -> protected entry
        self._next_id = 0
        self._clock = 0
        self._lock = threading.RLock()

    # -- reading ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[BankEntry]:
        with self._lock:
            return list(self._entries.values())

    def view(self) -> tuple[list[BankEntry], list[Lease], set[int]]:
        """One consistent read for status pages: (entries, live leases, protected entry ids)."""
        with self._lock:
            return list(self._entries.values()), list(self._leases), self._protected()

    def unique_bytes(self, live: bool = True) -> int:
        """Unique KV bytes of every banked snapshot (and, with ``live``, every live cache)."""
        with self._lock:
            held: list[object] = [e.snapshot for e in self._entries.values()]
            if live:
                held += self._lease_held()
            return self.measure(held)

    def lookup(self, namespace: str, tokens: Sequence[int]) -> tuple[int, BankEntry | None]:
        """Longest banked prefix of ``tokens`` in ``namespace``: (n, the entry to restore it from).

        Several entries may share those ``n`` tokens (a system prompt, forks). The one chosen makes
        ``prefix(n)`` keep the least memory alive beyond what is kept anyway (protected entries,
        live turns) -- a prefix inside a large merged segment holds the whole segment -- and among
        equals the most recent; only the ``LOOKUP_CANDIDATES`` most recent are weighed.
        """
        with self._lock:
            index = self._index.get(namespace)
            if index is None or not tokens:
                return 0, None
            n, ids = index.longest(tokens)
            if n == 0 or not ids:
                return 0, None
            recent = sorted((self._entries[i] for i in ids), key=lambda e: -e.last_used)
            if len(recent) == 1:
                return n, recent[0]
            cut = min(n, max(len(tokens) - 1, 0))  # what admission restores
            kept = [self._entries[i].snapshot for i in self._protected() if i in self._entries]
            kept += self._lease_held()
            return n, min(
                recent[:LOOKUP_CANDIDATES], key=lambda e: self.measure([*kept, e.snapshot.prefix(cut)])
            )

    # -- admission ----------------------------------------------------------------------------
    def admit(
        self,
        namespace: str,
        tokens: Sequence[int],
        reserve_rows: int,
        activation_bytes: Callable[[int, int], int] | None = None,
        session: str | None = None,
    ) -> Lease:
        """Price the turn, evict idle entries to make room, hold the hit; raise :class:`Refused`.

        The prompt's last row is always recomputed (its logits start the answer), so at most
        ``len(tokens) - 1`` rows are restored. ``activation_bytes(new_rows, history_rows)`` is the
        transient prefill memory.
        """
        with self._lock:
            self.stats.query_tokens += len(tokens)
            n, entry = self.lookup(namespace, tokens)
            cached = min(n, max(len(tokens) - 1, 0))
            if entry is not None and cached == 0:
                entry = None
            prefix = entry.snapshot.prefix(cached) if entry is not None else None
            if self.tier is not None:
                prefix, cached = self._extend(namespace, tokens, prefix, cached)
            new_rows = len(tokens) - cached
            needed = (new_rows + reserve_rows) * self.bytes_per_row
            if activation_bytes is not None:
                needed += activation_bytes(new_rows, cached)
            if self.copy_on_restore:
                needed += cached * self.bytes_per_row
            pin = entry is not None and cached == len(entry.tokens)
            self._make_room(needed, {entry.id} if pin else set(), prefix)  # or Refused, evicting nothing
            if entry is not None:
                entry.in_use += pin
                self._touch(entry)
                self.stats.hits += 1
                self.stats.hit_tokens += cached
            else:
                self.stats.misses += 1
            lease = Lease(
                namespace=namespace,
                session=session,
                entry_id=entry.id if entry is not None else None,
                cached=cached,
                snapshot=prefix,
                needed_bytes=needed,
                pinned=pin,
            )
            self._leases.append(lease)
            return lease

    def finish(self, lease: Lease, snapshot: Snapshot | None = None) -> int | None:
        """End a turn: bank ``snapshot`` (if any), unpin the entry it restored from, drop its cache.

        Returns the id of the entry now holding the turn (None if nothing was banked). Idempotent.
        """
        with self._lock:
            if lease.done:
                return None
            lease.done = True
            held: list[object] = [e.snapshot for e in self._entries.values()]
            held += self._lease_held()
            if snapshot is not None:
                held.append(snapshot)
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.measure(held))
            eid = None
            if snapshot is not None and snapshot.num_tokens > 0:
                eid = self._insert(lease.namespace, snapshot, lease.session)
            if lease.pinned and lease.entry_id in self._entries:
                self._entries[lease.entry_id].in_use -= 1
            self._leases.remove(lease)
            lease.live = None
            lease.snapshot = None
            if eid is not None:
                self._drop_superseded(lease.namespace, eid)
                if self.tier is not None:
                    self.tier.write_behind(lease.namespace, snapshot)
            self._fit_budget()
            return eid

    def insert(self, namespace: str, snapshot: Snapshot, session: str | None = None) -> int:
        """Bank a snapshot outside a turn (tests, warm-up). Returns its entry id."""
        with self._lock:
            eid = self._insert(namespace, snapshot, session)
            self._drop_superseded(namespace, eid)
            self._fit_budget()
            return eid

    # -- internals ----------------------------------------------------------------------------
    def _extend(
        self, namespace: str, tokens: Sequence[int], prefix: Snapshot | None, cached: int
    ) -> tuple[Snapshot | None, int]:
        """The memory prefix, or the tier's longer one (at most ``len(tokens) - 1`` rows)."""
        assert self.tier is not None
        longer = self.tier.extend(namespace, tokens[: max(len(tokens) - 1, 0)], prefix)
        if longer is None or longer.num_tokens <= cached:
            return prefix, cached
        return longer, longer.num_tokens

    def _touch(self, entry: BankEntry) -> None:
        self._clock += 1
        entry.last_used = self._clock

    def _insert(self, namespace: str, snapshot: Snapshot, session: str | None) -> int:
        tokens = tuple(snapshot.tokens)
        index = self._index.setdefault(namespace, TokenIndex())
        n, ids = index.longest(tokens)
        covering = [self._entries[i] for i in ids if len(self._entries[i].tokens) >= n] if n else []
        if n == len(tokens) and covering:
            # an entry already holds all these tokens (e.g. a regeneration stopped early): keep it
            entry = max(covering, key=lambda e: e.last_used)
        else:
            self._next_id += 1
            entry = BankEntry(self._next_id, namespace, snapshot, tokens, last_used=0)
            self._entries[entry.id] = entry
            index.insert(tokens, entry.id)
            self.stats.inserts += 1
        self._touch(entry)
        if session:
            self._newest[(namespace, session)] = entry.id
        return entry.id

    def _drop_superseded(self, namespace: str, by: int) -> None:
        """Remove idle entries whose tokens are a strict prefix of entry ``by``'s; a session that
        protected one of them now protects ``by`` (it serves every prompt they could)."""
        longer = self._entries[by]
        for eid in self._index[namespace].prefixes_of(longer.tokens):
            e = self._entries[eid]
            if len(e.tokens) < len(longer.tokens) and e.in_use == 0:
                for key, protected in list(self._newest.items()):
                    if protected == eid:
                        self._newest[key] = by
                self._remove(e)

    def _protected(self) -> set[int]:
        pinned = {e.id for e in self._entries.values() if e.in_use > 0}
        return pinned | set(self._newest.values())

    def _lease_held(self) -> list[object]:
        """What live turns keep alive: their restored prefixes and their caches."""
        held: list[object] = [ls.snapshot for ls in self._leases if ls.snapshot is not None]
        if self.tier is not None:
            held += self.tier.held()
        return held + [ls.live for ls in self._leases if ls.live is not None]

    def _used(self, keep: Iterable[BankEntry], extra: object | None = None) -> int:
        held: list[object] = [e.snapshot for e in keep] + self._lease_held()
        if extra is not None:
            held.append(extra)
        # other admitted turns have not grown into their reservation yet: count it as used
        reserved = sum(ls.needed_bytes for ls in self._leases)
        return self.measure(held) + reserved

    def _make_room(self, needed: int, pinned: set[int], prefix: Snapshot | None = None) -> None:
        """Evict idle entries until ``needed`` fits beside everything kept (``prefix`` included)."""
        protected = self._protected() | pinned
        floor = self._used((e for e in self._entries.values() if e.id in protected), prefix)
        if floor + needed > self.budget_bytes:
            self.stats.refusals += 1
            raise Refused(needed, max(self.budget_bytes - floor, 0))
        self._evict_until(needed, protected, prefix)

    def _fit_budget(self) -> None:
        self._evict_until(0, self._protected())

    def _evict_until(self, needed: int, protected: set[int], prefix: Snapshot | None = None) -> None:
        idle = sorted((e for e in self._entries.values() if e.id not in protected), key=lambda e: e.last_used)
        while idle and self._used(self._entries.values(), prefix) + needed > self.budget_bytes:
            self._remove(idle.pop(0))
            self.stats.evictions += 1

    def _remove(self, entry: BankEntry) -> None:
        del self._entries[entry.id]
        index = self._index[entry.namespace]
        index.remove(entry.tokens, entry.id)
        if index.empty:
            del self._index[entry.namespace]
        for key, eid in list(self._newest.items()):
            if eid == entry.id:
                del self._newest[key]


def auto_budget_bytes(device: torch.device | str) -> int:
    """``--bank-bytes auto``: 80 % of the CUDA memory free now (call it after loading the weights),
    or 50 % of the RAM the OS reports available on any other device."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * AUTO_SHARE_CUDA)
    return int(_available_ram() * AUTO_SHARE_CPU)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

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
plus, when the layout copies on restore (``contiguous``), the restored history, plus rows a hit
copies (below). It evicts idle entries least recently used to make room, and refuses
(:class:`Refused`, HTTP 507) only when evicting every evictable entry would still not be enough --
in which case nothing is evicted.

Admission, in order (the first that fits wins):
1. the hit restored by reference (zero-copy), evicting nothing;
2. short references detached (``bank.detach``: a hit using less than half of an otherwise idle
   segment copies its rows instead of pinning the segment), evicting unprotected idle entries;
3. every partial reference into an evictable segment detached, evicting unprotected idle entries,
   then session-protected ones. Its floor is what nothing may evict (live turns, the entries they
   continue, the disk tier's queued writes), so a refusal here means the turn cannot fit now.
   If it would fit once the disk tier's writes are done, admission waits for them; if it would
   fit once the live turns finish, ``admit(wait=True)`` raises :class:`MustWait` (the scheduler
   keeps the turn queued).
A turn without an explicit ``max_tokens`` (``min_reserve_rows``) gets the largest reservation the
budget can hold in plan 3, up to what it asked.

Invariants:
- Rows a live request restored are never freed: its :class:`Lease` holds (and the accounting
  counts) the prefix it restored. An entry in use -- one whose every row a live request
  continues from by reference -- is pinned and never evicted; an entry that shares only a prefix
  with the request (a fork, a regeneration, a shared system prompt) may lose the rest of its rows.
- With a session id, a session's newest entry is evicted only after every unprotected idle
  entry, while the session is younger than ``session_ttl_s`` and within ``session_share`` of the
  budget (``bank.sessions``); protection never refuses a turn.
- A refusal evicts nothing.
- Entries are keyed by tokens only; the session id never decides what matches.
- An entry whose tokens are a strict prefix of another idle entry's in the same namespace is
  dropped when the longer one is banked (everything it could serve, the longer one serves).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from turnkv.bank.breaks import NOT_READ, CacheBreak, Evicted, decide, siblings
from turnkv.bank.detach import held_segment_ids, plan_detach
from turnkv.bank.ledger import SegmentLedger
from turnkv.bank.records import (  # the records are this module's public names too
    AdmissionPlan,
    BankEntry,
    BankStats,
    Lease,
    Measure,
    MustWait,
    Refused,
    Reservation,
)
from turnkv.bank.sessions import SessionGuard
from turnkv.bank.tiers import Tier, extend_by_tier
from turnkv.bank.token_index import TokenIndex
from turnkv.kv.cache import Snapshot

LOOKUP_CANDIDATES = 16  # entries weighed when several share the longest prefix
SESSION_TTL_S = 600.0  # default protection of a session's newest entry after its last turn
SESSION_SHARE = 0.5  # default share of the budget all protected entries together may hold
TIER_WAIT_S = 10.0  # longest admission waits for the disk tier's queued writes to free their rows


@dataclass
class SessionBank:
    """Banked snapshots per namespace under ``budget_bytes`` of unique KV memory.

    ``measure`` returns the unique bytes of a collection of snapshots and live caches (the layout's
    ``unique_bytes``); ``bytes_per_row`` is one token across all layers; ``copy_on_restore`` makes
    admission price the restored history (the contiguous layout copies it). ``session_ttl_s`` and
    ``session_share`` bound session protection (``bank.sessions``); ``clock`` is its time source.
    ``tier`` (optional): admission asks it to extend the memory hit (rows it loads are held by the
    lease and priced like the rest of the restored prefix), every finished turn is written behind
    to it, and the snapshots its queue holds count as used memory.
    """

    budget_bytes: int
    bytes_per_row: int
    measure: Measure
    copy_on_restore: bool = False
    session_ttl_s: float = SESSION_TTL_S
    session_share: float = SESSION_SHARE
    clock: Callable[[], float] = time.monotonic
    stats: BankStats = field(default_factory=BankStats)
    tier: Tier | None = None

    def __post_init__(self) -> None:
        self._entries: dict[int, BankEntry] = {}
        self._index: dict[str, TokenIndex] = {}
        self._leases: list[Lease] = []
        self._ledger = SegmentLedger()  # unique bytes of the entries, kept as they come and go
        self._evicted = Evicted()  # token ids of evicted entries: an eviction is a cache break's reason
        self._sessions = SessionGuard(self.session_ttl_s, self.session_share, self.clock)
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
            return list(self._entries.values()), list(self._leases), self._kept_ids()

    def unique_bytes(self, live: bool = True) -> int:
        """Unique KV bytes of every banked snapshot (and, with ``live``, every live cache)."""
        with self._lock:
            return self._ledger.total + (self._ledger.beside(self._lease_held()) if live else 0)

    def check_integrity(self) -> None:
        """Raise unless the running byte count equals a full re-measure of the entries."""
        with self._lock:
            snaps = [e.snapshot for e in self._entries.values()]
            self._ledger.check(snaps)
            if self.measure(snaps) != self._ledger.total:
                raise AssertionError("bank ledger disagrees with the layout's measure")

    def protected(self) -> set[int]:
        """Ids of the entries session protection holds now (see ``bank.sessions``)."""
        with self._lock:
            snaps = {i: e.snapshot for i, e in self._entries.items()}
            return self._sessions.protected(snaps, self.measure, self.budget_bytes)

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
            kept = [self._entries[i].snapshot for i in self._kept_ids() if i in self._entries]
            kept += self._lease_held()
            return n, min(
                recent[:LOOKUP_CANDIDATES], key=lambda e: self.measure([*kept, e.snapshot.prefix(cut)])
            )

    # -- admission ----------------------------------------------------------------------------
    def admit(
        self,
        namespace: str,
        tokens: Sequence[int],
        want: Reservation,
        session: str | None = None,
        wait: bool = False,
        reuse: bool = True,
    ) -> Lease:
        """Price the turn, evict entries to make room, hold the hit; raise :class:`Refused`.

        The prompt's last row is always recomputed (its logits start the answer), so at most
        ``len(tokens) - 1`` rows are restored. ``want.activation(new_rows, history_rows)`` is the
        transient prefill memory. With ``want.least`` the output reservation may shrink from
        ``want.rows`` down to that many rows to fit (``Lease.reserve_rows`` says what was granted).
        See the module docstring for the order in which admission tries to fit. When only the rows
        the disk tier's queued writes still hold stand in the way, admission waits (at most
        ``TIER_WAIT_S``, the bank unlocked) for those writes and tries once more. With ``wait``, a
        turn that fits once the live turns have finished raises :class:`MustWait` instead (the
        scheduler keeps it queued; DESIGN: "if it would fit once running turns finish, it waits").
        Without ``reuse`` nothing cached is read (no prefix, no tier; the break is ``not_read``):
        a turn that needs every prompt row's logits (the prompt's logprobs).
        """
        args = (namespace, tokens, want, session, reuse)
        with self._lock:
            self.stats.query_tokens += len(tokens)
        try:
            return self._admit(*args)
        except Refused as e:
            refused = e
        if wait and refused.after_running:
            raise MustWait(refused.needed_bytes, refused.available_bytes)
        if refused.writes_pending and self.tier is not None:
            self.tier.flush(TIER_WAIT_S)  # written rows are no longer held by the tier
            try:
                return self._admit(*args)
            except Refused as e:
                refused = e
        self.stats.refusals += 1
        raise refused

    def _admit(
        self,
        namespace: str,
        tokens: Sequence[int],
        want: Reservation,
        session: str | None,
        reuse: bool = True,
    ) -> Lease:
        with self._lock:
            self._sessions.touch(namespace, session)
            n, entry = self.lookup(namespace, tokens) if reuse else (0, None)
            cached = min(n, max(len(tokens) - 1, 0))
            if entry is not None and cached == 0:
                entry = None
            prefix = entry.snapshot.prefix(cached) if entry is not None else None
            restored: dict[str, int] = {}
            if self.tier is not None and reuse:
                prefix, cached, restored = self._extend(namespace, tokens, prefix, cached)
            whole = entry is not None and cached == len(entry.tokens)

            forks = want.choices - 1  # each restores the prompt but its last row, recomputed

            def price(copied: int) -> int:
                new_rows = len(tokens) - cached
                rows = new_rows + copied + (cached if self.copy_on_restore else 0)
                rows += forks * (1 + (len(tokens) - 1 if self.copy_on_restore else 0))
                act = want.activation(new_rows, cached) if want.activation is not None else 0
                return rows * self.bytes_per_row + act

            plans = self._plans(prefix, entry if whole else None, price)
            last = plans[-1]
            reserve_rows = want.rows
            least = reserve_rows if want.least is None else min(want.least, reserve_rows)
            per_row = self.bytes_per_row * want.choices  # a reserved answer row of every choice
            room = (self.budget_bytes - last.floor - last.fixed) // per_row
            if room < least:
                e = Refused(last.fixed + least * per_row, max(self.budget_bytes - last.floor, 0))
                # would it fit once the disk tier's queued writes let go of their rows?
                writing = self.measure(self.tier.held()) if self.tier is not None else 0
                e.writes_pending = room + writing // self.bytes_per_row >= least and writing > 0
                # ... or once the live turns (their rows, reservations and the entries they pin)
                # have finished, everything else evicted?
                alone = self.measure([last.detach.referenced] if last.detach else [prefix] if prefix else [])
                free = (self.budget_bytes - alone - last.fixed) // per_row
                e.after_running = bool(self._leases) and free >= least
                raise e
            reserve = min(reserve_rows, room)
            needed, plan = 0, last
            for plan in plans:
                needed = plan.fixed + reserve * per_row
                if plan.floor + needed <= self.budget_bytes:
                    break
            self._evict_until(needed, plan.order, plan.detach.referenced if plan.detach else prefix)
            copied = plan.detach.copied_rows if plan.detach else 0
            if plan.detach is not None:
                prefix = plan.detach.build()
            pin = whole and copied == 0
            if entry is not None and entry.id in self._entries:
                entry.in_use += pin
                self._touch(entry)
            if entry is not None:
                self.stats.hits += 1
                self.stats.hit_tokens += cached
                self.stats.copied_rows += copied
            else:
                self.stats.misses += 1
            lease = Lease(
                namespace=namespace,
                session=session,
                entry_id=entry.id if entry is not None else None,
                cached=cached,
                snapshot=prefix,
                needed_bytes=needed,
                reserve_rows=reserve,
                copied_rows=copied,
                pinned=pin,
                cache_break=self._count(
                    self._break(namespace, tokens, cached, n, entry, restored) if reuse else NOT_READ
                ),
                fork_bytes=(reserve + 1) * self.bytes_per_row if forks else 0,
            )
            self._leases.append(lease)
            return lease

    def _break(
        self,
        namespace: str,
        tokens: Sequence[int],
        cached: int,
        n: int,
        entry: BankEntry | None,
        restored: dict[str, int],
    ) -> CacheBreak:
        """Why this admission's restored prefix ends at ``cached`` (``bank.breaks``)."""
        limit = tokens[: max(len(tokens) - 1, 0)]
        others = siblings(namespace, list(self._index))
        elsewhere = max((self._index[ns].longest(limit)[0] for ns in others), default=0)
        evicted = self._evicted.longest(namespace, limit)
        return decide(
            tokens, cached, n, entry.tokens if entry is not None else None, evicted, elsewhere, restored
        )

    def _count(self, brk: CacheBreak) -> CacheBreak:
        self.stats.breaks[brk.reason] = self.stats.breaks.get(brk.reason, 0) + 1
        return brk

    def fork(self, lease: Lease, prefix: Snapshot, k: int) -> list[Lease]:
        """``k`` leases continuing from ``prefix`` (the prompt ``lease``'s turn prefilled, by
        reference: no row is copied), each taking its share of what ``lease`` was priced for
        (``Reservation.choices``). They bank under no session: a session's entry stays the turn's."""
        with self._lock:
            lease.needed_bytes -= lease.fork_bytes * k
            forks = [
                Lease(
                    namespace=lease.namespace,
                    session=None,
                    entry_id=None,
                    cached=prefix.num_tokens,
                    snapshot=prefix,
                    needed_bytes=lease.fork_bytes,
                    reserve_rows=lease.reserve_rows,
                )
                for _ in range(k)
            ]
            self._leases += forks
            return forks

    def _plans(
        self, prefix: Snapshot | None, whole: BankEntry | None, price: Callable[[int], int]
    ) -> list[AdmissionPlan]:
        """The three ways to admit of the module docstring, cheapest in copies first."""
        in_use = {e.id for e in self._entries.values() if e.in_use > 0}
        sessions = self.protected()
        lru = sorted(self._entries.values(), key=lambda e: e.last_used)
        plans = [AdmissionPlan(None, set(self._entries), [], 0, price(0))]
        for keep, every in ((in_use | sessions, False), (in_use, True)):
            detach = None
            if prefix is not None and hasattr(prefix, "refs"):
                held = [self._entries[i].snapshot for i in keep] + self._lease_held()
                detach = plan_detach(prefix, held_segment_ids(held), every)  # type: ignore[arg-type]
            if whole is not None and (detach is None or detach.copied_rows == 0):
                keep = keep | {whole.id}  # used whole by reference: pinned
            order = [e for e in lru if e.id not in keep and e.id not in sessions]
            order += [e for e in lru if e.id not in keep and e.id in sessions]
            plans.append(AdmissionPlan(detach, keep, order, 0, price(detach.copied_rows if detach else 0)))
        for plan in plans:
            kept = [e for e in self._entries.values() if e.id in plan.keep]
            plan.floor = self._used(kept, plan.detach.referenced if plan.detach else prefix)
        return plans

    def finish(self, lease: Lease, snapshot: Snapshot | None = None) -> int | None:
        """End a turn: bank ``snapshot`` (if any), unpin the entry it restored from, drop its cache.

        Returns the id of the entry now holding the turn (None if nothing was banked). Idempotent.
        """
        with self._lock:
            if lease.done:
                return None
            lease.done = True
            held = self._lease_held() + ([snapshot] if snapshot is not None else [])
            self.stats.peak_bytes = max(self.stats.peak_bytes, self._ledger.total + self._ledger.beside(held))
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
    ) -> tuple[Snapshot | None, int, dict[str, int]]:
        """The memory prefix, or the tier's longer one (at most ``len(tokens) - 1`` rows), and the
        rows each tier restored."""
        assert self.tier is not None
        longer, restored = extend_by_tier(self.tier, namespace, tokens[: max(len(tokens) - 1, 0)], prefix)
        if longer is None or longer.num_tokens <= cached:
            return prefix, cached, {}
        return longer, longer.num_tokens, restored

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
            self._ledger.add(snapshot)
            index.insert(tokens, entry.id)
            self.stats.inserts += 1
        self._touch(entry)
        self._sessions.mark(namespace, session, entry.id)
        return entry.id

    def _drop_superseded(self, namespace: str, by: int) -> None:
        """Remove idle entries whose tokens are a strict prefix of entry ``by``'s; a session that
        protected one of them now protects ``by`` (it serves every prompt they could)."""
        longer = self._entries[by]
        for eid in self._index[namespace].prefixes_of(longer.tokens):
            e = self._entries[eid]
            if len(e.tokens) < len(longer.tokens) and e.in_use == 0:
                self._sessions.moved(eid, by)
                self._remove(e)

    def _kept_ids(self) -> set[int]:
        """Entries kept ahead of LRU eviction: in use by a live turn, or protected by a session."""
        return {e.id for e in self._entries.values() if e.in_use > 0} | self.protected()

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

    def _used_all(self, extra: object | None = None) -> int:
        """``_used`` of every entry, from the running count: O(live turns), not O(entries)."""
        held = self._lease_held() + ([extra] if extra is not None else [])
        return self._ledger.total + self._ledger.beside(held) + sum(ls.needed_bytes for ls in self._leases)

    def _fit_budget(self) -> None:
        """After a turn: evict unprotected idle entries, then session-protected ones, LRU first,
        until the bank fits its budget (entries in use stay)."""
        sessions = self.protected()
        lru = sorted((e for e in self._entries.values() if e.in_use == 0), key=lambda e: e.last_used)
        self._evict_until(0, [e for e in lru if e.id not in sessions] + [e for e in lru if e.id in sessions])

    def _evict_until(self, needed: int, order: list[BankEntry], prefix: object | None = None) -> None:
        """Evict entries of ``order`` in turn until ``needed`` fits beside everything left."""
        sessions = self.protected()
        order = list(order)
        while order and self._used_all(prefix) + needed > self.budget_bytes:
            e = order.pop(0)
            if e.id not in self._entries:
                continue
            self.stats.protected_evictions += e.id in sessions
            self._remove(e)
            self._evicted.add(e.namespace, e.tokens)
            self.stats.evictions += 1

    def _remove(self, entry: BankEntry) -> None:
        del self._entries[entry.id]
        self._ledger.remove(entry.snapshot)
        index = self._index[entry.namespace]
        index.remove(entry.tokens, entry.id)
        if index.empty:
            del self._index[entry.namespace]
        self._sessions.forget(entry.id)

"""What the bank holds, as the dashboard shows it: conversations as lists of segments, live turns.

Only counts, sizes and hashes leave this module -- never token ids, text, session ids or the raw
namespace (which carries a hash of the API key): a namespace is shown as ``ns_hash`` (8 hex digits
of its SHA-256), enough to tell tenants apart and to group a tenant's conversations.

A segment is *shared* when more than one holder references it: another banked conversation, or a
live turn that restored it (a fork, a follow-up, a common system prompt). ``own_bytes`` of a
conversation is what evicting it alone would free: the bytes of the segments nobody else holds.
``logical_bytes`` is what the bank would cost if every conversation held a private copy of its
rows (rows x bytes per row), as a server without shared segments pays.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field

from turnkv.bank.session_bank import BankEntry, Lease, SessionBank

MAX_CONVERSATIONS = 100  # the most recently used ones are listed; the total is always reported


def ns_hash(namespace: str) -> str:
    """A short, stable, non-reversible label of a cache namespace."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:8]


def _refs(snapshot) -> tuple:
    """The segment refs of a snapshot (both layouts bank ``SegmentedSnapshot`` s; others have none)."""
    return getattr(snapshot, "refs", ()) if snapshot is not None else ()


@dataclass
class LiveClock:
    """When each live turn was first seen and its rows then (the bank records no admission time),
    so a turn's age and its rows per second since then; forgets finished turns."""

    first_seen: dict[int, tuple[float, int]] = field(default_factory=dict)

    def observe(self, leases: list[Lease], rows: list[int], now: float) -> list[tuple[float, float]]:
        """``(age_s, rows_per_s)`` of each lease, given its ``rows`` now."""
        seen = {id(ls): self.first_seen.get(id(ls), (now, n)) for ls, n in zip(leases, rows, strict=True)}
        self.first_seen = seen
        out = []
        for ls, n in zip(leases, rows, strict=True):
            t0, n0 = seen[id(ls)]
            age = now - t0
            out.append((age, (n - n0) / age if age > 0 else 0.0))
        return out


def bank_view(bank: SessionBank, clock: LiveClock, now: float | None = None) -> dict:
    """``memory``, ``conversations``, ``conversations_total`` and ``live`` of ``/dashboard/state``."""
    now = time.monotonic() if now is None else now
    entries, leases, protected = bank.view()
    holders: Counter[int] = Counter()  # segment id -> banked conversations and live turns holding it
    segments = {}
    for held in [*(e.snapshot for e in entries), *(ls.snapshot for ls in leases)]:
        ids = {r.segment.id for r in _refs(held)}
        holders.update(ids)
        segments.update({r.segment.id: r.segment for r in _refs(held)})
    shared = {sid for sid, n in holders.items() if n > 1}
    entries.sort(key=lambda e: -e.last_used)
    rows = sum(e.snapshot.num_tokens for e in entries)
    memory = {
        "bytes_per_row": bank.bytes_per_row,
        "logical_bytes": rows * bank.bytes_per_row,
        "segments": len(segments),
        "shared_segments": len(shared),
        "shared_bytes": sum(segments[s].nbytes for s in shared),
    }
    leases = [ls for ls in leases if not ls.done]
    rows_now = [ls.live.num_tokens if ls.live is not None else ls.cached for ls in leases]  # int reads
    live = [
        _live_turn(ls, n, age, rate)
        for ls, n, (age, rate) in zip(leases, rows_now, clock.observe(leases, rows_now, now), strict=True)
    ]
    return {
        "memory": memory,
        "conversations": [_conversation(e, holders, protected) for e in entries[:MAX_CONVERSATIONS]],
        "conversations_total": len(entries),
        "live": live,
    }


def _conversation(e: BankEntry, holders: Counter[int], protected: set[int]) -> dict:
    refs = _refs(e.snapshot)
    own = {r.segment.id: r.segment.nbytes for r in refs if holders[r.segment.id] == 1}
    return {
        "id": e.id,
        "ns_hash": ns_hash(e.namespace),
        "rows": e.snapshot.num_tokens,
        "own_bytes": sum(own.values()),
        "in_use": e.in_use > 0,
        "protected": e.id in protected,
        "segments": [
            {
                "id": r.segment.id,
                "rows": r.n,  # rows of the segment this conversation uses (a ref may cover a prefix)
                "segment_rows": r.segment.num_rows,
                "bytes": r.segment.nbytes,
                "shared": holders[r.segment.id] > 1,
            }
            for r in refs
        ],
    }


def _live_turn(ls: Lease, rows: int, age_s: float, rows_per_s: float) -> dict:
    return {
        "ns_hash": ns_hash(ls.namespace),
        "rows": rows,
        "restored_rows": ls.cached,
        "priced_bytes": ls.needed_bytes,
        "age_s": round(age_s, 1),
        "rows_per_s": round(rows_per_s, 1),  # rows added since the dashboard first saw the turn
    }

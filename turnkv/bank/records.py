"""The session bank's records: entries, leases, counters, refusals (the tiers' protocol: ``bank.tiers``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from turnkv.bank.breaks import CacheBreak
from turnkv.bank.detach import DetachPlan
from turnkv.kv.cache import KVCache, Snapshot

# Measures the unique bytes of KV rows held by snapshots and live caches (each segment once).
Measure = Callable[[Iterable[object]], int]


@dataclass(frozen=True)
class Reservation:
    """What a turn asks the bank for beyond its prompt (``engine.admission.reserve``): ``rows``
    for the answer (the rebase ``slack`` included), shrinkable down to ``least`` rows to fit (None:
    never), and ``activation(new_rows, history_rows)``: the transient bytes of its prefill.
    ``choices`` > 1: that many answers fork the prompt (``SessionBank.fork``), each priced ``rows``
    plus its recomputed last prompt row."""

    rows: int
    least: int | None = None
    slack: int = 0
    activation: Callable[[int, int], int] | None = None
    choices: int = 1


class Refused(Exception):
    """A turn that cannot fit the budget even after evicting every evictable entry (HTTP 507).

    The message carries the numbers; the caller adds the fix that applies to its request."""

    def __init__(self, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(
            f"KV memory exhausted: this turn needs {needed_bytes} bytes but at most {available_bytes} "
            f"bytes of the bank budget can be freed"
        )
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.writes_pending = False  # the disk tier's queued writes hold what would make room
        self.after_running = False  # it would fit once the live turns have finished


class MustWait(Refused):
    """Not now: the turn fits once the live turns finish (``admit(..., wait=True)``); not a refusal."""


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

    ``snapshot`` is ``None`` on a miss; otherwise it holds the first ``cached`` tokens of the prompt
    (``copied_rows`` of them copied out of segments the hit would otherwise have pinned).
    ``reserve_rows`` is the output reservation granted (what was asked, or less when the caller
    allowed it). ``snapshot`` stays counted until :meth:`SessionBank.finish`; the entry it came
    from is pinned until then when the request uses all of its rows by reference (``pinned``).
    """

    namespace: str
    session: str | None
    entry_id: int | None
    cached: int
    snapshot: Snapshot | None
    needed_bytes: int
    reserve_rows: int = 0
    copied_rows: int = 0
    pinned: bool = False
    live: KVCache | None = None
    done: bool = False
    cache_break: CacheBreak | None = None  # why the restored prefix ends where it does (``bank.breaks``)
    fork_bytes: int = 0  # of ``needed_bytes``, what each fork of the prompt takes with it (``fork``)

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
    copied_rows: int = 0  # rows of hits copied instead of pinning a segment (``bank.detach``)
    protected_evictions: int = 0  # session-protected entries evicted to admit a turn
    breaks: dict[str, int] = field(default_factory=dict)  # admitted turns by cache-break reason


@dataclass
class AdmissionPlan:
    """One way to admit a turn: what the hit references, what it copies, what may be evicted."""

    detach: DetachPlan | None  # None: the hit by reference as is (or a miss)
    keep: set[int]  # entry ids this plan never evicts
    order: list[BankEntry]  # eviction order
    floor: int  # used bytes with every entry of ``order`` evicted
    fixed: int  # the price without the output reservation

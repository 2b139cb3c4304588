"""The tiers behind the session bank, in eviction order: GPU bank -> RAM -> disk -> gone.

The bank calls one :class:`Tier` (``SessionBank.tier``). :class:`TierChain` is that tier for the
server: the host-RAM tier (``bank.ram``) in front of the disk tier (``bank.disk``), either of
which may be off. A finished turn goes to RAM, and RAM feeds the disk from its host copies (one
device->host copy per block); without RAM the disk copies from the device itself. A restore asks
RAM first and the disk for what RAM lacks after it, so a conversation comes back from the fastest
tier that holds each of its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from turnkv.kv.cache import Snapshot

if TYPE_CHECKING:
    from turnkv.bank.disk import DiskTier
    from turnkv.bank.ram import RamTier


class Tier(Protocol):
    """A slower store of KV rows behind the bank (RAM, disk, or the chain of both).

    ``extend`` returns a snapshot of more leading rows of ``tokens`` than ``prefix`` holds (``prefix``
    possibly cut shorter, plus rows it restored), or None; it never returns rows it did not check.
    ``write_behind`` keeps a finished turn's rows and returns at once. ``held`` lists the
    snapshots (device rows) that its pending copies keep alive, which the bank counts as used.
    ``flush`` waits for those copies (False on timeout); ``close`` finishes them and stops.
    ``health`` is the tier's ``/health`` block.
    """

    name: str

    def extend(self, namespace: str, tokens: Sequence[int], prefix: Snapshot | None) -> Snapshot | None: ...

    def write_behind(self, namespace: str, snapshot: Snapshot) -> None: ...

    def held(self) -> list[Snapshot]: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def health(self) -> dict: ...

    def close(self) -> None: ...


@dataclass
class TierChain:
    """RAM in front of disk (either may be None); ``ram_off`` says why RAM is off, for ``/health``."""

    ram: RamTier | None
    disk: DiskTier | None
    ram_off: str | None = None
    name = "chain"

    def serving(self) -> None:
        """The server is up (warm: no graph capture follows): the RAM tier pins what of its pool
        the warm-up did not (all of it with ``--warmup off``; ``grow_behind``)."""
        if self.ram is not None:
            self.ram.pool.grow_behind()

    def parts(self) -> list[Tier]:
        return [t for t in (self.ram, self.disk) if t is not None]

    def extend(self, namespace: str, tokens: Sequence[int], prefix: Snapshot | None) -> Snapshot | None:
        return extend_by_tier(self, namespace, tokens, prefix)[0]

    def write_behind(self, namespace: str, snapshot: Snapshot) -> None:
        first = self.ram if self.ram is not None else self.disk  # RAM feeds the disk itself
        if first is not None:
            first.write_behind(namespace, snapshot)

    def held(self) -> list[Snapshot]:
        return [s for t in self.parts() for s in t.held()]

    def flush(self, timeout: float | None = None) -> bool:
        return all([t.flush(timeout) for t in self.parts()])

    def health(self) -> dict:
        return tier_health(self)

    def close(self) -> None:
        for tier in self.parts():  # RAM's copies first: the disk may still be fed from them
            tier.close()


def extend_by_tier(
    tier: Tier, namespace: str, tokens: Sequence[int], prefix: Snapshot | None
) -> tuple[Snapshot | None, dict[str, int]]:
    """``tier.extend`` (a chain: each part continues from the longest rows found so far), and the
    rows each part restored by its name (``usage.cache_break.detail`` names them)."""
    from turnkv.bank.disk_blocks import BLOCK_TOKENS

    best, rows = None, {}
    for part in tier.parts() if isinstance(tier, TierChain) else [tier]:
        base = best if best is not None else prefix
        got = part.extend(namespace, tokens, base)
        if got is not None:  # a part keeps ``base`` cut to a block boundary and adds its rows
            kept = (base.num_tokens if base is not None else 0) // BLOCK_TOKENS * BLOCK_TOKENS
            rows[part.name] = got.num_tokens - kept
            best = got
    return best, rows


def tier_health(tier: Tier | None) -> dict[str, dict]:
    """``{"ram": ..., "disk": ...}`` for ``/health`` of whatever tier the bank has (None: both off)."""
    from turnkv.bank.disk import disabled_health
    from turnkv.bank.ram import disabled_ram_health

    if isinstance(tier, TierChain):
        ram = tier.ram.health() if tier.ram is not None else disabled_ram_health(tier.ram_off)
        disk = tier.disk.health() if tier.disk is not None else disabled_health()
        return {"ram": ram, "disk": disk}
    parts = {tier.name: tier.health()} if tier is not None else {}
    return {"ram": parts.get("ram", disabled_ram_health(None)), "disk": parts.get("disk", disabled_health())}

"""Session protection: a client's ``X-Session-Id`` keeps its newest bank entry from LRU eviction,
for ``ttl_s`` seconds after the session's last turn and within ``share`` of the bank budget.

Protection only orders eviction (unprotected idle entries go first); it never refuses a turn:
admission evicts protected entries too, least recently used first, when that is the only way to
make room (``SessionBank.admit``). The time-to-live and the cap keep idle sessions on a small
budget from making every later turn a 507 for as long as the server runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class _Session:
    entry_id: int
    seen: float  # clock time of the session's last turn


@dataclass
class SessionGuard:
    """Which entries sessions protect now. ``ttl_s <= 0`` or ``share <= 0`` turns protection off."""

    ttl_s: float
    share: float
    clock: Callable[[], float]
    _sessions: dict[tuple[str, str], _Session] = field(default_factory=dict)

    def touch(self, namespace: str, session: str | None) -> None:
        """A turn of this session started: its protection lasts ``ttl_s`` from now."""
        s = self._sessions.get((namespace, session or ""))
        if session and s is not None:
            s.seen = self.clock()

    def mark(self, namespace: str, session: str | None, entry_id: int) -> None:
        """``entry_id`` is now the session's newest entry (the one it protects)."""
        if session:
            self._sessions[(namespace, session)] = _Session(entry_id, self.clock())

    def moved(self, old: int, new: int) -> None:
        """Entry ``old`` was superseded by ``new`` (it serves every prompt ``old`` could)."""
        for s in self._sessions.values():
            if s.entry_id == old:
                s.entry_id = new

    def forget(self, entry_id: int) -> None:
        """Entry ``entry_id`` left the bank: sessions protecting it protect nothing now."""
        for key in [k for k, s in self._sessions.items() if s.entry_id == entry_id]:
            del self._sessions[key]

    def protected(
        self, snapshots: dict[int, object], measure: Callable[[Iterable[object]], int], budget: int
    ) -> set[int]:
        """Entry ids protected now: sessions seen within ``ttl_s``, most recent first, each while the
        unique bytes of all protected entries stay within ``share * budget`` (one that would exceed
        it is skipped). ``snapshots`` maps banked entry ids to their snapshots. Expired sessions are
        forgotten."""
        if self.ttl_s <= 0 or self.share <= 0:
            return set()
        now = self.clock()
        for key in [k for k, s in self._sessions.items() if now - s.seen > self.ttl_s]:
            del self._sessions[key]
        cap = self.share * budget
        chosen: list[int] = []
        for s in sorted(self._sessions.values(), key=lambda s: -s.seen):
            if s.entry_id in chosen or s.entry_id not in snapshots:
                continue
            if measure([snapshots[i] for i in [*chosen, s.entry_id]]) <= cap:
                chosen.append(s.entry_id)
        return set(chosen)

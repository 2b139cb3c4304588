"""Stored Responses-API responses (``POST /v1/responses`` with ``store``), in SQLite.

A record is what ``previous_response_id`` needs to continue a conversation without re-rendering
it: the token chain the bank holds for the response (``TurnRequest.render_history`` of its
prompt plus answer, exactly the ids the engine banked) with the chat-template text those ids
spell, the conversation as chat-template messages (to rebuild the chain when its rows are gone,
or when ``instructions`` or ``tools`` change), and the response object ``GET`` returns.

The file is ``responses.sqlite`` in the disk tier's directory (beside its index), so a restart
keeps every chain; a server without a disk tier keeps them in memory. Records are bounded by a
TTL, a count and a byte cap, evicted oldest first (``put`` enforces the caps, every read the TTL).
Each record holds its whole chain (not a delta on its parent's) so evicting a parent never breaks
a child: the blobs are zlib-compressed JSON, ~1.2 bytes a token.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = "responses.sqlite"
TTL_S = 30 * 24 * 3600.0  # as long as OpenAI keeps a stored response
MAX_RECORDS = 10_000
MAX_BYTES = 512 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    created REAL NOT NULL,
    fingerprint TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    ``chain``: the token ids the bank holds for it (prompt and answer, as the next turn renders
    them) and ``chain_text`` the chat-template text they spell; ``messages``: the conversation
    (every item up to and including this answer) as chat-template messages, without the system
    message of ``instructions``; ``tools`` as the template renders them; ``fingerprint``: the model the chain's ids belong to;
    ``response``: the response object as ``GET /v1/responses/{id}`` returns it."""

    id: str
    namespace: str
    created: float
    fingerprint: str
    chain: list[int]
    chain_text: str
    messages: list[dict]
    instructions: str | None
    tools: list[dict] | None
    response: dict

    def blob(self) -> bytes:
        state = {
            "chain": self.chain,
            "chain_text": self.chain_text,
            "messages": self.messages,
            "instructions": self.instructions,
            "tools": self.tools,
            "response": self.response,
        }
        return zlib.compress(json.dumps(state, separators=(",", ":")).encode(), 6)

    @classmethod
    def from_row(
        cls, id: str, namespace: str, created: float, fingerprint: str, body: bytes
    ) -> StoredResponse:
        return cls(id, namespace, created, fingerprint, **json.loads(zlib.decompress(body)))


class ResponseStore:
    """Records in ``path`` (``":memory:"``: this process only), bounded by ``ttl_s``,
    ``max_records`` and ``max_bytes``; safe across threads (one connection under a lock)."""

    def __init__(
        self,
        path: str | Path = ":memory:",
        ttl_s: float = TTL_S,
        max_records: int = MAX_RECORDS,
        max_bytes: int = MAX_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = str(path)
        self.ttl_s, self.max_records, self.max_bytes, self.clock = ttl_s, max_records, max_bytes, clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    @classmethod
    def beside(cls, disk_dir: Path | None, **kw) -> ResponseStore:
        """The store in the disk tier's directory ``disk_dir``, in memory when there is none."""
        return cls(disk_dir / FILE_NAME if disk_dir is not None else ":memory:", **kw)

    def put(self, rec: StoredResponse) -> None:
        body = rec.blob()
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (rec.id, rec.namespace, rec.created, rec.fingerprint, len(body), body),
            )
            self._evict()

    def get(self, id: str, namespace: str) -> StoredResponse | None:
        """The live record ``id`` of ``namespace`` (another namespace's is not found)."""
        with self._lock:
            row = self._db.execute(
                "SELECT id, namespace, created, fingerprint, body FROM responses "
                "WHERE id = ? AND namespace = ? AND created >= ?",
                (id, namespace, self.clock() - self.ttl_s),
            ).fetchone()
        return StoredResponse.from_row(*row) if row is not None else None

    def delete(self, id: str, namespace: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE id = ? AND namespace = ?", (id, namespace))
        return cur.rowcount > 0

    def counts(self) -> tuple[int, int]:
        """(records, bytes) held now."""
        with self._lock:
            n, b = self._db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM responses").fetchone()
        return int(n), int(b)

    def _evict(self) -> None:
        """Drop what the TTL expired, then the oldest until the count and byte caps hold."""
        db = self._db
        db.execute("DELETE FROM responses WHERE created < ?", (self.clock() - self.ttl_s,))
        n, total = db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM responses").fetchone()
        if n <= self.max_records and total <= self.max_bytes:
            return
        drop, freed = 0, 0
        for (size,) in db.execute("SELECT nbytes FROM responses ORDER BY created, rowid").fetchall():
            if n - drop <= self.max_records and total - freed <= self.max_bytes:
                break
            drop, freed = drop + 1, freed + size
        db.execute(
            "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses ORDER BY created, rowid LIMIT ?)",
            (drop,),
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()


__all__ = ["FILE_NAME", "ResponseStore", "StoredResponse"]

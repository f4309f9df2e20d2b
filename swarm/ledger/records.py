"""The validator's durable outbox, in the ledger's SQLite file: accepted work (by verdict id; the
verdict names the submission) that must still reach each trainer. The validator queues it in the
transaction that stores the verdict (``LedgerStore.add(hand_to=...)``), so a kill -9 at any
moment loses no accepted work.

(The evidence behind verdicts and the request claims live in ``swarm.evidence`` and
``node.roles.claims``.) ``WorkRecords`` is a mixin of ``LedgerStore``: one connection, one file
per run.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from swarm.errors import StorageError

SCHEMA = """
CREATE TABLE IF NOT EXISTS handoffs (
    verdict BLOB NOT NULL,
    trainer TEXT NOT NULL,
    delivered INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (verdict, trainer)
);
"""


class WorkRecords:
    path: Path
    _db: sqlite3.Connection

    def pending_handoffs(self, limit: int = 64) -> list[tuple[bytes, str]]:
        """Up to ``limit`` (verdict id, trainer) pairs not delivered yet."""
        rows = self._db.execute(
            "SELECT verdict, trainer FROM handoffs WHERE delivered = 0 LIMIT ?", (limit,)
        )
        return [(bytes(v), str(t)) for v, t in rows]

    def mark_handed(self, verdict: bytes, trainer: str) -> None:
        self._write(
            "UPDATE handoffs SET delivered = 1 WHERE verdict = ? AND trainer = ?",
            [(verdict, trainer)],
        )

    def _write(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        try:
            self._db.executemany(sql, rows)
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {self.path}: write failed: {exc}") from exc

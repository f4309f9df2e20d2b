"""What a validator keeps besides the ledger's events, in the same SQLite file: the evidence
behind its verdicts (signed submissions and verdicts, by submission id), the request claims that
catch a replayed assignment, and the durable outbox of accepted work to hand to the trainers.

``WorkRecords`` is a mixin of ``LedgerStore`` (one connection, one file per run).
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

from swarm.errors import StorageError

SCHEMA = """
CREATE TABLE IF NOT EXISTS evidence (
    id BLOB PRIMARY KEY,
    kind TEXT NOT NULL,
    subject BLOB NOT NULL,
    raw BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS evidence_subject ON evidence (subject);
CREATE TABLE IF NOT EXISTS handoffs (
    submission BLOB NOT NULL,
    trainer TEXT NOT NULL,
    delivered INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (submission, trainer)
);
CREATE TABLE IF NOT EXISTS requests (
    worker TEXT NOT NULL,
    version INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    submission BLOB NOT NULL,
    PRIMARY KEY (worker, version, counter)
);
"""


class WorkRecords:
    path: Path
    _db: sqlite3.Connection

    def add_evidence(self, kind: str, subject: bytes, raw: bytes) -> None:
        """Keep a signed object (a submission or a verdict) that ``subject`` (a submission id)
        refers to. Idempotent."""
        try:
            self._db.execute(
                "INSERT OR IGNORE INTO evidence VALUES (?, ?, ?, ?)",
                (hashlib.sha256(raw).digest(), kind, subject, raw),
            )
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {self.path}: write failed: {exc}") from exc

    def evidence(self, subject: bytes, kind: str | None = None) -> list[bytes]:
        """Envelope bytes of the evidence about ``subject`` (optionally of one kind)."""
        rows = self._db.execute(
            "SELECT kind, raw FROM evidence WHERE subject = ? ORDER BY id", (subject,)
        )
        return [bytes(raw) for k, raw in rows if kind is None or k == kind]

    def claim_request(
        self, worker: str, version: int, counter: int, submission: bytes
    ) -> bytes | None:
        """Record that ``submission`` is ``worker``'s request ``counter`` of ``version``.

        Returns None while ``submission`` holds the claim (the first time, and when the same
        submission is delivered again), else the id of the submission that claimed it first:
        a validator's replay check.
        """
        try:
            self._db.execute(
                "INSERT OR IGNORE INTO requests VALUES (?, ?, ?, ?)",
                (worker, version, counter, submission),
            )
            row = self._db.execute(
                "SELECT submission FROM requests WHERE worker = ? AND version = ? AND counter = ?",
                (worker, version, counter),
            ).fetchone()
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {self.path}: write failed: {exc}") from exc
        first = bytes(row[0])
        return None if first == submission else first

    def queue_handoff(self, submission: bytes, trainers: Iterable[str]) -> None:
        """Remember that accepted ``submission`` must reach each trainer (a durable outbox)."""
        self._write(
            "INSERT OR IGNORE INTO handoffs (submission, trainer) VALUES (?, ?)",
            [(submission, t) for t in trainers],
        )

    def pending_handoffs(self, limit: int = 64) -> list[tuple[bytes, str]]:
        rows = self._db.execute(
            "SELECT submission, trainer FROM handoffs WHERE delivered = 0 LIMIT ?", (limit,)
        )
        return [(bytes(s), str(t)) for s, t in rows]

    def mark_handed(self, submission: bytes, trainer: str) -> None:
        self._write(
            "UPDATE handoffs SET delivered = 1 WHERE submission = ? AND trainer = ?",
            [(submission, trainer)],
        )

    def _write(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        try:
            self._db.executemany(sql, rows)
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {self.path}: write failed: {exc}") from exc

    def evidence_of_kind(self, kind: str) -> Iterator[bytes]:
        """Every stored evidence envelope of one kind ("submission" or "verdict")."""
        for (raw,) in self._db.execute(
            "SELECT raw FROM evidence WHERE kind = ? ORDER BY id", (kind,)
        ):
            yield bytes(raw)

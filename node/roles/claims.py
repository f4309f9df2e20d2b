"""Request claims shared by the run's validators: which submission holds each assignment.

An assignment is (worker, policy version, request counter). A validator claims it for the
submission it is about to judge, and learns every other validator's claims from their verdicts
(gossiped, each naming worker, version, counter and submission id): a verdict is a claim. So a
second copy of an assignment sent to another validator is refused, not judged, and two
different signed submissions for one assignment are seen as an equivocation by whoever holds
both claims.

Retention: a claim matters only while its version can still be submitted, i.e. inside the async
window. ``prune(oldest_version)`` drops claims of older versions (the validator calls it as the
policy advances); the table stays at about ``(async_level + 1) x`` one version's requests.
A race is left: two copies judged at the same moment by two validators, before either verdict
is gossiped. Both are claims then, and the equivocation is slashed when the verdicts meet.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from swarm.dbfile import open_wal
from swarm.errors import StorageError
from swarm.messages import Signed, Verdict

_SCHEMA = """
CREATE TABLE IF NOT EXISTS claims (
    worker TEXT NOT NULL,
    version INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    submission BLOB NOT NULL,
    validator TEXT NOT NULL,
    verdict BLOB,
    PRIMARY KEY (worker, version, counter, submission, validator)
);
CREATE INDEX IF NOT EXISTS claims_version ON claims (version);
"""


@dataclass(frozen=True, slots=True)
class Claim:
    submission: bytes
    validator: str
    verdict: bytes | None
    """The verdict's id once it is signed (None while its validator judges)."""


class ClaimBook:
    """Claims in one SQLite file (WAL). Use it from one thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = open_wal(path, _SCHEMA, "claims")

    def claim(
        self,
        worker: str,
        version: int,
        counter: int,
        submission: bytes,
        validator: str,
        verdict: bytes | None = None,
    ) -> None:
        """Record (or complete with its verdict id) one validator's claim."""
        try:
            self._db.execute(
                "INSERT INTO claims VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET"
                " verdict = coalesce(excluded.verdict, verdict)",
                (worker, version, counter, submission, validator, verdict),
            )
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"claims {self.path}: write failed: {exc}") from exc

    def note(self, verdict: Signed[Verdict]) -> None:
        """A verdict (ours or another validator's) as a claim; verdicts made before they named
        version and counter are ignored."""
        v = verdict.message
        if v.policy_version >= 0 and v.counter >= 0:
            self.claim(
                v.worker, v.policy_version, v.counter, v.submission_id, verdict.signer, verdict.id
            )

    def of(self, worker: str, version: int, counter: int) -> list[Claim]:
        """Every claim on one assignment, oldest first."""
        rows = self._db.execute(
            "SELECT submission, validator, verdict FROM claims"
            " WHERE worker = ? AND version = ? AND counter = ? ORDER BY rowid",
            (worker, version, counter),
        )
        return [Claim(bytes(s), str(v), None if d is None else bytes(d)) for s, v, d in rows]

    def prune(self, oldest_version: int) -> int:
        """Retention: drop claims of versions below ``oldest_version``; returns how many."""
        cur = self._db.execute("DELETE FROM claims WHERE version < ?", (oldest_version,))
        return cur.rowcount

    def __len__(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM claims").fetchone()[0])

    def close(self) -> None:
        self._db.close()

"""The trainer's persisted queue of accepted samples (SQLite, WAL).

No accepted sample is lost or used twice across restarts. A step reserves its batch by writing
the step's number on the rows (``take``) before training; the checkpoint written after the step
records the version it produced. On restart ``recover(version)`` releases every reservation of a
step that never completed (step >= the checkpoint's version), so the batch is trained exactly once
whichever moment the trainer died at.

Retention (``prune``): after each checkpoint the trainer drops the rows of versions that left the
async window, so the file holds about ``async_level + 1`` versions' accepted work.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgpack

from node.compute.groups import Group
from swarm.errors import StorageError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accepted (
    submission_id BLOB PRIMARY KEY,
    seq INTEGER NOT NULL,
    version INTEGER NOT NULL,
    groups BLOB NOT NULL,
    step INTEGER
);
CREATE INDEX IF NOT EXISTS accepted_free ON accepted (step, version);
CREATE TABLE IF NOT EXISTS settled (step INTEGER PRIMARY KEY);
CREATE TABLE IF NOT EXISTS last_seq (id INTEGER PRIMARY KEY CHECK (id = 0), seq INTEGER NOT NULL);
"""
_COLUMNS = {"verdict_id": "BLOB NOT NULL DEFAULT x''", "worker": "TEXT NOT NULL DEFAULT ''"}
"""Added for the training record (issue 27): queues from before open with empty values."""


def _pack(groups: list[Group]) -> bytes:
    return msgpack.packb(  # type: ignore[no-any-return]
        [g.to_wire() for g in groups], use_bin_type=True
    )


def _unpack(data: bytes) -> list[Group]:
    return [Group.from_wire(g) for g in msgpack.unpackb(data)]


class SampleQueue:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            have = {row[1] for row in self._db.execute("PRAGMA table_info(accepted)")}
            for name, decl in _COLUMNS.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE accepted ADD COLUMN {name} {decl}")
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"sample queue {path} cannot be opened: {exc}") from exc

    def put(
        self,
        submission_id: bytes,
        version: int,
        groups: list[Group],
        *,
        verdict_id: bytes = b"",
        worker: str = "",
    ) -> bool:
        """Queue one accepted submission's groups; False if it was queued before."""
        # ``seq`` never repeats, even once ``prune`` deleted the newest rows: a receipt's place
        # in the queue is evidence (node.roles.training_audit.skipped).
        try:
            self._db.execute("BEGIN IMMEDIATE")
            cur = self._db.execute(
                "INSERT OR IGNORE INTO accepted"
                " (submission_id, seq, version, groups, step, verdict_id, worker) VALUES"
                " (?, (SELECT max(coalesce((SELECT max(seq) FROM accepted), 0),"
                " coalesce((SELECT seq FROM last_seq), 0)) + 1), ?, ?, NULL, ?, ?)",
                (submission_id, version, _pack(groups), verdict_id, worker),
            )
            if cur.rowcount == 1:
                self._db.execute(
                    "INSERT OR REPLACE INTO last_seq VALUES"
                    " (0, (SELECT seq FROM accepted WHERE submission_id = ?))",
                    (submission_id,),
                )
            self._db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            self._db.execute("ROLLBACK")
            raise StorageError(f"sample queue {self.path}: write failed: {exc}") from exc
        return cur.rowcount == 1

    def pending(self, min_version: int = 0, *, skip_worker: str = "") -> int:
        """Groups' submissions waiting, made by ``min_version`` or newer."""
        row = self._db.execute(
            "SELECT count(*) FROM accepted WHERE step IS NULL AND version >= ? AND worker != ?",
            (min_version, skip_worker or "\x00"),
        ).fetchone()
        return int(row[0])

    def seq_of(self, submission_id: bytes) -> int | None:
        """The queue place of a submission (what its receipt says), None if not queued."""
        row = self._db.execute(
            "SELECT seq FROM accepted WHERE submission_id = ?", (submission_id,)
        ).fetchone()
        return None if row is None else int(row[0])

    def take(
        self, step: int, max_submissions: int, min_version: int, *, skip_worker: str = ""
    ) -> list[tuple[bytes, list[Group]]]:
        """Reserve up to ``max_submissions`` (oldest first, inside the window) for ``step``.
        (``skip_worker``: tests only, a rogue trainer that leaves one worker's work out.)"""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            rows = self._db.execute(
                "SELECT submission_id, groups FROM accepted WHERE step IS NULL AND version >= ?"
                " AND worker != ? ORDER BY seq LIMIT ?",
                (min_version, skip_worker or "\x00", max_submissions),
            ).fetchall()
            self._db.executemany(
                "UPDATE accepted SET step = ? WHERE submission_id = ?",
                [(step, r[0]) for r in rows],
            )
            self._db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            self._db.execute("ROLLBACK")
            raise StorageError(f"sample queue {self.path}: {exc}") from exc
        return [(bytes(sid), _unpack(data)) for sid, data in rows]

    def recover(self, checkpoint_version: int) -> int:
        """Release reservations of steps that did not complete; returns how many."""
        cur = self._db.execute(
            "UPDATE accepted SET step = NULL WHERE step >= ?", (checkpoint_version,)
        )
        return cur.rowcount

    def prune(self, min_version: int, checkpoint_version: int) -> int:
        """Retention: drop submissions of versions below ``min_version`` (the async window's
        floor), which no step can take any more, unless reserved by a step the checkpoint does
        not cover yet. The window's own rows stay, trained or not, so a re-delivered submission
        is still recognised and never trained twice; an older one re-delivered can never be
        taken. Returns how many rows went."""
        cur = self._db.execute(
            "DELETE FROM accepted WHERE version < ? AND (step IS NULL OR step < ?)",
            (min_version, checkpoint_version),
        )
        self._db.execute(
            "DELETE FROM settled WHERE step NOT IN"
            " (SELECT step FROM accepted WHERE step IS NOT NULL)"
        )
        return cur.rowcount

    def settle(self, step: int) -> None:
        """Several trainers: the round of ``step`` went into a published version, so its
        reservations stay used whatever happens to this trainer."""
        self._db.execute("INSERT OR IGNORE INTO settled VALUES (?)", (step,))

    def unsettled_steps(self) -> list[int]:
        """Steps holding reservations whose outcome this trainer did not record."""
        rows = self._db.execute(
            "SELECT DISTINCT step FROM accepted WHERE step IS NOT NULL"
            " AND step NOT IN (SELECT step FROM settled) ORDER BY step"
        )
        return [int(r[0]) for r in rows]

    def reserved_steps(self) -> list[int]:
        """Steps holding reservations, settled or not."""
        rows = self._db.execute(
            "SELECT DISTINCT step FROM accepted WHERE step IS NOT NULL ORDER BY step"
        )
        return [int(r[0]) for r in rows]

    def release(self, step: int) -> int:
        """Give the reservations of ``step`` back (its round was void, failed or lost)."""
        cur = self._db.execute("UPDATE accepted SET step = NULL WHERE step = ?", (step,))
        return cur.rowcount

    def first_worker(self, min_version: int = 0) -> str:
        """The worker of the oldest submission waiting, made by ``min_version`` or newer: the
        one an honest trainer takes first (tests: a rogue trainer's target, so that leaving
        it out passes over older work, which its receipts show)."""
        row = self._db.execute(
            "SELECT worker FROM accepted WHERE worker != '' AND step IS NULL AND version >= ?"
            " ORDER BY seq LIMIT 1",
            (min_version,),
        ).fetchone()
        return "" if row is None else str(row[0])

    def cited_by(self, step: int) -> list[tuple[bytes, int]]:
        """The (verdict id, sample version) of each submission ``step`` reserved, in the order
        it trains them (the training record's citations)."""
        return [
            (bytes(r[0]), int(r[1]))
            for r in self._db.execute(
                "SELECT verdict_id, version FROM accepted WHERE step = ? ORDER BY seq", (step,)
            )
        ]

    def used_by(self, step: int) -> list[bytes]:
        return [
            bytes(r[0])
            for r in self._db.execute(
                "SELECT submission_id FROM accepted WHERE step = ? ORDER BY seq", (step,)
            )
        ]

    def close(self) -> None:
        self._db.close()

"""The ledger's grow-only event set in SQLite (WAL; one transaction per batch; survives kill -9).

The database holds each event's exact envelope bytes keyed by its id, so an auditor can re-verify
every signature from the file alone, and the evidence behind slashes (the worker's signed
submission and the validator's signed verdict), so the auditor can replay it. ``balances`` is the
fold materialised after every batch: what ``ledger show`` prints and what ``audit`` re-derives.
``add`` checks every event against the run's rules before it writes anything: a batch lands
whole or not at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

from swarm.errors import StorageError
from swarm.ledger.fold import Balances, fold
from swarm.ledger.rules import check_event, check_verdict
from swarm.messages import LedgerEvent, RunGenesis, Signed, Verdict, decode, run_id_of

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id BLOB PRIMARY KEY,
    event TEXT NOT NULL,
    peer TEXT NOT NULL,
    amount INTEGER NOT NULL,
    evidence BLOB NOT NULL,
    signer TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    raw BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_peer ON events (peer);
CREATE TABLE IF NOT EXISTS evidence (
    id BLOB PRIMARY KEY,
    kind TEXT NOT NULL,
    subject BLOB NOT NULL,
    raw BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS evidence_subject ON evidence (subject);
CREATE TABLE IF NOT EXISTS balances (peer TEXT PRIMARY KEY, balance INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS handoffs (
    submission BLOB NOT NULL,
    trainer TEXT NOT NULL,
    delivered INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (submission, trainer)
);
CREATE TABLE IF NOT EXISTS verdicts (
    id BLOB PRIMARY KEY,
    submission BLOB NOT NULL,
    worker TEXT NOT NULL,
    validator TEXT NOT NULL,
    accepted INTEGER NOT NULL,
    severity TEXT NOT NULL,
    samples INTEGER NOT NULL,
    reward_sum INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    raw BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS verdicts_worker ON verdicts (worker);
CREATE INDEX IF NOT EXISTS verdicts_version ON verdicts (policy_version);
CREATE TABLE IF NOT EXISTS requests (
    worker TEXT NOT NULL,
    version INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    submission BLOB NOT NULL,
    PRIMARY KEY (worker, version, counter)
);
"""


class LedgerStore:
    """One run's ledger in one SQLite file. Not thread-safe: use it from one thread (the node's
    event loop), or open one store per thread."""

    def __init__(self, path: Path, genesis: Signed[RunGenesis]) -> None:
        self.path = path
        self.genesis = genesis
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key = 'genesis'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('genesis', ?)", (genesis.raw,))
            elif bytes(row[0]) != genesis.raw:
                raise StorageError(
                    f"ledger {path} belongs to another run; use a separate file per run"
                )
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {path} cannot be opened: {exc}") from exc

    @classmethod
    def open_existing(cls, path: Path) -> LedgerStore:
        """Open a ledger file by itself, with the genesis it stores (what an auditor does)."""
        if not path.exists():
            raise StorageError(f"no ledger at {path}")
        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
                row = db.execute("SELECT value FROM meta WHERE key = 'genesis'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"{path} is not a swarm-node ledger: {exc}") from exc
        if row is None:
            raise StorageError(f"{path} holds no run genesis")
        return cls(path, decode(bytes(row[0]), RunGenesis))

    @property
    def run_id(self) -> str:
        return run_id_of(self.genesis)

    def add(self, events: Iterable[Signed[LedgerEvent]]) -> list[Signed[LedgerEvent]]:
        """Check and store events; returns those that were new. Raises before writing anything
        if any event breaks the run's rules."""
        batch = list(events)
        for event in batch:
            check_event(event, self.genesis)
        added = []
        try:
            self._db.execute("BEGIN IMMEDIATE")
            for event in batch:
                e = event.message
                cursor = self._db.execute(
                    "INSERT OR IGNORE INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        event.id,
                        e.event,
                        e.peer,
                        e.amount,
                        e.evidence,
                        event.signer,
                        e.created_at,
                        event.raw,
                    ),
                )
                if cursor.rowcount:
                    added.append(event)
            if added:
                self._materialise()
            self._db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            with contextlib.suppress(sqlite3.Error):  # e.g. the store was closed at shutdown
                self._db.execute("ROLLBACK")
            raise StorageError(f"ledger {self.path}: write failed: {exc}") from exc
        return added

    def _materialise(self) -> None:
        """Rewrite the balances table from a fold over every event (inside the caller's
        transaction). O(events) per batch: a run's ledger stays small next to its rollouts."""
        balances = self.balances()
        self._db.execute("DELETE FROM balances")
        self._db.executemany("INSERT INTO balances VALUES (?, ?)", balances.by_peer.items())

    def stored_balances(self) -> dict[str, int]:
        """The materialised balances (peers with at least one counted event)."""
        return {p: int(b) for p, b in self._db.execute("SELECT peer, balance FROM balances")}

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

    def add_verdict(self, verdict: Signed[Verdict]) -> bool:
        """Keep a verdict (our own or one gossiped by another validator): the per-worker
        accepted/rejected counts and the reward per policy version read this table. Raises
        unless a genesis validator signed it for this run; False when it was known."""
        check_verdict(verdict, self.genesis)
        v = verdict.message
        try:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO verdicts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    verdict.id,
                    v.submission_id,
                    v.worker,
                    verdict.signer,
                    int(v.accepted),
                    v.severity,
                    len(v.rewards),
                    sum(v.rewards),
                    v.policy_version,
                    v.counter,
                    v.created_at,
                    verdict.raw,
                ),
            )
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {self.path}: write failed: {exc}") from exc
        return bool(cursor.rowcount)

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

    def ids(self) -> set[bytes]:
        return {bytes(r[0]) for r in self._db.execute("SELECT id FROM events")}

    def raw_events(self, ids: Iterable[bytes] | None = None) -> Iterator[bytes]:
        """Envelope bytes of the given events (all when ``ids`` is None), for sync."""
        if ids is None:
            for (raw,) in self._db.execute("SELECT raw FROM events ORDER BY id"):
                yield bytes(raw)
            return
        for event_id in ids:
            row = self._db.execute("SELECT raw FROM events WHERE id = ?", (event_id,)).fetchone()
            if row is not None:
                yield bytes(row[0])

    def events(self) -> Iterator[Signed[LedgerEvent]]:
        for raw in self.raw_events():
            yield decode(raw, LedgerEvent)

    def balances(self) -> Balances:
        return fold(self.events(), self.genesis.message.params)

    def __len__(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM events").fetchone()[0])

    def close(self) -> None:
        self._db.close()

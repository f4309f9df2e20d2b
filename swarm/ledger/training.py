"""Every node's store of the trainer's accountability: training records, sample receipts,
training disputes, and this node's own training audits (``<run dir>/training.db``).

Decisions this module owns:

- **Where.** Beside ``ledger.db`` (``TrainingStore.beside``), like ``evaluations.db``: none of
  it moves a balance, so none of it is a ledger event; ``ledger show``, the dashboard and the
  audit open it read-only.
- **Records.** Keyed by version; the first record of a version wins and another one for the
  same version (a trainer that signed two steps into one version) is kept in ``conflicts``.
  Who may sign a record is the gossip gate's rule (a genesis trainer), checked before ``add``.
- **Receipts.** The trainer's signed answer to each hand-off, kept by the validator that made
  it (keyed by submission; the first receipt wins): the coverage check reads them.
- **Disputes.** Signed ``TrainingDispute`` envelopes, each once (by id).
- **Audits.** This node's own findings per version (``agreed``, a dispute reason, or why it
  could not audit), for ``status``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from swarm.dbfile import open_wal
from swarm.errors import StorageError
from swarm.messages import SampleReceipt, Signed, TrainingDispute, TrainingRecord, decode

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    version INTEGER PRIMARY KEY,
    id BLOB NOT NULL,
    signer TEXT NOT NULL,
    samples INTEGER NOT NULL,
    raw BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS conflicts (id BLOB PRIMARY KEY, version INTEGER, raw BLOB);
CREATE TABLE IF NOT EXISTS receipts (
    submission_id BLOB PRIMARY KEY,
    verdict_id BLOB NOT NULL,
    worker TEXT NOT NULL,
    sample_version INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    queued INTEGER NOT NULL,
    trainer TEXT NOT NULL,
    raw BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS disputes (
    id BLOB PRIMARY KEY,
    version INTEGER NOT NULL,
    reason TEXT NOT NULL,
    signer TEXT NOT NULL,
    trainer TEXT NOT NULL,
    detail TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    raw BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS audits (
    version INTEGER PRIMARY KEY,
    outcome TEXT NOT NULL,
    detail TEXT NOT NULL
);
"""


SUMMARY_DISPUTES = 10
"""The newest disputes ``status`` lists (all of them: ``ledger show``, the dashboard)."""


class TrainingStore:
    FILE = "training.db"

    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = path
        if read_only:
            try:
                self._db = sqlite3.connect(
                    f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False
                )
            except sqlite3.DatabaseError as exc:
                raise StorageError(f"training store {path} cannot be opened: {exc}") from exc
        else:
            self._db = open_wal(path, SCHEMA, "training store")

    @classmethod
    def beside(cls, ledger: Path, *, read_only: bool = False) -> TrainingStore:
        return cls(ledger.with_name(cls.FILE), read_only=read_only)

    def close(self) -> None:
        self._db.close()

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"training store {self.path}: {exc}") from exc

    def _write(self, sql: str, args: tuple[Any, ...]) -> int:
        try:
            return self._db.execute(sql, args).rowcount
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"training store {self.path}: write failed: {exc}") from exc

    # -- records -----------------------------------------------------------------------------

    def add(self, signed: Signed[TrainingRecord]) -> str:
        """``"stored"`` (first of its version), ``"again"`` or ``"conflict"`` (kept aside)."""
        r = signed.message
        held = self._rows("SELECT id FROM records WHERE version = ?", (r.version,))
        if not held:
            self._write(
                "INSERT OR IGNORE INTO records VALUES (?, ?, ?, ?, ?)",
                (r.version, signed.id, signed.signer, len(r.verdicts), signed.raw),
            )
            return "stored"
        if bytes(held[0][0]) == signed.id:
            return "again"
        self._write(
            "INSERT OR IGNORE INTO conflicts VALUES (?, ?, ?)", (signed.id, r.version, signed.raw)
        )
        return "conflict"

    def keep(self, signed: Signed[Any]) -> None:
        """A ledger-gossip handler: keep every record and dispute the gate accepted."""
        if isinstance(signed.message, TrainingRecord):
            self.add(signed)
        elif isinstance(signed.message, TrainingDispute):
            self.add_dispute(signed)

    def record(self, version: int) -> Signed[TrainingRecord] | None:
        rows = self._rows("SELECT raw FROM records WHERE version = ?", (version,))
        return decode(bytes(rows[0][0]), TrainingRecord) if rows else None

    def records(self) -> list[Signed[TrainingRecord]]:
        rows = self._rows("SELECT raw FROM records ORDER BY version")
        return [decode(bytes(raw), TrainingRecord) for (raw,) in rows]

    def versions(self) -> list[int]:
        return [int(v) for (v,) in self._rows("SELECT version FROM records ORDER BY version")]

    # -- receipts ----------------------------------------------------------------------------

    def add_receipt(self, signed: Signed[SampleReceipt]) -> bool:
        r = signed.message
        return (
            self._write(
                "INSERT OR IGNORE INTO receipts VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    r.submission_id,
                    r.verdict_id,
                    r.worker,
                    r.sample_version,
                    r.seq,
                    int(r.queued),
                    signed.signer,
                    signed.raw,
                ),
            )
            == 1
        )

    def receipts(
        self, min_version: int = 0, max_version: int | None = None
    ) -> list[Signed[SampleReceipt]]:
        """Receipts of samples made by versions in ``[min_version, max_version]``, by seq."""
        top = 2**62 if max_version is None else max_version
        rows = self._rows(
            "SELECT raw FROM receipts WHERE sample_version BETWEEN ? AND ? ORDER BY seq",
            (min_version, top),
        )
        return [decode(bytes(raw), SampleReceipt) for (raw,) in rows]

    # -- disputes and audits -----------------------------------------------------------------

    def add_dispute(self, signed: Signed[TrainingDispute]) -> bool:
        d = signed.message
        return (
            self._write(
                "INSERT OR IGNORE INTO disputes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    signed.id,
                    d.version,
                    d.reason,
                    signed.signer,
                    d.trainer,
                    d.detail,
                    d.created_at,
                    signed.raw,
                ),
            )
            == 1
        )

    def disputes(self) -> list[dict[str, Any]]:
        rows = self._rows(
            "SELECT id, version, reason, signer, trainer, detail, created_at FROM disputes"
            " ORDER BY version, id"
        )
        return [
            {
                "id": bytes(i).hex(),
                "version": v,
                "reason": reason,
                "by": signer,
                "trainer": trainer,
                "detail": detail,
                "created_at": at,
            }
            for i, v, reason, signer, trainer, detail, at in rows
        ]

    def dispute_raws(self) -> list[bytes]:
        return [bytes(r[0]) for r in self._rows("SELECT raw FROM disputes ORDER BY version, id")]

    def note_audit(self, version: int, outcome: str, detail: str = "") -> None:
        self._write("INSERT OR REPLACE INTO audits VALUES (?, ?, ?)", (version, outcome, detail))

    def audited(self, version: int) -> bool:
        return bool(self._rows("SELECT 1 FROM audits WHERE version = ?", (version,)))

    def audits(self) -> dict[int, tuple[str, str]]:
        return {int(v): (o, d) for v, o, d in self._rows("SELECT * FROM audits ORDER BY version")}

    def summary(self) -> dict[str, Any]:
        """The ``training`` section of ``status``."""
        audits = self.audits()
        versions = self.versions()
        return {
            "records": len(versions),
            "latest_record": versions[-1] if versions else None,
            "conflicts": int(self._rows("SELECT count(*) FROM conflicts")[0][0]),
            "receipts": int(self._rows("SELECT count(*) FROM receipts")[0][0]),
            "audited": len(audits),
            "agreed": sum(o == "agreed" for o, _ in audits.values()),
            "dispute_count": len(disputes := self.disputes()),
            "disputes": disputes[-SUMMARY_DISPUTES:],
        }


def read_disputes(ledger: Path) -> list[dict[str, Any]]:
    """The training disputes beside ``ledger``, read-only (none when there is no store)."""
    path = ledger.with_name(TrainingStore.FILE)
    if not path.exists():
        return []
    store = TrainingStore(path, read_only=True)
    try:
        return store.disputes()
    finally:
        store.close()

"""Every node's store of the run's held-out evaluations: signed ``Evaluation`` envelopes.

Decisions this module owns:

- **Where.** ``<run dir>/evaluations.db``, a sqlite file beside ``ledger.db`` and
  ``evidence.db`` (``EvaluationStore.beside``): evaluations are no ledger events (they move no
  balance), so they keep their own file, which the dashboard and the audit open read-only.
- **What is kept.** The raw signed envelope, keyed by version. The first record stored for a
  version wins (``add`` answers ``"stored"``); the same envelope again is ``"again"``; a
  different record of a version already held is kept aside in ``conflicts`` (``"conflict"``,
  counted in ``status``), never replacing the first. Who may sign which version is the gossip
  gate's rule (``swarm.net.gossip.LedgerGate``), checked before anything reaches ``add``.
- **How records travel.** Gossip on the run's ledger topic; ledger sync does not carry them.
  A node that was away while a version was evaluated pulls the records it lacks from a peer
  (``node.roles.evaluation_sync``, every ledger-sync interval), each checked by the gate's
  rules before it is stored. A bootstrap peer keeps what gossip brings only.
- **Summary.** ``summary`` is the ``evaluation`` section of ``status``: versions evaluated, the
  latest one and its mean, the first and latest means and their gain.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from swarm.errors import StorageError
from swarm.messages import REWARD_SCALE, Evaluation, Signed, decode

SCHEMA = """
CREATE TABLE IF NOT EXISTS evaluations (
    version INTEGER PRIMARY KEY,
    id BLOB NOT NULL,
    signer TEXT NOT NULL,
    seed INTEGER NOT NULL,
    items INTEGER NOT NULL,
    mean INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    raw BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS conflicts (
    id BLOB PRIMARY KEY,
    version INTEGER NOT NULL,
    raw BLOB NOT NULL
);
"""


class EvaluationStore:
    """The evaluations one node holds (see the module docstring)."""

    FILE = "evaluations.db"

    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = path
        try:
            if read_only:
                self._db = sqlite3.connect(
                    f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False
                )
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(path, check_same_thread=False)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"evaluations {path} cannot be opened: {exc}") from exc

    @classmethod
    def beside(cls, ledger: Path, *, read_only: bool = False) -> EvaluationStore:
        """The store in the run folder of ``ledger`` (``<run dir>/evaluations.db``)."""
        return cls(ledger.with_name(cls.FILE), read_only=read_only)

    def close(self) -> None:
        self._db.close()

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"evaluations {self.path}: read failed: {exc}") from exc

    def add(self, signed: Signed[Evaluation]) -> str:
        """Keep ``signed``: ``"stored"`` (first of its version), ``"again"`` (held already) or
        ``"conflict"`` (another record of a version held: kept aside)."""
        e = signed.message
        try:
            with self._db:
                held = self._db.execute(
                    "SELECT id FROM evaluations WHERE version = ?", (e.version,)
                ).fetchone()
                if held is None:
                    self._db.execute(
                        "INSERT INTO evaluations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            e.version,
                            signed.id,
                            signed.signer,
                            e.seed,
                            len(e.item_ids),
                            e.mean,
                            e.created_at,
                            signed.raw,
                        ),
                    )
                    return "stored"
                if bytes(held[0]) == signed.id:
                    return "again"
                self._db.execute(
                    "INSERT OR IGNORE INTO conflicts VALUES (?, ?, ?)",
                    (signed.id, e.version, signed.raw),
                )
                return "conflict"
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"evaluations {self.path}: write failed: {exc}") from exc

    def has(self, version: int) -> bool:
        return bool(self._rows("SELECT 1 FROM evaluations WHERE version = ?", (version,)))

    def records(self) -> list[Signed[Evaluation]]:
        """Every stored record, by version."""
        rows = self._rows("SELECT raw FROM evaluations ORDER BY version")
        return [decode(bytes(raw), Evaluation) for (raw,) in rows]

    def curve(self) -> list[dict[str, Any]]:
        """One point per evaluated version, oldest first: what the dashboard draws."""
        rows = self._rows(
            "SELECT version, mean, items, seed, signer, created_at FROM evaluations"
            " ORDER BY version"
        )
        return [
            {
                "version": v,
                "mean": mean / REWARD_SCALE,
                "items": items,
                "seed": seed,
                "signer": signer,
                "created_at": at,
            }
            for v, mean, items, seed, signer, at in rows
        ]

    def conflicts(self) -> int:
        return int(self._rows("SELECT count(*) FROM conflicts")[0][0])

    def summary(self) -> dict[str, Any]:
        """The ``evaluation`` section of ``status``."""
        return {**summarize(self.curve()), "conflicts": self.conflicts()}


def summarize(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """Count, latest point and gain (latest mean minus the first) of an evaluation curve."""
    if not curve:
        return dict.fromkeys(
            ("latest_version", "latest_mean", "first_version", "first_mean", "gain"), None
        ) | {"count": 0}
    first, last = curve[0], curve[-1]
    return {
        "count": len(curve),
        "latest_version": last["version"],
        "latest_mean": last["mean"],
        "first_version": first["version"],
        "first_mean": first["mean"],
        "gain": last["mean"] - first["mean"] if len(curve) > 1 else None,
    }


def read_curve(ledger: Path) -> list[dict[str, Any]]:
    """The curve of the store beside ``ledger``, read-only (empty when there is none)."""
    path = ledger.with_name(EvaluationStore.FILE)
    if not path.exists():
        return []
    store = EvaluationStore(path, read_only=True)
    try:
        return store.curve()
    finally:
        store.close()

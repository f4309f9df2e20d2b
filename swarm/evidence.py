"""Evidence: signed envelopes kept by their content address, within a disk budget.

Decisions this module owns:
- An object's address is its id: sha256 of its envelope bytes (the id every signed object of
  the design already has), so a holder cannot serve anything but what was asked for; ``put``
  and ``get`` never trust a caller's id (``put`` computes it; fetchers check ``address_of``).
- Two classes of evidence (``EvidenceStore.put(pinned=...)``):
  pinned: what a slash, an equivocation or a dispute rests on (its verdicts and submissions).
  Never dropped by the budget: each slash bans a key, so pinned evidence grows with the number
  of banned identities (issue 15 bounds Sybil floods), and the audit needs every one;
  unpinned: accepted work (for the trainer hand-off and proof bundles) and the sampled credits
  that validators re-judge. Dropped oldest first once the store passes ``budget_bytes``.
  Pinning an unpinned object upgrades it; nothing unpins.
- One SQLite file (WAL), one statement per call: a kill -9 loses at most the object being
  written, never the file.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from swarm.dbfile import open_wal
from swarm.errors import StorageError

DEFAULT_BUDGET_BYTES: Final = 512 * 1024 * 1024
"""Disk budget of unpinned evidence (pinned evidence is outside it)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    id BLOB PRIMARY KEY,
    kind TEXT NOT NULL,
    size INTEGER NOT NULL,
    pinned INTEGER NOT NULL,
    raw BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS objects_unpinned ON objects (pinned);
"""


def address_of(raw: bytes) -> bytes:
    """The content address of envelope bytes (their sha256, the object's id)."""
    return hashlib.sha256(raw).digest()


class EvidenceStore:
    """Content-addressed envelopes in one SQLite file. Use it from one thread."""

    def __init__(self, path: Path, *, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.path = path
        self.budget_bytes = budget_bytes
        self._db = open_wal(path, _SCHEMA, "evidence store")
        (unpinned,) = self._db.execute(
            "SELECT coalesce(sum(size), 0) FROM objects WHERE pinned = 0"
        ).fetchone()
        self._unpinned_bytes = int(unpinned)
        """Bytes of unpinned objects, kept up to date by ``put``/``pin`` (one scan at open)."""

    @classmethod
    def beside(cls, ledger_path: Path) -> EvidenceStore:
        """The evidence store a node keeps next to its ledger (``<run dir>/evidence.db``)."""
        return cls(ledger_path.with_name("evidence.db"))

    def put(self, raw: bytes, kind: str, *, pinned: bool) -> bytes:
        """Keep ``raw`` (an envelope of ``kind``, already verified by the caller); returns its
        id. Idempotent; ``pinned=True`` pins an object held unpinned."""
        object_id = address_of(raw)
        if object_id in self:
            if pinned:
                self.pin(object_id)
            return object_id
        try:
            self._db.execute(
                "INSERT INTO objects (id, kind, size, pinned, raw) VALUES (?, ?, ?, ?, ?)",
                (object_id, kind, len(raw), int(pinned), raw),
            )
            if not pinned:
                self._unpinned_bytes += len(raw)
                self._enforce_budget()
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"evidence store {self.path}: write failed: {exc}") from exc
        return object_id

    def pin(self, object_id: bytes) -> bool:
        """Pin a held object; False when it is not held."""
        row = self._db.execute("SELECT pinned, size FROM objects WHERE id = ?", (object_id,))
        held = row.fetchone()
        if held is None:
            return False
        if not held[0]:
            self._db.execute("UPDATE objects SET pinned = 1 WHERE id = ?", (object_id,))
            self._unpinned_bytes -= int(held[1])
        return True

    def get(self, object_id: bytes) -> bytes | None:
        row = self._db.execute("SELECT raw FROM objects WHERE id = ?", (object_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def __contains__(self, object_id: object) -> bool:
        return (
            self._db.execute("SELECT 1 FROM objects WHERE id = ?", (object_id,)).fetchone()
            is not None
        )

    def of_kind(self, kind: str) -> Iterator[bytes]:
        """Every held object of ``kind``, oldest first."""
        for (raw,) in self._db.execute(
            "SELECT raw FROM objects WHERE kind = ? ORDER BY rowid", (kind,)
        ):
            yield bytes(raw)

    def pinned(self, object_id: bytes) -> bool:
        row = self._db.execute("SELECT pinned FROM objects WHERE id = ?", (object_id,)).fetchone()
        return row is not None and bool(row[0])

    def usage(self) -> dict[str, int]:
        """Objects and bytes, pinned and not (for ``status``)."""
        out = {"pinned_objects": 0, "pinned_bytes": 0, "objects": 0, "bytes": 0}
        for pinned, n, size in self._db.execute(
            "SELECT pinned, count(*), coalesce(sum(size), 0) FROM objects GROUP BY pinned"
        ):
            prefix = "pinned_" if pinned else ""
            out[f"{prefix}objects"] = int(n)
            out[f"{prefix}bytes"] = int(size)
        return out

    def _enforce_budget(self) -> None:
        excess = self._unpinned_bytes - self.budget_bytes
        if excess <= 0:
            return
        dropped = 0
        victims = []
        for object_id, size in self._db.execute(
            "SELECT id, size FROM objects WHERE pinned = 0 ORDER BY rowid"
        ):
            if dropped >= excess:
                break
            victims.append((object_id,))
            dropped += int(size)
        self._db.executemany("DELETE FROM objects WHERE id = ?", victims)
        self._unpinned_bytes -= dropped

    def close(self) -> None:
        self._db.close()

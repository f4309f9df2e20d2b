"""Evidence: signed envelopes kept by their content address, within disk budgets.

Decisions this module owns:
- An object's address is its id: sha256 of its envelope bytes (the id every signed object of
  the design already has), so a holder cannot serve anything but what was asked for; ``put``
  and ``get`` never trust a caller's id (``put`` computes it; fetchers check ``address_of``).
- Two classes of evidence (``EvidenceStore.put(pinned=...)``), each with its retention policy:
  unpinned: accepted work (for the trainer hand-off and proof bundles) and the sampled credits
  that validators re-judge. Dropped oldest first once they pass ``budget_bytes``.
  pinned: what a slash, an equivocation or a dispute rests on (its verdicts and submissions),
  charged to the accused peer (``peer``). Held in full within two budgets (issue 15: a flood
  of fresh keys must not fill the disk):
  * per peer, ``peer_budget_bytes``: never below ``SLASH_EVIDENCE_BYTES`` (a verdict and two
    maximum-size submissions), so a peer's first slash (an equivocation included) is always
    kept in full; what a peer's evidence brings past it is summarized;
  * in total, ``pinned_budget_bytes``: past it, the evidence of a newcomer (``earned=False``:
    a key with no accepted work, free to make) is summarized. The evidence of a peer that
    earned credit, or charged to no peer (a policy conflict: genesis trainers), is kept, and
    makes room by summarizing the newest newcomer evidence; beyond that it may pass the total
    (bounded by the workers with accepted work times the per-peer budget, not by free keys).
  Summarized: the bytes are dropped, and ``summaries`` keeps the sha256 (the id), kind, size,
  peer and how many times it was put. A verdict is also in the ledger (its ``verdicts`` table),
  so what a summary loses is at most a submission's bytes; an audit reports such a slash as
  summarized (not replayed, not agreed) and names the id.
  Pinning an unpinned object upgrades it (charged to ``peer`` like a new one); nothing unpins.
- Repeats are counted: every ``put`` of an object already held or summarized adds one to its
  ``seen`` count, and stores nothing.
- One SQLite file (WAL), autocommit: a kill -9 loses at most the object being written, never the
  file. Files from before the budgets open as they are (their pinned objects count as earned).
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from swarm.dbfile import open_wal
from swarm.errors import ConfigError, StorageError

DEFAULT_BUDGET_BYTES: Final = 512 * 1024 * 1024
"""Disk budget of unpinned evidence."""
SLASH_EVIDENCE_BYTES: Final = 2 * 8 * 1024 * 1024 + 64 * 1024
"""What one slash rests on at most: two maximum-size submissions (an equivocation) and the
verdict (``RolloutSubmission.MAX_BYTES`` is 8 MiB; ``Verdict.MAX_BYTES`` 256 KiB is far above a
real verdict's few hundred bytes, and the verdict is in the ledger anyway)."""
DEFAULT_PEER_BUDGET_BYTES: Final = 2 * SLASH_EVIDENCE_BYTES
DEFAULT_PINNED_BUDGET_BYTES: Final = 1024 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    id BLOB PRIMARY KEY,
    kind TEXT NOT NULL,
    size INTEGER NOT NULL,
    pinned INTEGER NOT NULL,
    raw BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS objects_unpinned ON objects (pinned);
CREATE TABLE IF NOT EXISTS summaries (
    id BLOB PRIMARY KEY,
    kind TEXT NOT NULL,
    size INTEGER NOT NULL,
    peer TEXT,
    seen INTEGER NOT NULL
);
"""
_COLUMNS = {
    "peer": "TEXT",
    "earned": "INTEGER NOT NULL DEFAULT 1",
    "seen": "INTEGER NOT NULL DEFAULT 1",
}


def address_of(raw: bytes) -> bytes:
    """The content address of envelope bytes (their sha256, the object's id)."""
    return hashlib.sha256(raw).digest()


@dataclass(frozen=True)
class Summary:
    """What is left of evidence dropped by a budget: its id (sha256), kind and size."""

    id: bytes
    kind: str
    size: int
    peer: str | None
    seen: int

    def describe(self) -> str:
        return (
            f"{self.kind} sha256 {self.id.hex()} ({self.size} bytes, seen {self.seen}x) was"
            " summarized by its holder's evidence budget; its bytes are not kept"
        )


class EvidenceStore:
    """Content-addressed envelopes in one SQLite file. Use it from one thread."""

    def __init__(
        self,
        path: Path,
        *,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        peer_budget_bytes: int = DEFAULT_PEER_BUDGET_BYTES,
        pinned_budget_bytes: int = DEFAULT_PINNED_BUDGET_BYTES,
        slash_bytes: int = SLASH_EVIDENCE_BYTES,
    ) -> None:
        """``slash_bytes``: what one slash rests on at most (the per-peer budget's floor)."""
        if peer_budget_bytes < slash_bytes or pinned_budget_bytes < peer_budget_bytes:
            raise ConfigError(
                f"evidence budgets too small: per peer {peer_budget_bytes} must hold one slash"
                f" ({slash_bytes} bytes) and the total {pinned_budget_bytes} one peer"
            )
        self.path = path
        self.budget_bytes = budget_bytes
        self.peer_budget_bytes = peer_budget_bytes
        self.pinned_budget_bytes = pinned_budget_bytes
        self._db = open_wal(path, _SCHEMA, "evidence store")
        have = {row[1] for row in self._db.execute("PRAGMA table_info(objects)")}
        for name, decl in _COLUMNS.items():
            if name not in have:  # a file from before the budgets
                self._db.execute(f"ALTER TABLE objects ADD COLUMN {name} {decl}")
        self._db.execute("CREATE INDEX IF NOT EXISTS objects_peer ON objects (peer, pinned)")
        totals = dict(
            self._db.execute("SELECT pinned, coalesce(sum(size), 0) FROM objects GROUP BY pinned")
        )
        self._unpinned_bytes = int(totals.get(0, 0))
        self._pinned_bytes = int(totals.get(1, 0))
        """Bytes held, kept up to date by ``put``/``pin`` (one scan at open)."""

    @classmethod
    def beside(cls, ledger_path: Path) -> EvidenceStore:
        """The evidence store a node keeps next to its ledger (``<run dir>/evidence.db``)."""
        return cls(ledger_path.with_name("evidence.db"))

    def put(
        self, raw: bytes, kind: str, *, pinned: bool, peer: str | None = None, earned: bool = True
    ) -> bytes:
        """Keep ``raw`` (an envelope of ``kind``, already verified by the caller); returns its
        id. Pinned evidence is charged to ``peer`` (the accused) within the budgets of the
        module docstring (``earned``: the peer has accepted work; None: charged to nobody).
        Idempotent (a repeat is counted); ``pinned=True`` pins an object held unpinned."""
        object_id = address_of(raw)
        try:
            if self._repeat(object_id):
                if pinned:
                    self.pin(object_id, peer=peer, earned=earned)
                return object_id
            if pinned and not self._room(peer, len(raw), earned):
                self._summarize(object_id, kind, len(raw), peer)
                return object_id
            self._db.execute(
                "INSERT INTO objects (id, kind, size, pinned, raw, peer, earned)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (object_id, kind, len(raw), int(pinned), raw, peer, int(earned)),
            )
            if pinned:
                self._pinned_bytes += len(raw)
            else:
                self._unpinned_bytes += len(raw)
                self._enforce_budget()
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"evidence store {self.path}: write failed: {exc}") from exc
        return object_id

    def pin(self, object_id: bytes, *, peer: str | None = None, earned: bool = True) -> bool:
        """Pin a held object (charged to ``peer``, within the budgets: past them it is
        summarized); False when it is not held."""
        row = self._db.execute("SELECT pinned, size, kind FROM objects WHERE id = ?", (object_id,))
        held = row.fetchone()
        if held is None:
            return False
        pinned, size, kind = int(held[0]), int(held[1]), str(held[2])
        if pinned:
            return True
        self._unpinned_bytes -= size
        if self._room(peer, size, earned):
            self._db.execute(
                "UPDATE objects SET pinned = 1, peer = ?, earned = ? WHERE id = ?",
                (peer, int(earned), object_id),
            )
            self._pinned_bytes += size
        else:
            self._db.execute("DELETE FROM objects WHERE id = ?", (object_id,))
            self._summarize(object_id, kind, size, peer)
        return True

    def get(self, object_id: bytes) -> bytes | None:
        row = self._db.execute("SELECT raw FROM objects WHERE id = ?", (object_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def summary(self, object_id: bytes) -> Summary | None:
        """What is left of ``object_id`` when a budget dropped its bytes (None otherwise)."""
        row = self._db.execute(
            "SELECT kind, size, peer, seen FROM summaries WHERE id = ?", (object_id,)
        ).fetchone()
        return None if row is None else Summary(object_id, row[0], int(row[1]), row[2], row[3])

    def note_summary(self, summary: Summary) -> None:
        """Record that a holder summarized ``summary.id`` (an auditor learns it from the
        evidence protocol), unless the bytes are held here."""
        if summary.id not in self:
            self._summarize(summary.id, summary.kind, summary.size, summary.peer, summary.seen)

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

    def peer_bytes(self, peer: str) -> int:
        """Bytes of pinned evidence held in full against ``peer``."""
        (n,) = self._db.execute(
            "SELECT coalesce(sum(size), 0) FROM objects WHERE peer = ? AND pinned = 1", (peer,)
        ).fetchone()
        return int(n)

    def usage(self) -> dict[str, int]:
        """Objects and bytes, pinned and not, summarized and repeats (for ``status``)."""
        out = {"pinned_objects": 0, "pinned_bytes": 0, "objects": 0, "bytes": 0}
        for pinned, n, size in self._db.execute(
            "SELECT pinned, count(*), coalesce(sum(size), 0) FROM objects GROUP BY pinned"
        ):
            prefix = "pinned_" if pinned else ""
            out[f"{prefix}objects"] = int(n)
            out[f"{prefix}bytes"] = int(size)
        n, size, seen = self._db.execute(
            "SELECT count(*), coalesce(sum(size), 0), coalesce(sum(seen), 0) FROM summaries"
        ).fetchone()
        out["summarized_objects"] = int(n)
        out["summarized_bytes_dropped"] = int(size)
        (held_seen,) = self._db.execute("SELECT coalesce(sum(seen - 1), 0) FROM objects").fetchone()
        out["repeats"] = int(held_seen) + int(seen) - int(n)
        return out

    # -- the budgets ---------------------------------------------------------------------------

    def _repeat(self, object_id: bytes) -> bool:
        """Count a repeat of a held or summarized object; False when it is new."""
        for table in ("objects", "summaries"):
            cursor = self._db.execute(
                f"UPDATE {table} SET seen = seen + 1 WHERE id = ?", (object_id,)
            )
            if cursor.rowcount:
                return True
        return False

    def _room(self, peer: str | None, size: int, earned: bool) -> bool:
        """Whether ``size`` more pinned bytes charged to ``peer`` may be held in full (making
        room in the total for earned evidence by summarizing newcomers' first)."""
        if peer is not None and self.peer_bytes(peer) + size > self.peer_budget_bytes:
            return False
        if self._pinned_bytes + size <= self.pinned_budget_bytes:
            return True
        if peer is not None and not earned:
            return False
        self._evict_newcomers(self._pinned_bytes + size - self.pinned_budget_bytes)
        return True

    def _evict_newcomers(self, excess: int) -> None:
        """Summarize newcomers' pinned evidence, newest first, until ``excess`` bytes are free."""
        freed = 0
        victims = []
        for object_id, kind, size, peer in self._db.execute(
            "SELECT id, kind, size, peer FROM objects WHERE pinned = 1 AND earned = 0"
            " ORDER BY rowid DESC"
        ):
            if freed >= excess:
                break
            victims.append((object_id, kind, int(size), peer))
            freed += int(size)
        for object_id, kind, size, peer in victims:
            self._db.execute("DELETE FROM objects WHERE id = ?", (object_id,))
            self._pinned_bytes -= size
            self._summarize(object_id, kind, size, peer)

    def _summarize(
        self, object_id: bytes, kind: str, size: int, peer: str | None, seen: int = 1
    ) -> None:
        self._db.execute(
            "INSERT INTO summaries (id, kind, size, peer, seen) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET seen = seen + excluded.seen",
            (object_id, kind, size, peer, seen),
        )

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

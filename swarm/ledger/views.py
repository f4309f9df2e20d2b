"""Read-only views of the store's tables: what ``ledger show`` and ``status`` read, without
decoding an envelope or folding anything."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EventRow:
    """One stored event as ``ledger show`` prints it (no signature check: it was checked on
    insert)."""

    id: bytes
    event: str
    peer: str
    amount: int
    evidence: bytes
    signer: str
    created_at: int
    counted: bool


class BalanceView(Mapping[str, int]):
    """The balances table as a read-only mapping: lookups by key, never a whole-table read
    unless iterated."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __getitem__(self, peer: str) -> int:
        row = self._db.execute("SELECT balance FROM balances WHERE peer = ?", (peer,)).fetchone()
        if row is None:
            raise KeyError(peer)
        return int(row[0])

    def __iter__(self) -> Iterator[str]:
        return iter(
            [str(p) for (p,) in self._db.execute("SELECT peer FROM balances ORDER BY peer")]
        )

    def __len__(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM balances").fetchone()[0])

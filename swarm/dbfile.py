"""One way to open a node's SQLite files: WAL, NORMAL sync, autocommit, the schema applied.

A kill -9 loses at most the statement in flight (WAL keeps the file whole); a file that cannot
be opened is a ``StorageError`` naming it and what it is (``what``: "evidence store", ...).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from swarm.errors import StorageError


def open_wal(path: Path, schema: str, what: str) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(schema)
    except (OSError, sqlite3.DatabaseError) as exc:
        raise StorageError(f"{what} {path} cannot be opened: {exc}") from exc
    return db

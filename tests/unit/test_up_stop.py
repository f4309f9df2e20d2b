"""What `up` keeps when it stops its processes: the run's databases whole, and children that a
SIGINT stops even when `up` itself was started with SIGINT ignored."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from node.up import _die_with_parent, copy_database
from swarm.errors import StorageError


def test_a_database_copied_while_its_writer_holds_the_wal_keeps_every_row(tmp_path: Path) -> None:
    """A node killed with SIGKILL leaves its rows in the write-ahead log: a copy of the main
    file alone held no table ("no such table" in `up`'s audit); the copy holds them all."""
    source = tmp_path / "ledger.db"
    writer = sqlite3.connect(source)
    try:
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute("PRAGMA wal_autocheckpoint=0")  # nothing leaves the log, as after kill -9
        with writer:
            writer.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, body TEXT)")
            writer.executemany(
                "INSERT INTO events VALUES (?, ?)", [(i, f"e{i}") for i in range(50)]
            )
        assert Path(f"{source}-wal").stat().st_size > 0

        dest = tmp_path / "out" / "ledger.db"
        dest.parent.mkdir()
        dest.write_bytes(b"an older copy")  # replaced, not appended to
        copy_database(source, dest)
    finally:
        writer.close()
    with sqlite3.connect(dest) as copy:
        assert copy.execute("SELECT count(*), max(body) FROM events").fetchone() == (50, "e9")


def test_a_file_that_is_no_database_is_a_clear_error(tmp_path: Path) -> None:
    source = tmp_path / "ledger.db"
    source.write_bytes(b"not a database" * 100)
    with pytest.raises(StorageError, match=r"cannot copy .*ledger\.db to .*copy\.db"):
        copy_database(source, tmp_path / "copy.db")


def test_a_child_gets_sigint_back_when_up_runs_with_it_ignored() -> None:
    """A shell starts a script's background jobs with SIGINT ignored, and an ignored signal
    stays ignored across exec: `up`'s children then ran on through its SIGINT until SIGKILL."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import signal; print(signal.getsignal(signal.SIGINT).__name__)",
            ],
            preexec_fn=_die_with_parent,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        signal.signal(signal.SIGINT, before)
    assert child.stdout.strip() == "default_int_handler"

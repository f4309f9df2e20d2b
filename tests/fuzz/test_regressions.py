"""Bugs the fuzzers found, each pinned by the input that found it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from node.roles.ledger_sync import LedgerReplica
from swarm.errors import MalformedError, PeerError, StorageError
from swarm.ledger import LedgerStore
from swarm.ledger.sync import pull
from swarm.messages import LedgerEvent, run_id_of, sign
from tests.fuzz.targets import GENESIS, KEY, OTHER


@pytest.mark.parametrize(
    "body",
    [b"\x80", msgpack.packb({0: "get"}), msgpack.packb(["get"]), msgpack.packb([]), b"\x01"],
    ids=["empty-map", "map-with-op", "get-without-ids", "empty-array", "integer"],
)
async def test_ledger_sync_refuses_requests_that_are_not_arrays_typed(
    tmp_path: Path, body: bytes
) -> None:
    store = LedgerStore(tmp_path / "ledger.db", GENESIS)
    replica = LedgerReplica(node=Any, store=store)  # type: ignore[arg-type]
    try:
        with pytest.raises(MalformedError):
            await replica._on_sync("peer", body)
    finally:
        store.close()


@pytest.mark.parametrize("answer", [b"\xc1", b"\x92\x01"], ids=["reserved-byte", "truncated"])
async def test_a_malformed_ledger_sync_answer_is_a_peer_error_not_a_crash(
    tmp_path: Path, answer: bytes
) -> None:
    store = LedgerStore(tmp_path / "ledger.db", GENESIS)

    async def mallory(body: bytes) -> bytes:
        return answer

    try:
        with pytest.raises(PeerError, match="malformed ledger-sync answer"):
            await pull(store, mallory)
    finally:
        store.close()


def test_a_ledger_event_arriving_after_the_store_closed_is_a_storage_error(
    tmp_path: Path,
) -> None:
    """Found by bench/fuzz.py at shutdown: gossip delivered an event after the role closed the
    ledger; the rollback then raised sqlite3.ProgrammingError out of the node's gossip task."""
    owner = KEY
    store = LedgerStore(tmp_path / "ledger.db", GENESIS)
    store.close()
    grant = sign(LedgerEvent(run_id_of(GENESIS), "grant", OTHER.peer_id, 5, b"", 1), owner)
    with pytest.raises(StorageError, match="write failed"):
        store.add([grant])

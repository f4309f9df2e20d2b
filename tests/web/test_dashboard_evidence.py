"""A node without a slash's evidence (a bootstrap peer, a worker) gets its audit bundle from the
validator over ``ledger-sync`` (real libp2p hosts on 127.0.0.1), and refuses evidence that is
not about the slashed submission or does not verify."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgpack
import pytest
import trio

from node.roles.ledger_sync import LedgerReplica
from node.runtime import Node, RuntimeConfig
from node.web.queries import LedgerQueries, bundle_from_evidence
from node.web.views import HolderWatch, PolicyLog, RunView
from swarm.errors import SwarmError
from swarm.identity import NodeKey
from tests import ledger_factory as lf
from tests.netfactory import FAST_DIAL, LOOPBACK

WORKER = NodeKey.from_seed(b"\x51" * 32)
CHEAT = NodeKey.from_seed(b"\x52" * 32)
SLASHED = "SELECT evidence FROM events WHERE event = 'slash'"


def _config(key: NodeKey, role: str, bootstrap: list[str]) -> RuntimeConfig:
    return RuntimeConfig(
        key=key,
        genesis=lf.genesis(),
        role=role,  # type: ignore[arg-type]
        listen=LOOPBACK,
        bootstrap=bootstrap,
        heartbeat=0.2,
        dial=FAST_DIAL,
        connect_found_peers=False,
    )


async def test_a_node_without_evidence_fetches_the_bundle_from_the_validator(
    tmp_path: Path,
) -> None:
    work = [lf.Work(WORKER, 1, True), lf.Work(CHEAT, 1, False, reasons=("wrong token",))]
    store = lf.build(tmp_path / "validator.db", work)
    (subject,) = [bytes(e) for (e,) in store._db.execute(SLASHED)]
    here = tmp_path / "bootstrap.db"
    with sqlite3.connect(here) as copy:  # the same ledger, without the evidence
        store._db.backup(copy)
        copy.execute("DELETE FROM evidence")
    local = LedgerQueries(here, initial_balance=100, ban_threshold=0)
    assert local.bundle(subject) is None  # this node holds no evidence
    mine = LedgerQueries(store.path, initial_balance=100, ban_threshold=0)

    async with (
        Node.start(_config(lf.VALIDATOR, "validator", [])) as validator,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(LedgerReplica(validator, store, every_s=3600).run)
        async with Node.start(
            _config(NodeKey.from_seed(b"\x53" * 32), "inference", validator.overlay.addrs()[:1])
        ) as viewer:
            view = RunView(
                run_id=viewer.run_id,
                genesis=lf.genesis(),
                status=dict,
                policy=PolicyLog(),
                holders=HolderWatch(viewer.overlay, viewer.run_id, list),
                queries=local,
                roles=dict,
                host=viewer.overlay.host,
                peer_id=viewer.peer_id,
            )
            with trio.fail_after(30):
                fetched = await view.bundle(CHEAT.peer_id, subject)
                unknown = await view.bundle(CHEAT.peer_id, b"\x00" * 32)
        nursery.cancel_scope.cancel()
    assert fetched is not None and fetched == mine.bundle(subject)
    assert unknown is None
    for q in (local, mine):
        q.close()
    store.close()


def test_evidence_about_another_submission_or_with_a_bad_signature_is_refused(
    tmp_path: Path,
) -> None:
    store = lf.build(tmp_path / "l.db", [lf.Work(CHEAT, 1, False), lf.Work(CHEAT, 2, False)])
    rows = store._db.execute("SELECT evidence FROM events ORDER BY created_at").fetchall()
    first, second = (bytes(r[0]) for r in rows)
    subs, verdicts = store.evidence(second, "submission"), store.evidence(second, "verdict")
    assert bundle_from_evidence(store.genesis.raw, first, subs, verdicts) is None
    good = bundle_from_evidence(store.genesis.raw, second, subs, verdicts)
    assert good is not None and msgpack.unpackb(good)["submission"] == subs[0]
    forged = bytearray(verdicts[0])
    forged[-1] ^= 1
    with pytest.raises(SwarmError):
        bundle_from_evidence(store.genesis.raw, second, subs, [bytes(forged)])
    store.close()

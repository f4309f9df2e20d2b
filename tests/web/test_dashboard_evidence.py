"""A node without a slash's evidence (a bootstrap peer, a worker) gets its audit bundle from the
validator over the ``evidence`` protocol (real libp2p hosts on 127.0.0.1), and refuses evidence
that does not hash to the id asked for or does not verify; a bundle of a run with a quota holds
the announcement of its version when the node holds one."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import trio

from node.bundle import pack_bundle
from node.roles.evidence import EvidenceService
from node.runtime import Node, RuntimeConfig
from node.web import views
from node.web.queries import LedgerQueries
from node.web.views import HolderWatch, PolicyLog, RunView
from swarm.evidence import EvidenceStore
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import PolicyAnnouncement, Signed, sign
from swarm.net.names import EVIDENCE
from swarm.net.protocols import EVIDENCE_LIMITS
from tests import ledger_factory as lf
from tests.netfactory import loopback_config

WORKER = NodeKey.from_seed(b"\x51" * 32)
CHEAT = NodeKey.from_seed(b"\x52" * 32)
SLASHED = "SELECT evidence FROM events WHERE event = 'slash'"


def _config(key: NodeKey, role: str, bootstrap: list[str]) -> RuntimeConfig:
    return loopback_config(
        key,
        lf.genesis(),
        role,
        bootstrap,
        heartbeat=0.2,
        connect_found_peers=False,
    )


async def test_a_node_without_evidence_fetches_the_bundle_from_the_validator(
    tmp_path: Path,
) -> None:
    work = [lf.Work(WORKER, 1, True), lf.Work(CHEAT, 1, False, reasons=("wrong token",))]
    store = lf.build(tmp_path / "validator.db", work)
    (subject,) = [bytes(e) for (e,) in store._db.execute(SLASHED)]
    local = _without_evidence(store, tmp_path)
    assert local.envelope(subject) is None  # this node holds nothing of it
    mine = _view(LedgerQueries(store.path, initial_balance=100, ban_threshold=0), None, "")

    async with Node.start(_config(lf.VALIDATOR, "validator", [])) as validator:
        EvidenceService(validator, EvidenceStore.beside(store.path)).serve()
        async with _viewer(validator, local) as view:
            with trio.fail_after(30):
                fetched = await view.bundle(CHEAT.peer_id, subject)
                unknown = await view.bundle(CHEAT.peer_id, b"\x00" * 32)
    assert fetched is not None and fetched == await mine.bundle(CHEAT.peer_id, subject)
    assert msgpack.unpackb(fetched)["verdict"] == store.verdict_raw(subject)
    assert unknown is None
    for q in (local, mine.queries):
        q.close()  # type: ignore[union-attr]
    store.close()


async def test_a_missed_answer_is_asked_again_and_a_refusal_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The validator misses its first answer (a busy node): the bundle still comes, on the
    second round; an id it does not hold is asked once (its refusal is an answer)."""
    monkeypatch.setattr(views, "EVIDENCE_LIMITS", replace(views.EVIDENCE_LIMITS, timeout=1.0))
    monkeypatch.setattr(views, "EVIDENCE_PAUSE_S", 0.1)
    store = lf.build(tmp_path / "validator.db", [lf.Work(CHEAT, 1, False)])
    (subject,) = [bytes(e) for (e,) in store._db.execute(SLASHED)]
    local = _without_evidence(store, tmp_path)
    asked: list[bytes] = []

    async with Node.start(_config(lf.VALIDATOR, "validator", [])) as validator:
        service = EvidenceService(validator, EvidenceStore.beside(store.path))
        answer = service._on_request

        async def slow_once(peer: str, body: bytes) -> bytes:
            asked.append(body)
            if len(asked) == 1:
                await trio.sleep(3.0)  # past the asker's 1 s
            return await answer(peer, body)

        validator.handle(EVIDENCE, slow_once, EVIDENCE_LIMITS)
        async with _viewer(validator, local) as view:
            with trio.fail_after(30):
                fetched = await view.bundle(CHEAT.peer_id, subject)
                before = len(asked)
                unknown = await view.bundle(CHEAT.peer_id, b"\x00" * 32)
    assert fetched is not None and msgpack.unpackb(fetched)["verdict"] == store.verdict_raw(subject)
    assert asked[:2] == [subject, subject], "the missed verdict was asked again"
    assert unknown is None and len(asked) == before + 1, "a refusal is not asked again"
    local.close()
    store.close()


def _without_evidence(store: LedgerStore, tmp_path: Path) -> LedgerQueries:
    """The queries of a node that holds the same ledger but none of its evidence: no
    evidence.db, and no verdicts either (all from the validator)."""
    (here := tmp_path / "bootstrap").mkdir()
    with sqlite3.connect(here / "ledger.db") as copy:
        store._db.backup(copy)
        copy.execute("DELETE FROM verdicts")
    return LedgerQueries(here / "ledger.db", initial_balance=100, ban_threshold=0)


@contextlib.asynccontextmanager
async def _viewer(validator: Node, local: LedgerQueries) -> AsyncIterator[RunView]:
    """The view of a node joined to ``validator`` whose ledger is ``local``."""
    config = _config(NodeKey.from_seed(b"\x53" * 32), "inference", validator.overlay.addrs()[:1])
    async with Node.start(config) as viewer:
        yield _view(local, viewer.overlay.host, viewer.peer_id)


def _view(
    queries: LedgerQueries,
    host: object,
    peer_id: str,
    announced: Mapping[int, Signed[PolicyAnnouncement]] | None = None,
) -> RunView:
    return RunView(
        run_id=lf.RUN_ID,
        genesis=lf.genesis(),
        status=dict,
        policy=PolicyLog(),
        holders=HolderWatch(None, "self", lf.RUN_ID, list),
        queries=queries,
        roles=dict,
        host=host,
        peer_id=peer_id,
        announced=announced or {},
    )


async def test_a_quota_runs_bundle_holds_the_announcement_of_its_version(tmp_path: Path) -> None:
    """The run has a quota, so the bundle carries the trainer-signed announcement of the
    submission's version (``audit BUNDLE`` then needs no --db): the one the node's policy
    tracker accepted, else the one kept in the evidence store beside the ledger; without one it
    is the bundle of before, byte for byte."""
    assert lf.genesis().message.params.quota > 0
    store = lf.build(tmp_path / "ledger.db", [lf.Work(CHEAT, 1, False)])
    (subject,) = [bytes(e) for (e,) in store._db.execute(SLASHED)]
    v1 = sign(PolicyAnnouncement(lf.RUN_ID, 1, b"\x07" * 32, 5), lf.TRAINER)
    v2 = sign(PolicyAnnouncement(lf.RUN_ID, 2, b"\x08" * 32, 6), lf.TRAINER)
    forged = sign(PolicyAnnouncement(lf.RUN_ID, 1, b"\x09" * 32, 4), CHEAT)  # not a trainer
    queries = LedgerQueries(store.path, initial_balance=100, ban_threshold=0)

    plain = await _view(queries, None, "").bundle(CHEAT.peer_id, subject)
    assert plain is not None
    fields = msgpack.unpackb(plain, raw=False)
    assert "policy" not in fields
    assert plain == pack_bundle(
        fields["genesis"], fields["submission"], fields["verdict"], fields["related"]
    )

    tracked = await _view(queries, None, "", {1: v1, 2: v2}).bundle(CHEAT.peer_id, subject)
    assert tracked is not None and msgpack.unpackb(tracked)["policy"] == [v1.raw]

    evidence = EvidenceStore.beside(store.path)  # a validator after a restart: no tracker entry
    for announcement in (v2, forged, v1):
        evidence.put(announcement.raw, PolicyAnnouncement.KIND, pinned=True)
    evidence.close()
    kept = await _view(queries, None, "").bundle(CHEAT.peer_id, subject)
    assert kept == tracked
    queries.close()
    store.close()


async def test_a_bundle_is_refused_when_the_evidence_does_not_verify(tmp_path: Path) -> None:
    """A verdict whose stored bytes were altered is not packed into a bundle."""
    store = lf.build(tmp_path / "l.db", [lf.Work(CHEAT, 1, False), lf.Work(CHEAT, 2, False)])
    (subject, _) = [bytes(e) for (e,) in store._db.execute(SLASHED)]
    queries = LedgerQueries(store.path, initial_balance=100, ban_threshold=0)
    good = await _view(queries, None, "").bundle(CHEAT.peer_id, subject)
    assert good is not None
    assert await _view(queries, None, "").bundle(WORKER.peer_id, subject) is None  # not his
    raw = bytearray(store.verdict_raw(subject) or b"")
    raw[-1] ^= 1  # a forged signature
    store._db.execute("UPDATE verdicts SET raw = ? WHERE id = ?", (bytes(raw), subject))
    assert await _view(queries, None, "").bundle(CHEAT.peer_id, subject) is None
    queries.close()
    store.close()

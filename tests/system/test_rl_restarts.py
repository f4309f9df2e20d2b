"""Processes die mid-run and come back: the trainer resumes from its checkpoint with no accepted
sample lost or used twice, and a validator killed mid-verdict credits nothing twice."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from node.up import DEMO_PARAMS, LocalSwarm, UpConfig
from swarm.ledger import LedgerStore
from swarm.ledger.recheck import recheck
from swarm.messages import Verdict, decode
from tests.netfactory import wait_until


def _queued(swarm: LocalSwarm) -> set[bytes]:
    """The submission ids in the trainer's sample queue (a read-only snapshot)."""
    path = swarm.proc("trainer").home / "runs" / swarm.run_id / "samples.db"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {bytes(r[0]) for r in db.execute("SELECT submission_id FROM accepted")}
    finally:
        db.close()


async def _version(swarm: LocalSwarm) -> int:
    await swarm.poll()
    return swarm.version()


@pytest.mark.slow
async def test_trainer_and_validator_survive_kill_9(tmp_path: Path) -> None:
    swarm = LocalSwarm(
        UpConfig(
            out=tmp_path / "up",
            workers=1,
            with_cheater=False,
            params=DEMO_PARAMS,
            versions=1000,
            minutes=10,
        )
    )
    swarm.prepare()
    await swarm.start()
    try:

        async def version_at_least(v: int) -> bool:
            return await _version(swarm) >= v

        await wait_until(lambda: version_at_least(2), 180, poll=0.5)
        swarm.kill("trainer")
        before = swarm.version()

        def outbox_holds_work() -> bool:
            store = LedgerStore.open_existing(swarm.validator_ledger())
            try:
                return bool(store.pending_handoffs())
            finally:
                store.close()

        # Work accepted while the trainer is down waits in the validator's durable outbox.
        await wait_until(outbox_holds_work, 120, poll=0.5)
        swarm.respawn("trainer")
        await wait_until(lambda: version_at_least(before + 2), 180, poll=0.5)

        swarm.kill("validator")
        swarm.respawn("validator")
        resumed = swarm.version()
        await wait_until(lambda: version_at_least(resumed + 2), 180, poll=0.5)

        # Every accepted submission reached the trainer, or still waits in the outbox: none
        # lost. Read while the swarm runs, the ledger first and then the queue, so each verdict
        # read was queued by then (or waits in the outbox). The queue keeps the versions still
        # in the async window (``SampleQueue.prune``; older work that arrives late is dropped):
        # compare from the window's floor after the queue was read, which is at least the floor
        # it was read at. Waits until accepted work falls inside that window.
        async def nothing_lost_in_the_window() -> bool:
            ledger = LedgerStore.open_existing(swarm.validator_ledger())
            try:
                accepted = {
                    v.message.submission_id: v.message.policy_version
                    for v in (decode(raw, Verdict) for raw in ledger.raw_verdicts())
                    if v.message.accepted
                }
                handed = set()
                for verdict_id, _ in ledger.pending_handoffs(10_000):  # verdict ids
                    facts = ledger.verdict_facts(verdict_id)
                    assert facts is not None
                    handed.add(facts.submission)
            finally:
                ledger.close()
            queued = _queued(swarm)
            floor = await _version(swarm) - DEMO_PARAMS.async_level
            window = {sid for sid, version in accepted.items() if version >= floor}
            assert window <= queued | handed, f"lost from v{floor}: {window - queued - handed}"
            return bool(window)

        await wait_until(nothing_lost_in_the_window, 120, poll=0.5)
    finally:
        swarm.stop()

    run_dir = swarm.proc("trainer").home / "runs" / swarm.run_id
    queue = sqlite3.connect(run_dir / "samples.db")
    queued = {bytes(r[0]) for r in queue.execute("SELECT submission_id FROM accepted")}
    steps = [r[0] for r in queue.execute("SELECT step FROM accepted WHERE step IS NOT NULL")]
    queue.close()
    ledger = LedgerStore.open_existing(swarm.validator_ledger())
    # Each queued submission was used by at most one step (one row per submission id).
    assert len(steps) <= len(queued)
    # One credit per assignment, whatever was re-judged after the validator's restart, and the
    # balances the validator kept through the kill equal a fold of its events.
    slots = [
        slot
        for (slot,) in ledger._db.execute(
            "SELECT slot FROM events WHERE event = 'credit' AND counted = 1"
        )
    ]
    assert slots and len(set(slots)) == len(slots)
    check = recheck(ledger)
    assert not check.refused and not check.balance_errors
    ledger.close()

"""One policy per version: a trainer that announces a second manifest for a version the swarm
already holds is refused by every node (gossip and a later offer), and the conflict shows in
status and in ``ledger show`` (kept, pinned, in the node's evidence store)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cli.app import app
from node.roles.launch import record_conflict
from swarm.evidence import EvidenceStore
from swarm.ledger import LedgerStore
from swarm.messages import PolicyAnnouncement, sign
from swarm.net import policy_topic
from swarm.net.records import wall_clock_ms
from tests.netfactory import NetFactory, wait_until


async def test_a_conflicting_manifest_for_a_known_version_is_refused_by_every_node(
    tmp_path: Path,
) -> None:
    async with NetFactory(trainers=2) as net:
        await net.bootstrap()
        honest = await net.node("trainer")
        validator = await net.node("validator")
        workers = [await net.node("inference") for _ in range(2)]
        others = [validator, *workers]
        everyone = [honest, *others]
        await wait_until(lambda: all(len(n.overlay.connected_peers()) >= 2 for n in everyone), 20)
        await honest.announce_policy(3, b"\x03" * 32)
        await wait_until(lambda: all(n.policy.version == 3 for n in everyone), 20)

        # A second genesis trainer signs another manifest for v3 and gossips it, past its own
        # gate (a forked or malicious trainer does not run ours).
        rogue = await net.node("trainer", net.trainer_keys[1])
        topic = policy_topic(rogue.run_id)
        await wait_until(lambda: len(rogue.overlay.mesh_peers(topic)) >= 2, 20)
        rogue.overlay.set_gate(topic, lambda data: True)
        forged = sign(PolicyAnnouncement(rogue.run_id, 3, b"\x66" * 32, wall_clock_ms()), rogue.key)
        await rogue.overlay.publish(topic, forged.raw)

        def everyone_refused() -> bool:
            return all(
                n.policy.newest is not None
                and n.policy.newest.message.manifest_id == b"\x03" * 32
                and [c.refused.id for c in n.policy.conflicts] == [forged.id]
                for n in everyone
            )

        await wait_until(everyone_refused, 20)  # refused at each node's gossip gate
        for node in others:  # and when offered again (a pull, a late copy)
            assert node.policy_gate.accept(forged.raw) is None
            assert len(node.policy.conflicts) == 1
        status = validator.status()
        assert status["policy_conflicts"][0]["version"] == 3
        assert status["policy_conflicts"][0]["refused"]["manifest"] == (b"\x66" * 32).hex()
        assert status["gossip"]["rejected"]["policy"]["conflict"] >= 1

        ledger = LedgerStore(tmp_path / "ledger.db", net.genesis)
        evidence = EvidenceStore.beside(ledger.path)
        record_conflict(evidence, validator.policy.conflicts[0])
        assert evidence.pinned(forged.id)
        evidence.close()
        ledger.close()
    db = str(tmp_path / "ledger.db")
    shown = CliRunner().invoke(app, ["ledger", "show", "--db", db, "--json"])
    assert shown.exit_code == 0, shown.output
    conflicts = json.loads(shown.output)["policy_conflicts"]
    assert conflicts[0]["version"] == 3
    assert {m["manifest"] for m in conflicts[0]["manifests"]} == {
        (b"\x03" * 32).hex(),
        (b"\x66" * 32).hex(),
    }

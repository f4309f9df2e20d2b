"""Many real nodes on 127.0.0.1: membership by role, policy gossip, status, identity guards."""

from __future__ import annotations

from pathlib import Path

import pytest

from node import admin
from node.runtime import Node
from swarm.errors import NotAuthorizedError, StorageError
from tests.netfactory import NetFactory, key_named, wait_until


async def test_nine_nodes_find_each_other_by_role_and_all_get_the_policy(tmp_path: Path) -> None:
    async with NetFactory(home_root=tmp_path) as net:
        boot = await net.bootstrap()
        trainer = await net.node("trainer", home=True)
        validator = await net.node("validator")
        workers = [await net.node("inference") for _ in range(6)]
        everyone = [trainer, validator, *workers]

        def sees_all(node) -> bool:
            roles = node.peers_by_role()
            others = {n.peer_id for n in everyone} - {node.peer_id}
            found = {p for peers in roles.values() for p in peers}
            return found == others and roles["trainer"] == (
                [] if node is trainer else [trainer.peer_id]
            )

        await wait_until(lambda: all(sees_all(n) for n in everyone), 20)
        assert validator.peers_by_role()["validator"] == []
        assert sorted(trainer.peers_by_role()["inference"]) == sorted(w.peer_id for w in workers)

        await trainer.announce_policy(1, b"\x01" * 32)
        await wait_until(lambda: all(n.policy.version == 1 for n in everyone), 10)
        assert workers[-1].policy.newest.signer == trainer.peer_id
        assert boot.trackers[trainer.run_id].version == 1  # the bootstrap validates it fully

        answer = await admin.query(admin.socket_path(trainer.config.home.path), {"cmd": "status"})
        status = answer["status"]
        assert status["role"] == "trainer" and status["policy_version"] == 1
        assert len(status["peers_by_role"]["inference"]) == 6
        assert status["gossip"]["accepted"]["policy"] == 1


async def test_trainer_and_validator_roles_are_refused_for_keys_not_in_the_genesis() -> None:
    net = NetFactory()
    for role in ("trainer", "validator"):
        with pytest.raises(NotAuthorizedError, match=r"not a .* of this run"):
            net.config(role, key_named("stranger")).check()
    net.config("inference", key_named("stranger")).check()  # inference is permissionless


async def test_a_second_node_on_the_same_home_refuses_to_start(tmp_path: Path) -> None:
    async with NetFactory(home_root=tmp_path) as net:
        first = await net.node("inference", home=True, bootstrap=[])
        config = net.config("inference", first.key, bootstrap=[])
        config.home = first.config.home
        with pytest.raises(StorageError, match="another swarm-node is running"):
            await net.start_config(config)


async def test_a_node_warns_when_its_peer_id_is_live_elsewhere(tmp_path: Path) -> None:
    """A second node on a copy of the key warns as it joins; the same node restarted on its
    own home does not. (Only the later twin can tell: py-libp2p's peers then reset the
    earlier one's DHT streams, whose signed peer record is older; docs/contributors.md.)"""
    async with NetFactory(home_root=tmp_path) as net:
        await net.bootstrap()
        twin_key = key_named("twin")
        first = await net.node("inference", twin_key, home=True)
        assert first.membership.duplicate_warnings == []
        second = await net.node("inference", twin_key, home=True)  # same key, another home
        warnings = second.status()["warnings"]
        assert any("ANOTHER NODE IS RUNNING WITH THIS KEY" in w for w in warnings), warnings
        assert any(addr in warnings[-1] for addr in first.overlay.addrs())


async def test_a_restarted_node_is_not_its_own_twin(tmp_path: Path) -> None:
    async with NetFactory(home_root=tmp_path) as net:
        await net.bootstrap()
        key = key_named("restarted")
        config = net.config("inference", key, home=True)
        async with Node.start(config) as first:
            await first.membership.publish()  # live adverts of this life, then it stops
            before = first.overlay.addrs()
        async with Node.start(config) as again:
            assert again.overlay.addrs() != before  # another port: only the home tells
            assert again.membership.duplicate_warnings == []
            assert "ANOTHER NODE" not in " ".join(again.status()["warnings"])

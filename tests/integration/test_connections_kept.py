"""Whom a node stays connected to is the runtime's choice: py-libp2p's auto-connector, which
dialed every peer in the peerstore (about 70 connections a node at N = 100 where 32 are
dialled), is off, and the node redials its bootstrap peers itself when it has lost them all;
bootstrap peers redial each other."""

from __future__ import annotations

import pytest
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

import bootstrap.service
import node.runtime
from bootstrap.service import BootstrapConfig, BootstrapPeer
from swarm.net import parse_multiaddr
from tests.netfactory import LOOPBACK, NetFactory, key_named, wait_until


async def test_a_peer_known_to_the_peerstore_is_not_dialled_by_py_libp2p() -> None:
    async with NetFactory() as net:
        alice = await net.node("inference", key_named("alice"), bootstrap=[])
        bob = await net.node("inference", key_named("bob"), bootstrap=[])
        info = info_from_p2p_addr(parse_multiaddr(bob.overlay.addrs()[0]))
        host = alice.overlay.host
        host.get_peerstore().add_addrs(info.peer_id, info.addrs, 3600)
        await host.get_network().auto_connector.maybe_connect()
        assert not alice.overlay.connected(bob.peer_id)
        assert ID.from_base58(bob.peer_id) in host.get_peerstore().peers_with_addrs()


async def test_a_node_redials_its_bootstrap_peer_after_losing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(node.runtime, "KEEP_CONNECTED_S", 0.2)
    async with NetFactory() as net:
        boot = await net.bootstrap()
        alice = await net.node("inference", key_named("alice"))
        await wait_until(lambda: alice.overlay.connected(boot.peer_id), 10)
        await alice.overlay.forget_peer(boot.peer_id)
        assert not alice.overlay.connected(boot.peer_id)
        await wait_until(lambda: alice.overlay.connected(boot.peer_id), 10)
        assert alice.bootstrap_connected == [boot.addrs()[0]]


async def test_bootstrap_peers_redial_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bootstrap.service, "KEEP_CONNECTED_S", 0.2)
    async with NetFactory() as net:
        first = await net.bootstrap()
        config = BootstrapConfig(
            key=key_named("second bootstrap"),
            listen=LOOPBACK,
            heartbeat=net.heartbeat,
            genesis=(net.genesis,),
            peers=(first.addrs()[0],),
        )
        async with BootstrapPeer.start(config) as second:
            assert second.overlay.connected(first.peer_id)
            await second.overlay.forget_peer(first.peer_id)
            await wait_until(lambda: second.overlay.connected(first.peer_id), 10)

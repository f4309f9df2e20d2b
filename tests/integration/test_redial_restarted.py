"""A peer restarted on a new port is dialed at its new address by a peer that still holds its
old one: py-libp2p dials one TCP address per peer (the first its peerstore holds), so the old
address shadowed the new and every dial-back called a restarted node private."""

from __future__ import annotations

import trio

from tests.netfactory import NetFactory, key_named, wait_until


async def test_a_peer_restarted_on_a_new_port_is_dialed_at_the_new_one() -> None:
    async with NetFactory() as net:
        alice = await net.node("inference", key_named("alice"), bootstrap=[])
        bob = key_named("bob")
        async with net.node_scope("inference", bob, bootstrap=[]) as first_life:
            old = first_life.overlay.addrs()
            assert await alice.overlay.connect(bob.peer_id, old) is None
        await wait_until(lambda: not alice.overlay.connected(bob.peer_id), 10)
        async with net.node_scope("inference", bob, bootstrap=[]) as second_life:
            new = second_life.overlay.addrs()
            assert not set(new) & set(old)  # another port
            with trio.fail_after(10):
                assert await alice.overlay.connect(bob.peer_id, new) is None
            assert alice.overlay.connected(bob.peer_id)

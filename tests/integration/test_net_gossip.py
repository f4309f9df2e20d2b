"""Policy gossip validation on a line of three real nodes: A (trainer) - B - C; flood
publishing."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from swarm.messages import PolicyAnnouncement, sign
from swarm.net import POLICY_MAX_BYTES, policy_topic
from swarm.net.overlay import Overlay, OverlayConfig
from tests.netfactory import NetFactory, key_named, wait_until


async def test_invalid_announcements_stop_at_the_first_honest_node() -> None:
    async with NetFactory() as net:
        b = await net.node("inference", bootstrap=[], connect_found_peers=False)
        addr = b.overlay.addrs()[:1]
        a = await net.node("trainer", bootstrap=addr, connect_found_peers=False)
        c = await net.node("inference", bootstrap=addr, connect_found_peers=False)
        topic = policy_topic(a.run_id)
        await wait_until(lambda: len(b.overlay.mesh_peers(topic)) == 2, 10)
        await wait_until(lambda: a.overlay.mesh_peers(topic) and c.overlay.mesh_peers(topic), 10)
        # py-libp2p's DHT lookups may connect A and C directly; then C's own gate is hit too.
        line = c.peer_id not in a.overlay.topic_peers(topic)

        # A forwards whatever it is given (its own gate removed), so B's gate is what is tested.
        a.overlay.pubsub.remove_topic_validator(topic)
        mallory = key_named("mallory")
        forged = sign(PolicyAnnouncement(a.run_id, 5, b"\x05" * 32, 1), mallory)
        other_run = sign(PolicyAnnouncement("0" * 32, 6, b"\x06" * 32, 1), a.key)
        for data in (forged.raw, other_run.raw, b"\x00" * (POLICY_MAX_BYTES + 1)):
            await a.overlay.publish(topic, data)

        v2 = sign(PolicyAnnouncement(a.run_id, 2, b"\x02" * 32, 2), a.key)
        await a.overlay.publish(topic, v2.raw)
        await wait_until(lambda: c.policy.version == 2, 10)
        replay_old = sign(PolicyAnnouncement(a.run_id, 1, b"\x01" * 32, 3), a.key)
        await a.overlay.publish(topic, replay_old.raw)
        await a.overlay.publish(topic, v2.raw)  # the same envelope again, a new pubsub seqno
        v3 = sign(PolicyAnnouncement(a.run_id, 3, b"\x03" * 32, 4), a.key)
        await a.overlay.publish(topic, v3.raw)
        await wait_until(lambda: c.policy.version == 3, 10)

        rejected = b.stats.as_dict()["rejected"]["policy"]
        assert rejected == {
            "not-authorized": 1,
            "wrong-run": 1,
            "oversize": 1,
            "stale": 1,
            "duplicate": 1,
        }
        assert c.stats.as_dict()["accepted"] == {"policy": 2}
        if line:
            assert c.stats.as_dict()["rejected"] == {}
        assert c.policy.newest.message.manifest_id == b"\x03" * 32


async def test_the_publisher_floods_its_own_message_to_every_subscribed_peer() -> None:
    """Flood publishing: the publisher's mesh cut to one peer (in a large swarm it holds
    ``degree`` of its many connections) and no heartbeat for 60 s (no lazy gossip, no mesh
    repair): the three subscribers it is connected to (not to each other) all get its message
    at once. Without flooding, two of them would wait for the next heartbeat's gossip."""
    config = OverlayConfig(heartbeat=60.0, gossip_degree=(1, 1, 1))
    topic = "flood-test"
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(Overlay.start(key_named("flood-pub"), config))
        pub.flood_publish(topic)
        await pub.subscribe(topic)
        subs = []
        for i in range(3):
            peer = await stack.enter_async_context(Overlay.start(key_named(f"flood-{i}"), config))
            subs.append(await peer.subscribe(topic))
            assert await peer.connect(pub.peer_id, pub.addrs()) is None
        await wait_until(lambda: len(pub.topic_peers(topic)) == 3, 10)
        mesh = pub.gossipsub.mesh.setdefault(topic, set())
        while len(mesh) > 1:
            mesh.pop()
        await pub.publish(topic, b"announcement")
        with trio.fail_after(5):
            for sub in subs:
                assert bytes((await sub.get()).data) == b"announcement"

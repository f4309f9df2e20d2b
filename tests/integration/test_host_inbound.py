"""A host keeps accepting connections for its whole life. py-libp2p 0.8.1 holds one of
``max_connections - min_connections`` inbound slots until the host stops, not until the
connection closes: with a cap of 3 a host refused its 4th inbound connection ever, even with
none open (and with py-libp2p's defaults, its 251st). ``swarm.net.host.build_host`` replaces
that limiter; the cap still counts the connections held."""

from __future__ import annotations

import pytest
from libp2p.peer.id import ID

from node.runtime import Node
from swarm.net.connections import ConnectionBounds
from tests.netfactory import NetFactory, wait_until

CAP = ConnectionBounds(low=2, high=3)
ALONE = {"connect_found_peers": False}
"""Nobody dials the peers its lookups find: only this test's dials open connections. A CI run
beside the other test worker refused the third newcomer (the target held its cap); the
likely third connection was such a background dial (the dialer finding the target's advert
after its last reconnect). Not shown: not reproduced in 6 runs alone. A DHT query still dials
the peers it asks (the dialer leaves before the newcomers come, below)."""


async def reconnect(dialer: Node, target: Node) -> str | None:
    """Dial ``target`` once (a fresh connection); None when connected, else why not."""
    dialer.overlay.unblock(target.peer_id)
    return await dialer.overlay.connect(target.peer_id, target.overlay.addrs(), circuits=False)


@pytest.mark.timeout(120)
async def test_a_capped_host_accepts_connection_after_connection_for_its_whole_life() -> None:
    async with NetFactory() as net:  # no bootstrap peer: nobody dials on their own
        target = await net.node("inference", connections=CAP, **ALONE)
        async with net.node_scope("inference", **ALONE) as dialer:
            for attempt in range(3 * CAP.high):
                assert await reconnect(dialer, target) is None, f"refused at connection {attempt}"
                await dialer.overlay.host.get_network().close_peer(ID.from_base58(target.peer_id))
                await wait_until(lambda: not target.overlay.connected(dialer.peer_id), 10)
        # The dialer leaves first: its own role lookups ask the target (the one peer its DHT
        # knows) and dial it again in the background, which once filled the target's cap
        # before the second newcomer (CI of ec9c95b, beside the other worker).
        await wait_until(lambda: not target.overlay.connected_peers(), 10)
        # The cap itself still holds: with 3 open, a 4th peer is refused.
        others = [await net.node("inference", **ALONE) for _ in range(CAP.high + 1)]
        answers = [await reconnect(o, target) for o in others]
        assert answers[: CAP.high] == [None] * CAP.high and answers[-1] is not None
        assert len(target.overlay.connected_peers()) == CAP.high

"""A role advert is read from the peer it describes when connected to it (one request), and
from the DHT otherwise: at N = 50 the DHT walks of ``get_value`` (about 40 requests an advert)
were most of an idle node's CPU (docs/BENCHMARKS.md, Scale)."""

from __future__ import annotations

from typing import Any

from tests.netfactory import NetFactory, key_named


async def test_a_connected_peers_advert_comes_from_the_peer_itself() -> None:
    async with NetFactory() as net:
        alice = await net.node("inference", key_named("alice"), bootstrap=[])
        bob = await net.node("inference", key_named("bob"), bootstrap=[])
        walks: list[str] = []
        real = alice.overlay.dht.get_value

        async def counted(key: str) -> Any:
            walks.append(key)
            return await real(key)

        alice.overlay.dht.get_value = counted  # type: ignore[method-assign]
        assert await alice.overlay.connect(bob.peer_id, bob.overlay.addrs()) is None
        found = await alice.overlay.records.get_advert(alice.run_id, bob.peer_id)
        assert bob.membership.mine is not None
        assert found is not None and found.raw == bob.membership.mine.raw
        assert walks == []  # no DHT walk for it

        # Not connected (and nobody else to ask): the DHT path, which finds nothing here.
        carol = key_named("carol").peer_id
        assert await alice.overlay.records.get_advert(alice.run_id, carol) is None
        assert len(walks) == 1

"""A role advert is read from the peer it describes when connected to it (one request), and
from the DHT otherwise: at N = 50 the DHT walks of ``get_value`` (about 40 requests an advert)
were most of an idle node's CPU (docs/BENCHMARKS.md, Scale)."""

from __future__ import annotations

from typing import Any

from swarm.net.names import advert_key
from tests.netfactory import NetFactory, key_named, wait_until


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


async def test_a_stale_local_copy_does_not_hide_a_peers_newer_advert() -> None:
    """py-libp2p's ``get_value`` answers from our own store once that holds a copy: a peer we
    cannot ask directly (not connected, or in client mode) that restarted with new addresses
    is read stale by ``get_advert``. ``newest_advert`` (what ``Membership.refresh_advert``
    uses) asks the closest peers and keeps the newest."""
    async with NetFactory() as net:
        alice = await net.node("inference", key_named("alice"), bootstrap=[])
        carol = await net.node("inference", key_named("carol"), bootstrap=[])
        bob = key_named("bob")
        async with net.node_scope("inference", bob, bootstrap=[]) as first_life:
            old = first_life.membership.mine
            newer = first_life.membership.make_advert()  # its next life's advert
        assert old is not None and newer.message.issued_at > old.message.issued_at
        key = advert_key(alice.run_id, bob.peer_id).encode()
        alice.overlay.dht.value_store.put(key, old.raw)  # what alice kept of its first life
        carol.overlay.dht.value_store.put(key, newer.raw)  # carol heard of the next one
        assert await alice.overlay.connect(carol.peer_id, carol.overlay.addrs()) is None
        await wait_until(lambda: carol.peer_id in _table(alice), 10)

        stale = await alice.overlay.records.get_advert(alice.run_id, bob.peer_id)
        assert stale is not None and stale.raw == old.raw  # the local copy, unasked
        fresh = await alice.overlay.records.newest_advert(alice.run_id, bob.peer_id)
        assert fresh is not None and fresh.raw == newer.raw


def _table(node: Any) -> set[str]:
    return {str(p) for p in node.overlay.dht.routing_table.get_peer_ids()}

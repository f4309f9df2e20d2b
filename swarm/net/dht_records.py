"""The records a node keeps in and reads from the Kademlia DHT: signed RoleAdverts (a value
under ``advert_key``, validated by ``RoleAdvertValidator``) and provider records (a peer says
it serves a role or a policy version).

py-libp2p choices made here, each for a reason:
- an advert of a connected peer that serves the DHT is asked of that peer alone (it signs its
  own advert), not looked up by a walk that stores the record back at every peer lacking it;
- every advert read is checked again (py-libp2p returns locally stored records unchecked);
- ``find_providers`` asks the closest peers every time (py-libp2p's answers from the local
  store alone once that holds any provider, so a node would never see later joiners).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL
from libp2p.peer.id import ID

from swarm.errors import NetworkError, SwarmError
from swarm.messages import RoleAdvert, Signed
from swarm.net.names import advert_key
from swarm.net.records import Clock, check_advert

log = logging.getLogger(__name__)

_QUERY_TIMEOUT_S = 5.0
_ASK_CLOSEST = 4
_ASK_WALKED = 8
"""How many of the closest peers a walk found ``find_providers(walk=True)`` asks."""
_WALK_TIMEOUT_S = 10.0
"""The longest that walk may take (it dials peers that may be gone)."""
_SETTLE_S = 1.0
"""How long the other closest peers may still answer a provider lookup once one named a provider."""


class DhtRecords:
    """RoleAdverts and provider records in one node's DHT (``Overlay.records``)."""

    def __init__(self, host: Any, dht: Any, clock: Clock, connected: Callable[[str], bool]) -> None:
        self.host = host
        self.dht = dht
        self._clock = clock
        self._connected = connected
        self._me = str(host.get_id())

    async def put_advert(self, signed: Signed[RoleAdvert]) -> None:
        key = advert_key(signed.message.run_id, signed.message.peer_id)
        try:
            await self.dht.put_value(key, signed.raw)
        except SwarmError:
            raise
        except Exception as exc:
            raise NetworkError(f"publishing the RoleAdvert failed: {exc}") from exc

    async def get_advert(self, run_id: str, peer_id: str) -> Signed[RoleAdvert] | None:
        """The peer's newest valid RoleAdvert, checked again here (py-libp2p returns a locally
        stored record without validating it)."""
        key = advert_key(run_id, peer_id)
        if self._connected(peer_id) and self._serves_dht(peer_id):
            # The advert is signed by the peer it describes, so that peer is as good a source
            # as any: one request to it, where py-libp2p's ``get_value`` asks the closest peers
            # it finds and stores the record back at those that lack it (about 40 DHT requests
            # an advert; at N = 50 that was most of an idle node's CPU, docs/BENCHMARKS.md).
            # No walk when it does not answer: on a busy machine the direct ask timed out and
            # the walk that followed made the machine busier still (N = 100).
            return await self._advert_from(peer_id, key)
        try:
            raw = await self.dht.get_value(key)
        except Exception as exc:
            log.debug("get_value %s failed: %s", key, exc)
            return None
        if raw is None:
            return None
        try:
            return check_advert(raw, key=key, now_ms=self._clock())
        except SwarmError:
            return None

    async def newest_advert(self, run_id: str, peer_id: str) -> Signed[RoleAdvert] | None:
        """The newest valid RoleAdvert the swarm holds for ``peer_id``, whatever our own store
        holds. ``get_advert`` reads a peer that does not serve the DHT (a private node, in
        client mode) through py-libp2p's ``get_value``, which answers from our local store
        alone once that holds a copy: a peer restarted with new addresses (a trainer's new
        hivemind DHT) was read stale until the copy expired, and two trainers never met
        again (``bench/trainer_kills.py``, docs/RELIABILITY.md). This asks the peer itself
        when it serves the DHT, otherwise the ``_ASK_CLOSEST`` closest peers our table knows
        (a network lookup when it knows none), and keeps the newest by ``issued_at``."""
        key = advert_key(run_id, peer_id)
        if self._connected(peer_id) and self._serves_dht(peer_id):
            return await self._advert_from(peer_id, key)
        closest = await self._closest(key.encode())
        found: list[Signed[RoleAdvert]] = []

        async def ask(peer: str) -> None:
            advert = await self._advert_from(peer, key)
            if advert is not None:
                found.append(advert)

        async with trio.open_nursery() as nursery:
            for peer in {str(p) for p in closest[:_ASK_CLOSEST]} - {self._me}:
                nursery.start_soon(ask, peer)
        local = await self.get_advert(run_id, peer_id) if not found else None
        found += [local] if local is not None else []
        return max(found, key=lambda a: a.message.issued_at, default=None)

    async def _closest(self, raw: bytes) -> list[Any]:
        """The peers closest to ``raw`` that our routing table knows; an iterative network
        lookup only when it knows none (a lookup per role per round would cost every node a
        busy CPU), and our connections when that fails."""
        closest = self.dht.routing_table.find_local_closest_peers(raw, _ASK_CLOSEST)
        if not closest:
            try:
                closest = await self.dht.peer_routing.find_closest_peers_network(raw)
            except Exception as exc:
                log.debug("closest-peers lookup failed: %s", exc)
                closest = list(self.host.get_connected_peers())
        return list(closest)

    def _serves_dht(self, peer_id: str) -> bool:
        """The peer said (identify) it answers DHT requests: a private node, in client mode,
        does not, and its advert is found by the walk only."""
        try:
            protocols = self.host.get_peerstore().get_protocols(ID.from_base58(peer_id))
        except Exception:  # not identified yet, or no such peer
            return False
        return str(KAD_PROTOCOL) in {str(p) for p in protocols}

    async def _advert_from(self, peer_id: str, key: str) -> Signed[RoleAdvert] | None:
        """The advert ``peer_id`` holds in its own DHT store for ``key``, checked; ``None``
        when it does not answer within 2 s or holds none that is valid."""
        with trio.move_on_after(2):
            try:
                raw = await self.dht.value_store._get_from_peer(
                    ID.from_base58(peer_id), key.encode()
                )
                if isinstance(raw, bytes):
                    return check_advert(raw, key=key, now_ms=self._clock())
            except Exception as exc:  # any failure: the next discovery round asks again
                log.debug("advert of %s from itself: %s", peer_id, exc)
        return None

    async def remote_adverts(self, run_id: str, peer_id: str, limit: int = 8) -> list[bytes]:
        """The advert records that connected peers hold for ``peer_id`` (skipping our own
        store), to notice another live node with the same key."""
        key = advert_key(run_id, peer_id).encode()
        out: list[bytes] = []
        for peer in list(self.host.get_connected_peers())[:limit]:
            try:
                with trio.move_on_after(2):
                    value = await self.dht.value_store._get_from_peer(peer, key)
                    if isinstance(value, bytes):
                        out.append(value)
            except Exception:
                continue
        return out

    async def provide(self, key: str) -> None:
        try:
            await self.dht.provide(key)
        except Exception as exc:
            raise NetworkError(f"publishing a provider record failed: {exc}") from exc

    async def find_providers(self, key: str, count: int = 64, *, walk: bool = False) -> list[str]:
        """Peer IDs (deduplicated) that announced themselves under ``key`` (hex).

        py-libp2p's ``find_providers`` answers from the local store alone as soon as that holds
        any provider, so a node would only ever see peers that joined after it; this asks the
        ``_ASK_CLOSEST`` peers closest to the key as well, every time, at once. Once one has
        named a provider, the others get ``_SETTLE_S`` more: each of them holds the same records (a
        provider places its record at the closest peers), and a gone peer behind a NAT that
        drops our SYN would otherwise cost every lookup the whole ``_QUERY_TIMEOUT_S`` (the
        NAT test: a worker fetched one version every 5 s, never caught up with a trainer
        publishing every second, and was never credited again; docs/RELIABILITY.md).

        ``walk``: when those name nobody, ask the ``_ASK_WALKED`` closest peers an iterative
        network lookup finds (a DHT walk, about 40 requests). With bounded connections a
        node's routing table is a sample of the run, and for a newcomer a small one: the
        closest peers it knows to a key may be far from those a provider placed its record
        at (a 30-node test's newcomer at a cap of 12 found none of 4 holders, and its fetch
        failed, while the validator's lookup named 2).
        """
        raw = bytes.fromhex(key)
        store = self.dht.provider_store
        found: dict[str, Any] = {str(p.peer_id): p for p in store.get_providers(raw)}
        asked = [p for p in (await self._closest(raw))[:_ASK_CLOSEST] if str(p) != self._me]
        await self._ask_providers(asked, raw, found)
        if walk and not set(found) - {self._me}:
            walked: list[Any] = []
            with trio.move_on_after(_WALK_TIMEOUT_S):  # dials to gone peers: bounded
                try:
                    walked = await self.dht.peer_routing.find_closest_peers_network(raw)
                except Exception as exc:
                    log.debug("closest-peers lookup failed: %s", exc)
            more = [p for p in walked if str(p) != self._me and p not in asked][:_ASK_WALKED]
            await self._ask_providers(more, raw, found)
        return list(found)[:count]

    async def _ask_providers(self, peers: list[Any], raw: bytes, found: dict[str, Any]) -> None:
        """Ask ``peers`` at once for the providers of ``raw``, adding them to ``found`` (and
        our store); see ``find_providers`` for when it stops."""
        if not peers:
            return
        store = self.dht.provider_store
        answered = trio.Event()
        left = len(peers)

        async def ask(peer: Any, nursery: trio.Nursery) -> None:
            nonlocal left
            try:
                with trio.move_on_after(_QUERY_TIMEOUT_S):
                    try:
                        providers, _ = await store._get_providers_from_peer_with_closers(peer, raw)
                    except Exception as exc:
                        log.debug("providers query to %s failed: %s", peer, exc)
                        return
                    for info in providers or ():
                        if str(info.peer_id) not in found:
                            found[str(info.peer_id)] = info
                            store.add_provider(raw, info)
                    if providers:  # py-libp2p answers a failed query with none, at once
                        answered.set()
            finally:
                left -= 1
                if left == 0:
                    nursery.cancel_scope.cancel()  # every peer is done: no settling to wait

        async def settle(nursery: trio.Nursery) -> None:
            await answered.wait()
            await trio.sleep(_SETTLE_S)
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(settle, nursery)
            for peer in peers:
                nursery.start_soon(ask, peer, nursery)

"""Build a py-libp2p host whose peer ID is the node key's, and parse user-given addresses.

TCP + Noise + yamux (py-libp2p's defaults), a resource manager with connection limits, identify
and ping. Every libp2p type stays behind this module and ``swarm.net.overlay``; what a user typed
wrong comes back as ``ConfigError`` before any socket is opened.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.protocol_muxer.exceptions import MultiselectError
from libp2p.protocol_muxer.multiselect import Multiselect
from libp2p.rcmgr import new_resource_manager
from libp2p.rcmgr.connection_limits import ConnectionLimits
from libp2p.utils.address_validation import expand_wildcard_address

from swarm.errors import ConfigError
from swarm.identity import NodeKey, public_from_peer_id

DEFAULT_LISTEN = ("/ip4/0.0.0.0/tcp/4001",)
UNBOUNDED = 1_000_000
"""py-libp2p's own connection limits, set out of reach (``build_host``)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HostLimits:
    """Connection limits handed to py-libp2p's resource manager (``None`` in ``build_host``
    keeps py-libp2p's defaults, which also bound streams and memory)."""

    max_connections: int = 256
    max_per_peer: int = 4
    max_pending_inbound: int = 64


def key_pair(key: NodeKey) -> KeyPair:
    """The libp2p key pair of a node key (same Ed25519 key, so the same peer ID)."""
    private = Ed25519PrivateKey.from_bytes(key.seed)
    return KeyPair(private, private.get_public_key())


def parse_multiaddr(text: str) -> Any:
    """A ``multiaddr.Multiaddr``; ``ConfigError`` naming the address if it is malformed."""
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:  # the multiaddr package raises several unrelated types
        raise ConfigError(f"{text!r} is not a valid multiaddr: {exc}") from exc


def parse_peer_addr(text: str) -> PeerInfo:
    """A dialable peer address ``/ip4/.../tcp/.../p2p/<peer id>``; ``ConfigError`` otherwise."""
    addr = parse_multiaddr(text)
    try:
        info = info_from_p2p_addr(addr)
    except Exception as exc:
        raise ConfigError(
            f"{text!r} is not a dialable peer address; it needs a transport part and a"
            " /p2p/<peer id> part, e.g. /ip4/203.0.113.5/tcp/4001/p2p/12D3KooW..."
        ) from exc
    if not info.addrs:
        raise ConfigError(f"{text!r} names a peer but no address to dial it at")
    return info


def peer_of(addr: str) -> str | None:
    """The peer ID an address ends with (``.../p2p/<id>``, relayed ones included:
    ``.../p2p/<relay>/p2p-circuit/p2p/<id>``); ``None`` when it ends with none."""
    _, sep, peer = addr.rpartition("/p2p/")
    return peer if sep and peer and "/" not in peer else None


def peer_ids(addrs: Iterable[str]) -> list[str]:
    """The peer IDs ``addrs`` end with (``peer_of``), in order, skipping those naming none."""
    return [p for p in map(peer_of, addrs) if p is not None]


def check_peer_id(text: str) -> ID:
    """A libp2p ``ID`` from its base58 form; ``ConfigError`` if it is not an Ed25519 peer ID."""
    try:
        public_from_peer_id(text)
        return ID.from_base58(text)
    except Exception as exc:
        raise ConfigError(f"{text[:60]!r} is not an Ed25519 peer ID") from exc


def build_host(
    key: NodeKey,
    listen: Sequence[str],
    limits: HostLimits | None = None,
    connection_cap: int | None = None,
) -> Any:
    """A py-libp2p ``BasicHost`` for ``key``, not yet listening (``host.run(addrs)`` does that).

    Raises ``ConfigError`` for a malformed listen address.
    """
    addrs = [parse_multiaddr(a) for a in listen]
    rcmgr = None  # None: py-libp2p builds its default resource manager
    if limits is not None:
        rcmgr = new_resource_manager(
            connection_limits=ConnectionLimits(
                max_established_total=limits.max_connections,
                max_established_per_peer=limits.max_per_peer,
                max_pending_inbound=limits.max_pending_inbound,
            ),
            enable_metrics=False,
        )
    # ``connection_cap``: py-libp2p's swarm refuses any dial and any inbound connection past
    # it (``ConnectionConfig.max_connections``, checked on both paths against the connections
    # it holds), and the dialer then keeps us in its 60 s negative dial cache: a refusal slows
    # whoever keeps dialing a full node (closing newcomers after the handshake instead made 30
    # loopback nodes redial each other without pause). Its pruner and auto-connector have
    # nothing to do (``swarm.net.connections`` trims, ``_no_auto_connect`` below).
    cap = connection_cap or UNBOUNDED
    config = ConnectionConfig(
        max_connections=cap, min_connections=0, low_watermark=cap, high_watermark=cap
    )
    host = new_host(
        key_pair=key_pair(key),
        listen_addrs=addrs,
        resource_manager=rcmgr,
        connection_config=config,
    )
    if host.get_id().to_base58() != key.peer_id:  # pragma: no cover - a py-libp2p change
        raise ConfigError("py-libp2p derived another peer ID from the node key")
    # py-libp2p retries every failed dial three more times (0.1 s, 0.2 s, 0.4 s), including a
    # Noise handshake that failed because another peer answers (its "Peer ID mismatch"
    # shortcut never matches the Noise error text). Our dialers retry with their own backoff
    # and say why each attempt failed, so one attempt per dial is enough here.
    network = host.get_network()
    if hasattr(network, "retry_config"):
        network.retry_config = RetryConfig(max_retries=0)
    # py-libp2p 0.8.1 holds one of (max_connections - min_connections) inbound slots for as
    # long as the swarm runs, not the connection (``Swarm._handle_inbound_connection`` waits on
    # ``manager.wait_finished()`` inside ``_inbound_limiter``): with its defaults (300, 50) a
    # host refuses every inbound connection after the 250th of its life (a bootstrap peer in
    # a long run), and with a cap of 12 a trainer refused every newcomer while it held 8
    # (tests/integration/test_connection_bounds.py). The cap above counts the connections
    # held; this limiter is made too large to matter (swarm/internals.py checks the name).
    if hasattr(network, "_inbound_limiter"):
        network._inbound_limiter = trio.CapacityLimiter(UNBOUNDED)
    # py-libp2p's auto-connector dials every peer its peerstore knows until the host holds
    # (low + high watermark) / 2 = 200 connections, every 10 s while under 50: every node ended
    # up connected to nearly every other (69 connections a node at N = 100, where our runtime
    # dials 32), each with its identify, GossipSub and DHT streams, which saturated 2 cores
    # with nothing to broadcast (docs/BENCHMARKS.md, Scale). Whom a node connects to is the
    # runtime's choice (``node.runtime.Node._keep_connected``; the bootstrap peers' own loop).
    connector = getattr(network, "auto_connector", None)
    if connector is not None:
        connector.maybe_connect = _no_auto_connect
    if connection_cap is not None:
        _CapDials(network, connection_cap).install()
    basic: Any = host  # a BasicHost: its negotiation, guarded (below)
    basic.multiselect = _GuardedMultiselect(dict(basic.multiselect.handlers))
    return host


AT_CAP = "Maximum connections limit reached"
"""py-libp2p's words for a connection refused at the cap (``Swarm``), ours too."""


class RoomKeeper(Protocol):
    """What decides which connection goes at the cap (``swarm.net.connections``'s trimmer)."""

    async def make_room(self, *, wanted: bool = False) -> bool:
        """Room for one connection about to open; False: none may go."""
        ...

    def room(self, *, wanted: bool = False) -> AbstractAsyncContextManager[bool]:
        """The same, held for the block: a dial under way counts against the cap."""
        ...


_WANTED: set[Any] = set()
"""The trio tasks inside ``wanted_dials``. Not a ``ContextVar``: trio copies the spawner's
context into each task it starts, so the tasks a dial starts (the connection's own, its
handlers, their DHT queries) inherited it, and in the 30-node test their dials pushed out
each other's connections until provider lookups failed."""


@contextlib.contextmanager
def wanted_dials() -> Iterator[None]:
    """Dials this task makes inside the block are wanted now (a request of ours to a peer:
    a holder of a version, a validator): at our cap they may push out a young idle
    connection, and the room made for each is held until it is done (``_CapDials``). A DHT
    query's dials, made by other tasks, are not."""
    task = trio.lowlevel.current_task()
    outer = task in _WANTED
    _WANTED.add(task)
    try:
        yield
    finally:
        if not outer:
            _WANTED.discard(task)


class _CapDials:
    """Our dials at our own connection cap. py-libp2p 0.8.1 refuses an outbound dial when the
    host holds ``max_connections`` (``Swarm._dial_addr_single_attempt``), counts that as the
    remote peer failing every address, and keeps the peer in its negative dial cache for
    60 s: a node that joined 30 loopback nodes with a cap of 12 filled its cap with its
    first DHT walk's connections and had 19 healthy peers blocked two seconds later, so its
    lookups failed for a minute (tests/integration/test_connection_bounds.py timed out
    waiting for it to find the trainer). Here a dial to a peer we are not connected to at
    the cap first makes room (``set_room_keeper``: the connection trimmer closes its least
    useful connection), and a dial that failed while we were at the cap leaves the peer out
    of the negative cache: the refusal was ours. A wanted dial (``wanted_dials``) holds its
    room until it is done, so that dials at once each get their own: two requests of a
    fetch picked the same connection to close (a close takes 0.1 s) and one was refused at
    our own cap (tests/integration/test_connection_bounds.py, docs/RELIABILITY.md).

    Inbound the same: a connection that arrives at the cap makes room before py-libp2p's check
    refuses it (``Swarm.upgrade_inbound_raw_conn``). A node that just took a burst of
    connections (its own copy of a version, the DHT walks of its provider record) sat at its cap
    and refused a newcomer fetching what it holds, without asking its trimmer; the newcomer then
    kept it in its negative cache for 60 s and took all 31 shards from one peer (a CI run of the
    test above). What is trimmed is what the trimmer may trim anyway (past its grace, in no
    transfer, not protected), and a connection that carried nothing but DHT queries and the other
    idle protocols once past 2 s, ours first (``ConnectionBounds.dial_grace_s``): a flood of
    newcomers cannot push out a peer in use."""

    def __init__(self, network: Any, cap: int) -> None:
        self.network = network
        self.cap = cap
        self.keeper: RoomKeeper | None = None
        self._dial_peer = network.dial_peer
        self._upgrade_inbound = network.upgrade_inbound_raw_conn

    def install(self) -> None:
        self.network.dial_peer = self.dial_peer
        self.network.upgrade_inbound_raw_conn = self.upgrade_inbound_raw_conn

    def full(self) -> bool:
        return len(self.network.get_connections()) >= self.cap

    async def dial_peer(self, peer_id: Any) -> Any:
        keeper = self.keeper
        if keeper is None or self.network.get_connections(peer_id):
            return await self._dial(peer_id)
        if trio.lowlevel.current_task() in _WANTED:
            async with keeper.room(wanted=True):
                return await self._dial(peer_id)
        if not await keeper.make_room() and not self.full():
            # The last places are held for wanted dials under way: py-libp2p would let this
            # one through, and whichever landed first took the place (a DHT query's dial
            # refused a newcomer's dial to a holder at its own cap).
            raise SwarmException(f"{AT_CAP} (held for a dial of ours under way)")
        return await self._dial(peer_id)

    async def _dial(self, peer_id: Any) -> Any:
        try:
            return await self._dial_peer(peer_id)
        except Exception:
            if self.full():
                _unblock(self.network, peer_id)
            raise

    async def upgrade_inbound_raw_conn(self, raw_conn: Any, maddr: Any) -> Any:
        room = self.keeper is None or await self.keeper.make_room(wanted=True)
        if not room and not self.full():  # at the cap itself, py-libp2p refuses it (below)
            await raw_conn.close()
            raise SwarmException(f"{AT_CAP} (held for a dial of ours under way)")
        return await self._upgrade_inbound(raw_conn, maddr)


def unblock(host: Any, peer_id: Any) -> None:
    """Let the next dial to ``peer_id`` (a py-libp2p ``ID``) happen: py-libp2p keeps a peer
    whose addresses all failed in a negative cache for 60 s (a peer that was down, or refused
    us at its connection cap, included)."""
    _unblock(host.get_network(), peer_id)


def _unblock(network: Any, peer_id: Any) -> None:
    if hasattr(network, "unblock_peer"):
        network.unblock_peer(peer_id)


async def close_peers(host: Any, peers: Iterable[Any]) -> None:
    """Close our connections to ``peers`` (py-libp2p ``ID``s) all at once: py-libp2p's yamux
    close sleeps 0.1 s after its GO_AWAY, and one peer after another was most of a node's
    stop (30 loopback nodes stopped in 43 s). A connection that closed under us is closed."""
    network = host.get_network()

    async def close(peer: Any) -> None:
        try:
            await network.close_peer(peer)
        except Exception as exc:
            log.debug("closing the connection to %s: %s", str(peer)[-8:], exc)

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(close, peer)


def set_room_keeper(host: Any, keeper: RoomKeeper | None) -> None:
    """What a host built with a ``connection_cap`` asks before a new connection at its cap
    (``_CapDials``); ``None`` when its owner stops."""
    guard = getattr(getattr(host.get_network(), "dial_peer", None), "__self__", None)
    if isinstance(guard, _CapDials):
        guard.keeper = keeper


class _GuardedMultiselect(Multiselect):
    """py-libp2p's protocol negotiation, with one race closed: it checks that a protocol has a
    handler, awaits its answer to the peer, then reads the handler. A handler removed in
    between (``Overlay._quiesce`` removes GossipSub's while a node stops) raised ``KeyError``
    out of the connection's nursery and ended the whole host (a CI failure of the validators'
    swarm audit: ``KeyError: '/meshsub/1.1.0'``). Here it is what it is: a protocol this host
    no longer speaks, a failed negotiation, the stream reset."""

    async def negotiate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().negotiate(*args, **kwargs)
        except KeyError as exc:
            raise MultiselectError(f"protocol {exc} was removed during negotiation") from exc


async def _no_auto_connect() -> None:
    """Stands in for py-libp2p's ``AutoConnector.maybe_connect`` (see ``build_host``)."""


def listen_addrs(listen: Sequence[str]) -> list[Any]:
    return [parse_multiaddr(a) for a in listen]


_WILDCARDS = ("/ip4/0.0.0.0/", "/ip6/::/")


def _concrete(addr: Any) -> list[Any]:
    """A listen address as others can dial it: a wildcard (``0.0.0.0``, ``::``) becomes the
    machine's interface addresses (py-libp2p would advertise the wildcard itself)."""
    if not str(addr).startswith(_WILDCARDS):
        return [addr]
    try:
        expanded = list(expand_wildcard_address(addr))
    except Exception:  # interface enumeration is best effort
        return [addr]
    return expanded or [addr]


def full_addrs(host: Any) -> list[str]:
    """The host's dialable addresses, each ending in ``/p2p/<peer id>``."""
    peer = host.get_id().to_base58()
    out: list[str] = []
    for listen in host.get_addrs():
        for addr in _concrete(listen):
            text = str(addr)
            text = text if "/p2p/" in text else f"{text}/p2p/{peer}"
            if text not in out:
                out.append(text)
    return out

"""Bounded connections: a host keeps between ``low`` and ``high`` connections, trimming the
least useful ones above a trim mark under ``high`` and never the protected ones.

Why not py-libp2p's own connection manager (``libp2p.network.connection_pruner``, 0.8.x): it
never trims a connection with an open stream, and GossipSub keeps one open on every connection
it has, so in a node that gossips it trims nothing; it also runs only when a connection
arrives. Its ``ConnectionConfig.max_connections`` is the hard cap, ``high``
(``swarm.net.host.build_host``, which also frees the inbound slots 0.8.1 leaks). This trimmer
uses public pieces (``get_connected_peers``, ``get_connections``, ``get_streams``,
``close_peer``, a notifee) with a notion of use that fits a swarm: a stream other than gossip,
identify, ping and DHT queries is a transfer in progress (a shard, a manifest, a submission),
and a peer whose last such stream closed under ``in_use_s`` ago is still in use.

What is protected is the owner's choice (``protected``): for a node, its run's trainers and
validators, its bootstrap peers and the relays it holds reservations on
(``node.runtime.Node``). What is trimmed first: peers outside our gossip mesh, then the newest
(the mesh and the long-lived connections carry the announcements; a peer that just arrived
gets ``grace_s`` to start its transfer before it may be trimmed).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import INotifee
from libp2p.peer.id import ID

from swarm.errors import ConfigError
from swarm.net.host import close_peers, set_room_keeper

log = logging.getLogger(__name__)

IDLE_PROTOCOLS = ("/meshsub/", "/ipfs/id/", "/ipfs/ping/", "/floodsub/", "/ipfs/kad/")
"""Streams that are no transfer: the long-lived gossip, identify and ping ones, and DHT
queries (a few small messages, retried at another peer if cut). Every node of a run queries
the DHT every few seconds (discovery, adverts, provider records), so counting them as use
left every peer in use and nothing trimmable: 30 loopback nodes sat at their cap and refused
a newcomer (``tests/integration/test_connection_bounds.py``)."""


@dataclass(frozen=True)
class ConnectionBounds:
    """Low and high water marks of a host's connections (``low <= high``)."""

    low: int = 32
    high: int = 48
    grace_s: float = 10.0
    """A connection younger than this is never trimmed (its first transfer may be starting)."""
    dial_grace_s: float = 2.0
    """For a connection wanted now at the cap (``make_room(wanted=True)``: one arriving, a
    request of ours), the grace of a connection that carried nothing but idle protocols: a DHT
    query's, done within this (ours first, then one a peer opened to us). A node that placed
    its provider record (about 20 dials at once, on a small swarm) held only young connections
    for 10 s and refused a newcomer fetching what it had just copied; young connections others
    opened for their DHT queries go too (not shown to matter: the refusals left in the 30-node
    test were the newcomer's own cap, docs/RELIABILITY.md). Only under that pressure: in the
    periodic trim it doubled the trims of 30 forming nodes (1,500-1,700 against 600-900) and
    slowed their start by a third."""
    in_use_s: float = 30.0
    """A peer whose last transfer stream (either way; not gossip, identify, ping or DHT)
    closed this recently is in use: a fetch between two shard requests, a submission; never
    trimmed."""

    @property
    def trim_at(self) -> int:
        """Trimming starts above this count, below ``high`` (the hard cap, refused past): the
        gap is room for the connections others open to us (a dial-back that says we are
        reachable, a newcomer fetching what we hold) between two trims."""
        return max(self.low, self.high - max(1, (self.high - self.low) // 2))

    @property
    def dial_below(self) -> int:
        """A node dials peers it found only while it holds fewer than this, below ``low`` by
        the same gap as the trim mark above it: a node between the two neither dials nor
        trims. Dialing up to ``low`` itself, with inbound dials on top, pushed nodes over the
        trim mark, and each peer trimmed dialed another (1,267 trims among 30 nodes with marks
        8 and 12, tests/integration/test_connection_bounds.py)."""
        return max(1, self.low - (self.trim_at - self.low))

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ConfigError(
                f"connection bounds need 1 <= low <= high (got low {self.low}, high"
                f" {self.high}): --conn-low and --conn-high"
            )


ROLE_BOUNDS = {"trainer": (128, 192), "validator": (128, 192)}
"""The run's servers keep more: every worker submits to a validator and fetches from a
trainer, and a flood of fresh identities holding busy connections must not fill a
validator's bound (``tests/integration/test_sybil_flood.py``'s 50). Any other role: the
``ConnectionBounds`` defaults."""


def bounds_for(role: str, low: int | None = None, high: int | None = None) -> ConnectionBounds:
    """The marks for ``role``, with what the operator set (a flag, ``config.toml``): one
    mark set alone moves the other only as far as ``low <= high`` needs."""
    default = ConnectionBounds()
    dlow, dhigh = ROLE_BOUNDS.get(role, (default.low, default.high))
    if low is None:
        low = dlow if high is None else min(dlow, high)
    if high is None:
        high = max(dhigh, low)
    return ConnectionBounds(low=low, high=high)


@dataclass
class TrimStats:
    trims: int = 0
    """Connections this host closed to keep under its high water mark."""
    last_trim_at: float | None = None
    peak: int = 0
    """The most connections seen at one check."""
    recent: list[str] = field(default_factory=list)
    """The last peers trimmed (newest last, at most 16)."""


class ConnectionTrimmer:
    """Checks a host's connections and trims them to ``bounds.low`` when over
    ``bounds.trim_at``.

    ``protected()`` names the peers never trimmed; ``mesh()`` the peers in our gossip mesh
    (kept before the others); both are read at each check."""

    def __init__(
        self,
        host: Any,
        bounds: ConnectionBounds,
        protected: Callable[[], Collection[str]],
        mesh: Callable[[], Collection[str]] = frozenset,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.bounds = bounds
        self.protected = protected
        self.mesh = mesh
        self.clock = clock
        self.stats = TrimStats()
        self._first_seen: dict[str, float] = {}
        self._last_stream: dict[str, float] = {}
        """Peer -> when a transfer stream to or from it last closed (``_StreamNotifee``)."""
        self._opened = trio.Event()
        self._closing: set[str] = set()
        """Peers whose connections we are closing (a close takes 0.1 s or more)."""
        self._reserved = 0
        """Dials under way that were given room (``room``)."""
        self.expendable: Callable[[], Collection[str]] = frozenset
        """Peers a task of ours polls but has no use for yet (a fetch: the peers that hold
        none of its version, ``FetchProgress.empty``). Its polls keep them in use, so a node
        at its cap that was fetching had nothing it could let go: a newcomer at 12 connections,
        10 of them peers it polled (most holding nothing), failed its dials to 3 of the 5
        holders its provider records named, at its own cap (docs/RELIABILITY.md). A
        connection wanted now (``candidates(wanted=True)``) may push one of them out first."""
        network = host.get_network()
        if hasattr(network, "register_notifee"):
            network.register_notifee(_StreamNotifee(self))
        set_room_keeper(host, self)  # new connections at the cap (swarm.net.host._CapDials)

    def count(self) -> int:
        """Our connections as the host's cap counts them: every connection, so two to one peer
        count twice. py-libp2p allows three a peer (``max_connections_per_peer``), and two
        nodes that dial each other at once hold two; counted by peer, a node the host
        counted full (12 connections, 10 peers) trimmed nothing and made no room, while
        py-libp2p refused every dial and every newcomer."""
        return len(self.host.get_network().get_connections())

    def _held(self, peer: str) -> int:
        return len(self.host.get_network().get_connections(ID.from_base58(peer)))

    def busy(self, peer: str) -> bool:
        """A stream other than the long-lived idle ones is open to ``peer``."""
        for conn in self.host.get_network().get_connections(ID.from_base58(peer)):
            for stream in conn.get_streams():
                protocol = str(stream.get_protocol() or "")
                if not protocol.startswith(IDLE_PROTOCOLS):
                    return True
        return False

    def in_use(self, peer: str) -> bool:
        last = self._last_stream.get(peer)
        return self.busy(peer) or (last is not None and self.clock() - last < self.bounds.in_use_s)

    def note_stream(self, peer: str, protocol: str) -> None:
        """A stream to ``peer`` closed. One that never agreed on a protocol carried no
        transfer: a negotiation refused or cut (a GossipSub stream to a peer that does not
        speak it, a stream reset while a node stops). Counted as use, they were 121 of the
        138 counted in 70 s among 14 loopback nodes, and left 5 to 9 of a node's 10 peers
        in use with no transfer running, so a node at its cap had nothing it could let go
        (tests/integration/test_connection_bounds.py)."""
        if protocol and not protocol.startswith(IDLE_PROTOCOLS):
            self._last_stream[peer] = self.clock()

    def _ages(self, peers: list[str]) -> dict[str, float]:
        now = self.clock()
        seen = {p: self._first_seen.get(p, now) for p in peers}
        self._first_seen = seen  # peers gone are forgotten: a new connection starts anew
        self._last_stream = {p: t for p, t in self._last_stream.items() if p in seen}
        return {p: now - t for p, t in seen.items()}

    def candidates(self, *, wanted: bool = False, spare: bool | None = None) -> list[str]:
        """Peers that may be trimmed now, least useful first. ``wanted``: for a connection
        wanted now (arriving at the cap, a request of ours), a connection of ours past
        ``dial_grace_s`` may go too. ``spare`` (default: ``wanted``): so may the peers our
        fetch has no use for (``expendable``), past ``dial_grace_s``; ``make_room`` lets any
        new connection of ours take their place (a DHT query's too: a newcomer at its cap,
        its connections peers that had answered "not held", found no holder in its
        version's provider records for 60 s, every query's dial refused at its own cap), the
        periodic trim does not (a fetch still polls them)."""
        peers = [str(p) for p in self.host.get_connected_peers()]
        ages = self._ages(peers)
        keep = set(self.protected())
        mesh = set(self.mesh())

        spare_peers = set(self.expendable()) if (wanted if spare is None else spare) else set()

        def old_enough(peer: str) -> bool:
            if ages[peer] >= self.bounds.grace_s:
                return True
            return wanted and ages[peer] >= self.bounds.dial_grace_s

        def young_theirs(peer: str) -> bool:
            return ages[peer] < self.bounds.grace_s and not self._ours(peer)

        def may_go(peer: str) -> bool:
            if peer in keep:
                return False
            if peer in spare_peers:  # polled for nothing yet: in use for no transfer
                return ages[peer] >= self.bounds.dial_grace_s
            return old_enough(peer) and not self.in_use(peer)

        free = [p for p in peers if p not in self._closing and may_go(p)]
        return sorted(
            free, key=lambda p: (p not in spare_peers, p in mesh, young_theirs(p), -ages[p])
        )

    def _ours(self, peer: str) -> bool:
        """Every connection to ``peer`` is one we opened (py-libp2p's ``direction``)."""
        conns = self.host.get_network().get_connections(ID.from_base58(peer))
        return bool(conns) and all(
            str(getattr(c, "direction", "unknown")) == "outbound" for c in conns
        )

    async def check(self) -> list[str]:
        """Trim to ``low`` when over ``bounds.trim_at``; returns the peers trimmed. Trimming
        starts below ``high``, the host's hard cap (``swarm.net.host.build_host``: past it
        every dial and every newcomer is refused), so that there is room for the connections
        others open to us (a dial-back that says we are reachable, a DHT query, a newcomer
        fetching what we hold) between two checks."""
        count = self.count()
        self.stats.peak = max(self.stats.peak, count)
        if count <= self.bounds.trim_at:
            self._ages([str(p) for p in self.host.get_connected_peers()])
            return []
        trimmed, left = [], count
        for peer in self.candidates():
            if left <= self.bounds.low:
                break
            trimmed.append(peer)
            left -= max(1, self._held(peer))
        await self._close(trimmed)
        if trimmed:
            log.info(
                "%d connections, over the trim mark %d: trimmed %d (%s)",
                count,
                self.bounds.trim_at,
                len(trimmed),
                ", ".join(p[-8:] for p in trimmed),
            )
        return trimmed

    def _held_soon(self) -> int:
        """Connections as the cap will count them once what is under way is done: those held,
        less those we are closing, plus the dials given room (``room``)."""
        closing = sum(self._held(p) for p in self._closing)
        return self.count() - closing + self._reserved

    def _victim(self, wanted: bool) -> tuple[bool, str | None]:
        """(is there room for one more connection, the connection to close for it)."""
        if self._held_soon() < self.bounds.high:
            return True, None
        candidates = self.candidates(wanted=wanted, spare=True)
        return (True, candidates[0]) if candidates else (False, None)

    async def make_room(self, *, wanted: bool = False) -> bool:
        """Before a new connection (a DHT query's dial, a peer we protect, one arriving): at
        the cap, trim the least useful connection (our own host would refuse the new one
        otherwise). ``wanted`` (one arriving) may push out a young idle one
        (``ConnectionBounds.dial_grace_s``); a request's dial uses ``room``. False: none may
        go."""
        made, victim = self._victim(wanted)
        if victim is not None:
            await self._close_one(victim)
        return made

    @contextlib.asynccontextmanager
    async def room(self, *, wanted: bool = False) -> AsyncIterator[bool]:
        """``make_room`` for a dial of ours, with the room held until the block ends (the dial
        is done): the next new connection counts it. Without the hold, two requests of a
        fetch at the cap picked the same connection to close and one was refused at our own
        cap: in a 30-node run, the newcomer's dials to 1 to 3 of the 5 holders
        (tests/integration/test_connection_bounds.py, docs/RELIABILITY.md)."""
        made, victim = self._victim(wanted)
        held = 1 if made else 0
        self._reserved += held  # before the close's await: a dial meanwhile counts it
        try:
            if victim is not None:
                await self._close_one(victim)
            yield made
        finally:
            self._reserved -= held

    async def _close_one(self, peer: str) -> None:
        self._closing.add(peer)
        try:
            await self._close([peer])
        finally:
            self._closing.discard(peer)

    async def _close(self, peers: list[str]) -> None:
        await close_peers(self.host, [ID.from_base58(p) for p in peers])
        if peers:
            self.stats.trims += len(peers)
            self.stats.last_trim_at = time.time()
            self.stats.recent = (self.stats.recent + peers)[-16:]

    async def run(self, every_s: float = 2.0) -> None:
        """Check every ``every_s``, and at once when a connection opens past the trim mark
        (``_StreamNotifee.connected``): the room under the cap is kept for the next one."""
        while True:
            await self.check()
            with trio.move_on_after(every_s):
                await self._opened.wait()
            self._opened = trio.Event()

    def note_connected(self) -> None:
        if self.count() > self.bounds.trim_at:
            self._opened.set()

    def status(self) -> dict[str, Any]:
        return {
            "connections": self.count(),
            "low": self.bounds.low,
            "high": self.bounds.high,
            "trim_at": self.bounds.trim_at,
            "over_high": self.count() > self.bounds.high,
            "peak": self.stats.peak,
            "trims": self.stats.trims,
            "last_trim_at": self.stats.last_trim_at,
            "recently_trimmed": [p[-8:] for p in self.stats.recent],
        }


class _StreamNotifee(INotifee):
    """py-libp2p's network events: streams as they close (``note_stream``: the protocol is
    known by then; an open stream is seen by ``busy``) and connections past the trim mark
    (``note_connected``)."""

    def __init__(self, trimmer: ConnectionTrimmer) -> None:
        self.trimmer = trimmer

    async def opened_stream(self, network: Any, stream: Any) -> None:
        pass  # told before the protocol is negotiated; ``busy`` sees the open streams

    async def closed_stream(self, network: Any, stream: Any) -> None:
        try:
            peer = stream.muxed_conn.peer_id.to_base58()
        except AttributeError:  # pragma: no cover - another stream type
            return
        self.trimmer.note_stream(peer, str(stream.get_protocol() or ""))

    async def connected(self, network: Any, conn: Any) -> None:
        self.trimmer.note_connected()

    async def disconnected(self, network: Any, conn: Any) -> None:
        pass

    async def listen(self, network: Any, multiaddr: Any) -> None:
        pass

    async def listen_close(self, network: Any, multiaddr: Any) -> None:
        pass


@dataclass
class RedialBackoff:
    """When a peer we dialed and lost may be dialed again: ``first_s`` after the first loss,
    doubling with each loss up to ``max_s``; a loss more than ``forget_s`` after the last one
    starts again at ``first_s`` (a peer that stayed connected a long while, then restarted).

    Without it, a busy peer over its trim mark that drops us would be redialed every round,
    and trim us again: churn for both, and for every other node that wants it."""

    first_s: float
    max_s: float
    forget_s: float = 3600.0
    _lost: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """Peer -> (lost at, the backoff then, no dial before)."""

    def lost(self, peer: str, now: float) -> float:
        """Note that ``peer`` was lost at ``now``; returns the wait before it may be dialed."""
        last = self._lost.get(peer)
        if last is None or now - last[0] > self.forget_s:
            backoff = self.first_s
        else:
            backoff = min(self.max_s, 2 * last[1])
        self._lost[peer] = (now, backoff, now + backoff)
        return backoff

    def may_dial(self, peer: str, now: float) -> bool:
        last = self._lost.get(peer)
        return last is None or now >= last[2]

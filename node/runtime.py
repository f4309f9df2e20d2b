"""The running node: overlay (host, DHT, gossip), membership, policy tracking, ledger gossip,
request/response protocols, the admin endpoint and metrics, in one trio event loop.

Roles build on this API::

    async with Node.start(config) as node:
        node.policy.newest                      # Signed[PolicyAnnouncement] | None
        node.peers_by_role()                    # {"trainer": [...], "inference": [...], ...}
        await node.announce_policy(v, manifest_id)
        node.subscribe_ledger(handler)
        node.handle("shard", handler, limits);  await node.request(peer, "shard", body)

Leaving the block (normally, on error, on Ctrl-C) stops every task, closes every connection,
removes the admin socket and releases the home's lock.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from node import admin
from node.home import NodeHome
from swarm import process
from swarm.errors import ConfigError, NotAuthorizedError, SwarmError
from swarm.identity import NodeKey
from swarm.messages import PolicyAnnouncement, Role, RunGenesis, Signed, decode_any, run_id_of, sign
from swarm.net import (
    ENOUGH_PEERS,
    KEEP_CONNECTED_S,
    DialPolicy,
    DirectPath,
    GossipStats,
    LedgerGate,
    Membership,
    MembershipConfig,
    Overlay,
    OverlayConfig,
    PolicyGate,
    PolicyTracker,
    StreamLimits,
    StreamServer,
    authorize,
    ledger_topic,
    parse_multiaddr,
    parse_peer_addr,
    peer_ids,
    policy_topic,
    request,
    serve,
    stream_protocol,
    wanted_dials,
)
from swarm.net.connections import (
    ConnectionBounds,
    ConnectionTrimmer,
    RedialBackoff,
    bounds_for,
)
from swarm.net.paths import relayed_connection
from swarm.net.records import wall_clock_ms
from swarm.net.relay import RELAY_LIMITS

log = logging.getLogger(__name__)

SOFTWARE = "swarm-node/0.1.0"
MAX_GOSSIP_PEERS = 32
LOST_BACKOFF = (60.0, 900.0)
"""A run peer we dialed and lost: first wait and most (``RedialBackoff``), doubling."""
LOST_PROTECTED_BACKOFF = (5.0, 120.0)
"""The same for a trainer or validator we lost: short, as it may have restarted (a failover
waits on it), yet doubling, as a trainer over its trim mark drops the nodes it does not need."""
DEFAULT_LIMITS = StreamLimits()
LedgerHandler = Callable[[Signed[Any]], Awaitable[None] | None]


@dataclass
class RuntimeConfig:
    """Everything a node needs to join a run. ``home`` (when given) holds the lock and the
    admin socket."""

    key: NodeKey
    genesis: Signed[RunGenesis]
    role: Role
    listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)
    bootstrap: Sequence[str] = ()
    home: NodeHome | None = None
    metrics_port: int | None = None
    heartbeat: float = 1.0
    advert_ttl_s: float = 600.0
    discover_every_s: float = 3.0
    dial: DialPolicy = field(default_factory=DialPolicy)
    capabilities: dict[str, Any] = field(default_factory=dict)
    connect_found_peers: bool = True
    """Dial the run's peers found in the DHT (tests of fixed topologies turn this off)."""
    announce: Sequence[str] = ()
    """Addresses advertised before our listen addresses (``config.toml [node] announce``)."""
    relays_wanted: int = 2
    """Relay reservations a node that is not publicly reachable holds (bootstrap peers)."""
    recheck_reachability_s: float = 600.0
    connections: ConnectionBounds | None = None
    """Low and high water marks of our connections (``config.toml [node] conn_low/conn_high``,
    ``--conn-low/--conn-high``; None: the role's, ``bounds_for``): past the trim mark below
    ``high``, the least useful are trimmed to ``low``."""

    @property
    def bounds(self) -> ConnectionBounds:
        return self.connections or bounds_for(self.role)

    def check(self) -> None:
        """Refuse bad input before any network use (``ConfigError`` / ``NotAuthorizedError``)."""
        for addr in self.listen:
            parse_multiaddr(addr)
        for addr in self.bootstrap:
            parse_peer_addr(addr)
        for addr in self.announce:
            parse_multiaddr(addr)
        g = self.genesis.message
        authorize(self.role, self.key.peer_id, g.trainers, g.validators)


class Node:
    """A node in a run (use ``Node.start``)."""

    def __init__(self, config: RuntimeConfig, overlay: Overlay) -> None:
        self.config = config
        self.overlay = overlay
        self.warnings: list[str] = []
        """What a role found wrong with this node's set-up (shown in status, logged once)."""
        self.key = config.key
        self.run_id = run_id_of(config.genesis)
        self.role: Role = config.role
        g = config.genesis.message
        self.stats = GossipStats()
        self.policy = PolicyTracker(self.run_id)
        self.policy_gate = PolicyGate(self.run_id, g.trainers, self.policy, self.stats)
        self.ledger_gate = LedgerGate(
            self.run_id,
            (*g.validators, config.genesis.signer),
            self.stats,
            validators=g.validators,
            eval_every=g.params.eval_every,
            trainers=g.trainers,
        )
        self.membership = Membership(
            overlay,
            config.key,
            self.run_id,
            config.role,
            trainers=g.trainers,
            validators=g.validators,
            config=MembershipConfig(
                software=SOFTWARE,
                advert_ttl_s=config.advert_ttl_s,
                discover_every_s=config.discover_every_s,
                # Past its low water mark a node dials no more peers: knowing more of a role
                # than that is no reason to look for them fast.
                enough_peers=min(ENOUGH_PEERS, config.bounds.low),
                capabilities=config.capabilities,
            ),
            issued_before=() if config.home is None else config.home.adverts_issued(self.run_id),
            on_issue=None if config.home is None else self._note_issued,
        )
        self.started_at = time.monotonic()
        self.bootstrap_connected: list[str] = []
        self.servers: dict[str, StreamServer] = {}
        self._ledger_handlers: list[LedgerHandler] = []
        self.status_extras: dict[str, Callable[[], Any]] = {}
        self.metrics_port: int | None = None
        """The port ``--metrics-port`` serves on (the one picked when asked for 0)."""
        self.status_snapshot: dict[str, Any] | None = None
        """The last ``status()`` taken by the event loop, for other threads (metrics)."""
        """Sections that roles add to ``status()`` (name -> a function returning plain data)."""
        self._nursery: trio.Nursery | None = None
        self._relayed_spent: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        """Bulk bytes pulled per relayed connection, see ``relayed_bytes_left``."""
        self._dialed: set[str] = set()
        """Run peers ``_connect_found_peers`` connected to (and still is, last it looked)."""
        self._backoff = RedialBackoff(*LOST_BACKOFF)
        self._protected_backoff = RedialBackoff(*LOST_PROTECTED_BACKOFF)
        self.connections = ConnectionTrimmer(
            overlay.host, config.bounds, self._protected_peers, self._mesh_peers
        )
        """Keeps our connections under the high water mark (``swarm.net.connections``)."""

    # -- life cycle ---------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def start(cls, config: RuntimeConfig) -> AsyncIterator[Node]:
        """Check the config, take the home's lock, start the overlay, dial the bootstrap
        peers, publish our advert, subscribe to the run's topics; undo it all on exit.

        Raises ``ConfigError``/``NotAuthorizedError`` before any network use,
        ``StorageError`` when another node holds the home, ``BootstrapError`` when no
        bootstrap peer answers (with ``config.dial.attempts == inf`` it keeps trying).
        """
        config.check()
        async with AsyncExitStack() as stack:
            if config.home is not None:
                stack.enter_context(config.home.lock())
            overlay = await stack.enter_async_context(
                Overlay.start(
                    config.key,
                    OverlayConfig(
                        listen=config.listen,
                        heartbeat=config.heartbeat,
                        announce=config.announce,
                        connection_cap=config.bounds.high,
                    ),
                )
            )
            node = cls(config, overlay)
            for addr in overlay.addrs():
                log.info("listening on %s", addr)
            nursery = await stack.enter_async_context(trio.open_nursery())
            node._nursery = nursery
            stack.callback(nursery.cancel_scope.cancel)
            if config.home is not None:
                await nursery.start(
                    admin.serve_admin, admin.socket_path(config.home.path), node.admin_commands()
                )
            if config.metrics_port is not None:
                from node.net_metrics import keep_status_snapshot, serve_metrics

                await nursery.start(keep_status_snapshot, node)
                stack.enter_context(serve_metrics(node, config.metrics_port))
            await node._join(nursery)
            yield node
            overlay.stopping = True  # the run ended normally: what follows is its teardown

    async def _join(self, nursery: trio.Nursery) -> None:
        self.overlay.set_gate(policy_topic(self.run_id), self._policy_gate)
        self.overlay.set_gate(ledger_topic(self.run_id), self._ledger_gate)
        self.overlay.flood_publish(policy_topic(self.run_id))  # a trainer's announcements
        policy_sub = await self.overlay.subscribe(policy_topic(self.run_id))
        ledger_sub = await self.overlay.subscribe(ledger_topic(self.run_id))
        nursery.start_soon(self._drain, policy_sub, None)
        nursery.start_soon(self._drain, ledger_sub, self._deliver_ledger)
        if self.config.bootstrap:
            report = await self.overlay.dial(self.config.bootstrap, self.config.dial)
            self.bootstrap_connected = report.connected
            for addr, why in report.failures.items():
                log.warning("bootstrap peer %s not reached: %s", addr, why)
            nursery.start_soon(self._check_reachability)
            if self.overlay.relay is not None:
                nursery.start_soon(
                    self.overlay.relay.maintain,
                    lambda: self.config.bootstrap,
                    self._relays_wanted,
                    self._addrs_changed,
                )
        if self.config.home is not None:  # a twin started before us: our lookups still work
            await self.membership.check_duplicate()
        await self.membership.publish()
        nursery.start_soon(self.membership.run)
        nursery.start_soon(self._keep_connected)
        nursery.start_soon(self.connections.run)

    def _protected_peers(self) -> set[str]:
        """Never trimmed: the run's trainers (their announcements flood to the peers they are
        connected to) and validators (submissions, verdicts), our bootstrap peers, and the
        relays we hold reservations on (our relayed addresses)."""
        g = self.config.genesis.message
        relays = set(self.overlay.relay.reservations) if self.overlay.relay else set()
        return {*g.trainers, *g.validators, *self._bootstrap_peer_ids(), *relays}

    def _mesh_peers(self) -> set[str]:
        return {
            p
            for topic in (policy_topic(self.run_id), ledger_topic(self.run_id))
            for p in self.overlay.mesh_peers(topic)
        }

    def _note_issued(self, issued_at: int) -> None:
        assert self.config.home is not None
        try:
            self.config.home.note_advert_issued(self.run_id, issued_at)
        except OSError as exc:  # a full disk costs only the twin check after a restart
            log.warning("could not remember our advert's issue time in the home: %s", exc)

    def _policy_gate(self, data: bytes) -> bool:
        return self.policy_gate.accept(data) is not None

    def _ledger_gate(self, data: bytes) -> bool:
        return self.ledger_gate.accept(data) is not None

    async def _drain(self, sub: Any, deliver: Callable[[bytes], Awaitable[None]] | None) -> None:
        while True:
            msg = await sub.get()
            if deliver is not None:
                await deliver(bytes(msg.data))

    async def _deliver_ledger(self, data: bytes) -> None:
        signed = decode_any(data)  # accepted by the gate a moment ago
        for handler in list(self._ledger_handlers):
            try:
                result = handler(signed)
                if result is not None:
                    await result
            except Exception:
                log.exception("ledger handler failed")

    def _bootstrap_peer_ids(self) -> list[str]:
        return peer_ids(self.config.bootstrap)

    async def _check_reachability(self) -> None:
        """Ask the bootstrap peers to dial us back now and then (sooner while unknown)."""
        while True:
            servers = [p for p in self._bootstrap_peer_ids() if self.overlay.connected(p)]
            before = self.overlay.addrs()
            with trio.move_on_after(60):
                reach = await self.overlay.check_reachability(servers)
                log.info("reachability: %s (%s)", reach.status, reach.reason)
            if self.overlay.addrs() != before and self.membership.mine is not None:
                try:  # an announce address dropped or restored: say so in our advert
                    await self._addrs_changed()
                except SwarmError as exc:
                    log.warning("republishing our addresses failed: %s", exc)
            unknown = self.overlay.reach.status == "unknown"
            await trio.sleep(30.0 if unknown else self.config.recheck_reachability_s)

    def _relays_wanted(self) -> int:
        """Reservations to hold: ``relays_wanted`` once the dial-back said "private", else
        none (a public node needs none; "unknown" means no bootstrap peer answered, and those
        are our relays too)."""
        return self.config.relays_wanted if self.overlay.reach.status == "private" else 0

    async def _addrs_changed(self) -> None:
        """Our relayed addresses changed: republish our advert so peers dial the new ones."""
        log.info("our addresses are now %s", ", ".join(self.overlay.addrs()))
        if not self.membership.withdrawn:  # a node that gave up its role stays withdrawn
            await self.membership.publish()

    async def _keep_connected(self) -> None:
        """Keep this node in the swarm; py-libp2p's auto-connector, which dialed every known
        peer, is off (``swarm.net.host.build_host``). On every new peer found, and at least
        every ``KEEP_CONNECTED_S``: redial the bootstrap peers while connected to none of them
        (a partition healed, a bootstrap peer restarted), then (``connect_found_peers``)
        connect to the run's peers found in the DHT, so the gossip mesh does not depend on
        the bootstrap peers alone (bounded: below the dial mark of ``connections``, and
        ``MAX_GOSSIP_PEERS``; ``self.connections`` trims what others' dials add past its trim
        mark). Trainers come first: a trainer floods its announcements to every
        subscriber it is connected to (``SwarmGossipSub``), so a node connected to it hears a
        new version in one hop (bench/scale.py); past the trainer's own bounds, the mesh
        carries them."""
        while True:
            with trio.move_on_after(KEEP_CONNECTED_S):
                await self.membership.found.wait()
            self.membership.found = trio.Event()
            boots = self.config.bootstrap
            if boots and not any(self.overlay.connected(p) for p in self._bootstrap_peer_ids()):
                self.bootstrap_connected = await self.overlay.redial(boots)
            if self.config.connect_found_peers:
                await self._connect_found_peers()

    async def _connect_found_peers(self) -> None:
        """Dial found run peers, trainers first, while we hold fewer than the dial mark below
        the low water mark (``ConnectionBounds.dial_below``; and ``MAX_GOSSIP_PEERS``). A peer
        we had dialed and lost (its side trimmed us, or it left) waits before we dial it again
        (``LOST_BACKOFF``, ``LOST_PROTECTED_BACKOFF``: ``RedialBackoff``)."""
        connected = set(self.overlay.connected_peers())
        now = trio.current_time()
        protected = self._protected_peers()

        def backoff(peer: str) -> RedialBackoff:
            return self._protected_backoff if peer in protected else self._backoff

        for peer in self._dialed - connected:
            backoff(peer).lost(peer, now)
        self._dialed &= connected
        bounds = self.config.bounds
        by_role = self.membership.peers_by_role()
        for role in sorted(by_role, key=lambda r: r != "trainer"):
            # Trainers first, yet only while we are under the dial mark like any peer:
            # when every node dialed a trainer up to its own high mark, the trainer sat at its
            # cap, trimming and refused, and a holder could not copy a version from it in 60 s
            # (30 loopback nodes, marks 8/12); past a node's first connections the mesh
            # carries the trainer's announcements.
            bound = min(MAX_GOSSIP_PEERS, bounds.dial_below)
            for peer in by_role[role]:
                if len(connected) >= bound:
                    break
                if peer in connected or not backoff(peer).may_dial(peer, now):
                    continue
                # Direct addresses only: a private peer dials out to us anyway, and a
                # circuit per pair of peers would use up the relays' circuit limits.
                if await self.connect_peer(peer, circuits=False) is None:
                    connected.add(peer)
                    self._dialed.add(peer)

    async def connect_peer(self, peer_id: str, *, circuits: bool = True) -> str | None:
        """Connect to a run peer at its advertised addresses, circuits included, unless
        connected; ``None`` on success, else why not (``Overlay.connect``). When every
        address fails, the advert is looked up again once: the peer may have moved to
        another relay since."""
        advert = self.membership.advert_of(peer_id)
        if advert is None:
            return None if self.overlay.connected(peer_id) else "no advert known"
        if not self.overlay.connected(peer_id) and peer_id in self._protected_peers():
            await self.connections.make_room()  # a trainer or validator: never refused by us
        why = await self.overlay.connect(peer_id, advert.message.addrs, circuits=circuits)
        if why is None or not circuits:
            return why
        newer = await self.membership.refresh_advert(peer_id)
        if newer is None or newer.message.addrs == advert.message.addrs:
            return why
        return await self.overlay.connect(peer_id, newer.message.addrs, circuits=circuits)

    # -- what roles use -----------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.key.peer_id

    def peers_by_role(self) -> dict[str, list[str]]:
        return self.membership.peers_by_role()

    async def announce_policy(
        self, version: int, manifest_id: bytes, manifest: bytes = b""
    ) -> Signed[PolicyAnnouncement]:
        """Sign and gossip a PolicyAnnouncement (genesis trainers only); ``manifest``: the
        signed manifest's bytes to carry with it (``inline_manifest``), or empty.

        ``NotAuthorizedError`` for a key that is not a genesis trainer; ``ValidationError``
        (``Refused``) for a version not newer than the newest known.
        """
        if self.peer_id not in self.config.genesis.message.trainers:
            raise NotAuthorizedError(f"{self.peer_id} is not a genesis trainer of this run")
        signed = sign(
            PolicyAnnouncement(self.run_id, version, manifest_id, wall_clock_ms(), manifest),
            self.key,
        )
        await self.publish_policy(signed)
        return signed

    async def publish_policy(self, signed: Signed[PolicyAnnouncement]) -> None:
        self.policy_gate.check(signed.raw)  # a clear error here rather than a silent drop
        await self.overlay.publish(policy_topic(self.run_id), signed.raw)

    def subscribe_ledger(self, handler: LedgerHandler) -> None:
        """Call ``handler(signed)`` for every accepted Verdict, LedgerEvent or Evaluation."""
        self._ledger_handlers.append(handler)

    async def publish_ledger(self, signed: Signed[Any]) -> None:
        self.ledger_gate.check(signed.raw)
        await self.overlay.publish(ledger_topic(self.run_id), signed.raw)

    def handle(
        self,
        name: str,
        handler: Callable[[str, bytes], Awaitable[bytes]],
        limits: StreamLimits = DEFAULT_LIMITS,
    ) -> StreamServer:
        """Serve ``/swarm-node/<run>/<name>/1`` with ``handler(peer_id, request) -> answer``."""
        protocol = stream_protocol(self.run_id, name)
        self.servers[name] = serve(self.overlay.host, protocol, handler, limits)
        return self.servers[name]

    async def request(
        self, peer_id: str, name: str, payload: bytes, limits: StreamLimits = DEFAULT_LIMITS
    ) -> bytes:
        """One request on ``/swarm-node/<run>/<name>/1`` (size limits and a deadline). A peer
        we hold no connection to is dialed at its advertised addresses first: the swarm
        cannot dial its relayed (``/p2p-circuit``) ones by itself. At our connection cap the
        least useful connection makes room first (``wanted_dials``): a request we start is a
        transfer we want (a holder of a version, a validator), the idle connection is not."""
        with wanted_dials():
            if not self.overlay.connected(peer_id) and self.membership.advert_of(peer_id):
                why = await self.connect_peer(peer_id)
                if why is not None:
                    log.debug("connecting to %s failed: %s", peer_id[-8:], why)
            return await request(
                self.overlay.host, peer_id, stream_protocol(self.run_id, name), payload, limits
            )

    def direct_path(self, peer_id: str) -> DirectPath | None:
        """Both IP addresses of our direct connection to ``peer_id`` (None: none, or relayed)."""
        return self.overlay.direct_path(peer_id)

    def relayed_bytes_left(self, peer_id: str) -> int | None:
        """Bulk bytes we may still pull from ``peer_id`` over its relayed connection (``None``:
        we have a direct one, or none). The cap is 3/4 of the relay's per-circuit limit, so
        control traffic never pushes a circuit over it (``RELAY_LIMITS`` when the peer's relay
        is not one of ours and its limit unknown)."""
        conn = relayed_connection(self.overlay.host, peer_id)
        if conn is None:
            return None
        limit = (self.overlay.relay.relayed_budget() if self.overlay.relay else 0) or (
            RELAY_LIMITS.data
        )
        return max(0, limit * 3 // 4 - self._relayed_spent.get(conn, 0))

    def spend_relayed(self, peer_id: str, nbytes: int) -> None:
        conn = relayed_connection(self.overlay.host, peer_id)
        if conn is not None:
            self._relayed_spent[conn] = self._relayed_spent.get(conn, 0) + nbytes

    async def forget_peer(self, peer_id: str) -> None:
        """Make the next request to ``peer_id`` dial afresh (``Overlay.forget_peer``)."""
        await self.overlay.forget_peer(peer_id)

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        newest = self.policy.newest
        return {
            "run_id": self.run_id,
            "run_name": self.config.genesis.message.name,
            "role": self.role,
            "peer_id": self.peer_id,
            "listen_addrs": self.overlay.addrs(),
            "peers_by_role": self.peers_by_role(),
            "connected_peers": len(self.overlay.connected_peers()),
            "connections": self.connections.status(),
            "bootstrap_connected": self.bootstrap_connected,
            "reachability": self.overlay.reachability(),
            "reachability_detail": self.overlay.reach.as_dict(),
            "dht_mode": self.overlay.dht_mode(),
            "relay": self.overlay.relay.status() if self.overlay.relay else None,
            "policy_version": None if newest is None else newest.message.version,
            "policy_manifest": None if newest is None else newest.message.manifest_id.hex(),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "gossip": self.stats.as_dict(),
            "policy_conflicts": [c.as_dict() for c in self.policy.conflicts],
            "rejected_adverts": self.membership.rejected_adverts,
            "warnings": [
                *self.membership.duplicate_warnings,
                *self.overlay.internals_missing,
                *self.warnings,
            ],
            "process": process.usage(),
            **{name: section() for name, section in self.status_extras.items()},
        }

    def admin_commands(self) -> dict[str, admin.Command]:
        async def status(_req: dict[str, Any]) -> dict[str, Any]:
            return {"status": self.status()}

        async def announce(req: dict[str, Any]) -> dict[str, Any]:
            try:
                version = int(req["version"])
                manifest = bytes.fromhex(str(req["manifest"]))
            except (KeyError, ValueError, TypeError) as exc:
                raise ConfigError(
                    f"announce needs an integer version and a hex manifest: {exc}"
                ) from exc
            signed = await self.announce_policy(version, manifest)
            return {"announced": {"version": version, "id": signed.id.hex()}}

        return {"status": status, "announce": announce}


def home_path(home: NodeHome | Path) -> Path:
    return home.path if isinstance(home, NodeHome) else home


def forever_policy(timeout: float = 5.0) -> DialPolicy:
    """``--wait``: keep dialing with capped backoff until some bootstrap peer answers."""
    return DialPolicy(attempts=math.inf, timeout=timeout)

"""The libp2p overlay of one node: host, Kademlia DHT, GossipSub, relays, with our validators.

``Overlay.start`` is an async context manager; leaving it (normally, by error or by
cancellation) stops every service and closes every connection. Nothing here knows about roles
or runs beyond the names and validators it is given: ``node.runtime`` builds on it.

py-libp2p choices made here, each for a reason:
- GossipSub v1.1 with a heartbeat of about 1 s and adaptive gossip off (it would stretch the
  heartbeat to 30-60 s when the mesh looks unhealthy), StrictSign on, and flood publishing on
  the topics given to ``flood_publish`` (``swarm.net.gossipsub``: our own messages go to
  every subscribed peer we are connected to, not only our mesh, as GossipSub v1.1 specifies);
- the DHT in server mode when reachable, with ``RoleAdvertValidator`` on the ``swarm-node``
  namespace and strict validation (records in namespaces nobody validates are refused); the
  records themselves are read and written through ``records`` (``swarm.net.dht_records``);
- reachability by dial-back (``swarm.net.reach``, not py-libp2p's AutoNAT, which answered
  "public" for closed ports and NATed hosts): the DHT moves to client mode when nobody could
  dial us back, and back to server mode when somebody could;
- circuit relay v2 (``swarm.net.relay``): every node accepts circuits and runs DCUtR; bootstrap
  peers relay (``relay_hop``) and answer dial-backs (``dialback_server``); our relayed
  addresses join ``addrs()`` (and so our RoleAdvert) while we hold reservations;
- ``connect``: a peer's direct addresses first (short timeout each), then its circuits, which
  the swarm cannot dial by itself.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.host.ping import PingService
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11
from libp2p.pubsub.pubsub import Pubsub
from libp2p.records.pubkey import PublicKeyValidator
from libp2p.records.validator import NamespacedValidator
from libp2p.tools.anyio_service.context import background_trio_service

from swarm import internals
from swarm.errors import NetworkError, SwarmError
from swarm.identity import NodeKey
from swarm.net.dht_records import DhtRecords
from swarm.net.dial import DialPolicy, DialReport, dial_bootstrap, dial_once
from swarm.net.gossipsub import SwarmGossipSub
from swarm.net.host import (
    HostLimits,
    build_host,
    check_peer_id,
    close_peers,
    full_addrs,
    listen_addrs,
    parse_multiaddr,
    peer_ids,
    peer_of,
    unblock,
)
from swarm.net.names import NAMESPACE
from swarm.net.paths import DirectPath, direct_path
from swarm.net.reach import DialbackServer, Reachability, check_reachability, tcp_ports
from swarm.net.records import Clock, RoleAdvertValidator, wall_clock_ms
from swarm.net.relay import RelayClient, RelayHop, is_circuit

log = logging.getLogger(__name__)

DEFAULT_DIAL = DialPolicy()
EQUIVOCATION_KEEP = 4096
"""Forwarded messages GossipSub remembers for its equivocation check (see trim_gossip_state)."""
KEEP_CONNECTED_S = 10.0
"""How often nodes and bootstrap peers check the connections they keep (``Overlay.redial``)."""

Gate = Callable[[bytes], bool]
"""A topic gate: ``True`` accepts (deliver and forward) the message data, ``False`` drops it."""


@dataclass(frozen=True)
class OverlayConfig:
    listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)
    heartbeat: float = 1.0
    dht_server: bool = True
    limits: HostLimits | None = None
    connection_cap: int | None = None
    """No dial and no inbound connection past this many connections (``build_host``)."""
    clock: Clock = wall_clock_ms
    gossip_degree: tuple[int, int, int] = (6, 4, 12)
    relay_hop: bool = False
    """Relay circuits for others (bootstrap peers)."""
    dialback_server: bool = False
    """Answer dial-back requests (bootstrap peers)."""
    announce: Sequence[str] = ()
    """Addresses to advertise before our listen addresses (a forwarded port, a public IP)."""


def _bind_error(listen: str) -> str | None:
    """Why a plain TCP bind to a listen address fails (``None`` when it would work)."""
    addr = parse_multiaddr(listen)
    try:
        port = int(addr.value_for_protocol("tcp"))
        family, host = socket.AF_INET, addr.value_for_protocol("ip4")
    except Exception:
        try:
            family, host = socket.AF_INET6, addr.value_for_protocol("ip6")
        except Exception:
            return None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


async def _reset_stream(stream: Any) -> None:
    """A KAD stream opened to us in client mode: refused."""
    with contextlib.suppress(Exception):
        await stream.reset()


class Overlay:
    """A started libp2p host with DHT and gossip (use ``Overlay.start``)."""

    def __init__(self, key: NodeKey, config: OverlayConfig) -> None:
        self.key = key
        self.config = config
        self.host: Any = build_host(key, config.listen, config.limits, config.connection_cap)
        self.advert_validator = RoleAdvertValidator(config.clock)
        validator = NamespacedValidator(
            {"pk": PublicKeyValidator(), NAMESPACE: self.advert_validator},
            strict_validation=True,
        )
        self.dht: Any = KadDHT(
            self.host,
            DHTMode.SERVER if config.dht_server else DHTMode.CLIENT,
            validator=validator,
            strict_validation=True,
        )
        self.records = DhtRecords(self.host, self.dht, config.clock, self.connected)
        """Our RoleAdvert and provider records in the DHT, and other peers'."""
        d, lo, hi = config.gossip_degree
        self.gossipsub: Any = SwarmGossipSub(
            [PROTOCOL_ID_V11, PROTOCOL_ID],
            degree=d,
            degree_low=lo,
            degree_high=hi,
            heartbeat_interval=config.heartbeat,
            heartbeat_initial_delay=min(0.1, config.heartbeat),
            adaptive_gossip_enabled=False,
            eclipse_protection_enabled=False,
        )
        self.pubsub: Any = Pubsub(self.host, self.gossipsub, strict_signing=True)
        self.ping: Any = PingService(self.host)
        self.reach = Reachability()
        self.relay: RelayClient | None = None
        self.relay_hop: RelayHop | None = None
        self.dialback: DialbackServer | None = None
        self._subscriptions: dict[str, Any] = {}
        self.stopping = False
        self.internals_missing: list[str] = []
        """py-libp2p internals not found at start, each with the feature that is off."""
        """Set by the owner (``Node.start``, ``BootstrapPeer.start``) once its own run ended
        normally and its teardown began: a late spawn from then on is no failure."""

    @classmethod
    @asynccontextmanager
    async def start(
        cls, key: NodeKey, config: OverlayConfig | None = None
    ) -> AsyncIterator[Overlay]:
        """Listen, start DHT and gossip; stop them all on exit. ``NetworkError`` when the
        listen address cannot be bound."""
        overlay = cls(key, config or OverlayConfig())
        stopping = False
        try:
            async with overlay._run():
                yield overlay
                stopping = True
        except BaseExceptionGroup as group:
            # py-libp2p (0.8.x) sometimes spawns a task for a connection that arrived while its
            # services stop, into a nursery already closed: the run is over and nothing is lost,
            # so at shutdown that one error is logged, never raised over the caller's result
            # (CI flakes of the policy-loss and RL swarm tests; _quiesce narrows the window).
            # The owner's own teardown counts: its tasks and handlers stop before the overlay.
            late, rest = group.split(_late_spawn)
            if not (stopping or overlay.stopping) or late is None:
                raise
            if rest is not None:
                raise rest from None
            log.warning("py-libp2p spawned into a closed nursery while stopping (ignored)")

    @asynccontextmanager
    async def _run(self) -> AsyncIterator[None]:
        overlay = self
        async with AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(
                    overlay.host.run(listen_addrs(overlay.config.listen))
                )
            except OSError as exc:
                raise NetworkError(
                    f"cannot listen on {', '.join(overlay.config.listen)}: {exc.strerror or exc}"
                ) from exc
            if not overlay.host.get_addrs():
                # py-libp2p logs a failed bind and runs on, listening nowhere.
                reasons = "; ".join(
                    f"{a}: {why}" for a in overlay.config.listen if (why := _bind_error(a))
                )
                raise NetworkError(
                    f"cannot listen on {reasons or ', '.join(overlay.config.listen)}; pick another"
                    " --listen port (or /tcp/0 for any free one)"
                )
            overlay.relay = await stack.enter_async_context(RelayClient.start(overlay.host))
            if overlay.config.relay_hop:
                overlay.relay_hop = await stack.enter_async_context(RelayHop.start(overlay.host))
            if overlay.config.dialback_server:
                overlay.dialback = await stack.enter_async_context(
                    DialbackServer.start(overlay.host)
                )
            # Every private py-libp2p name we rely on, on the objects just built: a missing one
            # is a warning in status naming the feature that is off (swarm.internals).
            overlay.internals_missing = internals.check(
                live={
                    "dcutr": overlay.relay.dcutr,
                    "relay_hop": overlay.relay_hop.protocol if overlay.relay_hop else None,
                    "gossipsub": overlay.gossipsub,
                    "network": overlay.host.get_network(),
                }
            )
            await stack.enter_async_context(background_trio_service(overlay.pubsub))
            await stack.enter_async_context(background_trio_service(overlay.gossipsub))
            await stack.enter_async_context(background_trio_service(overlay.dht))
            # Runs first on exit: with pubsub's protocols unregistered and every connection
            # closed, no peer's message can reach pubsub while its service stops (py-libp2p
            # would spawn into a closed nursery). Closing alone was not enough: a peer that
            # reconnected in between opened a new pubsub stream (a CI flake).
            stack.push_async_callback(overlay._quiesce)
            await overlay.pubsub.wait_until_ready()
            housekeeping = await stack.enter_async_context(trio.open_nursery())
            housekeeping.start_soon(overlay._trim_gossip_state_forever)
            stack.callback(housekeeping.cancel_scope.cancel)
            yield

    async def _quiesce(self) -> None:
        for protocol in list(self.pubsub.protocols):
            with contextlib.suppress(Exception):
                self.host.remove_stream_handler(protocol)
        await close_peers(self.host, list(self.host.get_network().get_connections_map()))

    async def forget_peer(self, peer_id: str) -> None:
        """Close our connections to ``peer_id`` and drop it from py-libp2p's negative dial
        cache, so the next stream to it dials afresh. For a peer we could not open a stream to
        and retry on our own backoff: a peer restarted on the same address leaves a dead
        connection that py-libp2p keeps choosing, and one dial that failed while it was down
        blocks every dial to it for 60 s, long after it is back (both found by the netns
        test). A general redial on every failed stream cut honest connections under a flood."""
        with contextlib.suppress(Exception):
            network = self.host.get_network()
            peer = check_peer_id(peer_id)
            await network.close_peer(peer)
            unblock(self.host, peer)

    # -- housekeeping -------------------------------------------------------------------------

    def trim_gossip_state(self, keep: int = EQUIVOCATION_KEEP) -> int:
        """Forget all but the newest ``keep`` messages GossipSub keeps for equivocation checks;
        returns how many were forgotten.

        py-libp2p 0.8.1 stores every message it forwards (data included) in
        ``equivocation_detection`` and never removes one: a slow leak on a long-running node.
        Duplicates stay caught by its seen cache and by our gates' envelope ids.
        """
        table = getattr(self.gossipsub, "equivocation_detection", None)
        if not isinstance(table, dict) or len(table) <= keep:
            return 0
        drop = len(table) - keep
        for msg_key in list(itertools.islice(table, drop)):  # oldest first (insertion order)
            del table[msg_key]
        return drop

    async def _trim_gossip_state_forever(self, every: float = 30.0) -> None:
        while True:
            await trio.sleep(every)
            self.trim_gossip_state()

    # -- identity and peers -------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.key.peer_id

    def addrs(self) -> list[str]:
        """Dialable addresses, each with ``/p2p/<peer id>``: announced ones, our listen
        addresses, then our relayed (``/p2p-circuit``) ones."""
        announced = [
            a if "/p2p/" in a else f"{a}/p2p/{self.peer_id}" for a in self.usable_announce()
        ]
        relayed = self.relay.circuit_addrs() if self.relay is not None else []
        return list(dict.fromkeys([*announced, *full_addrs(self.host), *relayed]))

    def usable_announce(self) -> list[str]:
        """Our announce addresses less those a dial-back found closed."""
        failed = self.reach.failed_ports()
        return [a for a in self.config.announce if not set(tcp_ports([a])) & failed]

    def listen_addrs(self) -> list[str]:
        return full_addrs(self.host)

    def connected_peers(self) -> list[str]:
        return [str(p) for p in self.host.get_connected_peers()]

    def direct_path(self, peer_id: str) -> DirectPath | None:
        """Both IP addresses of our direct connection to ``peer_id``; ``None`` when we have
        none or only a relayed one (``swarm.net.paths``)."""
        return direct_path(self.host, peer_id)

    def reachability(self) -> str:
        """Our verdict: public, private or unknown (``reach.reason`` says why)."""
        return self.reach.status

    def dht_mode(self) -> str:
        """Whether we answer DHT queries ("server") or only ask ("client")."""
        return "server" if self.dht.mode == DHTMode.SERVER else "client"

    async def check_reachability(self, servers: Sequence[str]) -> Reachability:
        """Ask ``servers`` (connected peer IDs, normally our bootstrap peers) to dial us back
        on a fresh connection; the DHT follows the verdict: client mode when private, server
        mode when public (unknown changes nothing)."""
        self.reach = await check_reachability(
            self.host, servers, self.listen_addrs(), self.config.announce
        )
        for addr in self.config.announce:
            if addr not in self.usable_announce():
                log.warning(
                    "announce address %s is not reachable: the dial-back to its port failed"
                    " (%s); it is left out of our advert until a later check reaches it",
                    addr,
                    self.reach.reason,
                )
        if self.reach.status == "private" and self.dht.mode == DHTMode.SERVER:
            log.warning(
                "not reachable from outside (%s); the DHT moves to client mode",
                self.reach.reason,
            )
            await self.dht.switch_mode(DHTMode.CLIENT)
            # py-libp2p 0.8.1 removes the KAD handler while another peer's stream may be
            # negotiating it (multiselect checks the handler, awaits, then indexes it): a
            # KeyError that ended a whole 10-node process in bench/scale.py at N = 100. A
            # handler that resets the stream keeps the key; switching back replaces it.
            # switch_mode does not yield, so no stream sees the gap.
            self.host.set_stream_handler(KAD_PROTOCOL, _reset_stream)
        elif (
            self.reach.status == "public"
            and self.dht.mode != DHTMode.SERVER
            and self.config.dht_server
        ):
            await self.dht.switch_mode(DHTMode.SERVER)
        return self.reach

    async def dial(self, addrs: Sequence[str], policy: DialPolicy = DEFAULT_DIAL) -> DialReport:
        """Dial bootstrap peers (see ``dial_bootstrap``) and seed the DHT's routing table."""
        report = await dial_bootstrap(self.host, addrs, policy)
        for peer in peer_ids(report.connected):
            await self.dht.add_peer(ID.from_base58(peer), skip_server_mode_check=True)
        with trio.move_on_after(policy.timeout):
            await self.dht.refresh_routing_table()
        return report

    async def redial(self, addrs: Sequence[str], timeout: float = 5.0) -> list[str]:
        """Dial, once each, those of ``addrs`` (``.../p2p/<peer>``) whose peer we are not
        connected to; returns the addresses of the peers we are connected to now. With
        py-libp2p's auto-connector off (``build_host``) this is how a node gets its bootstrap
        peers back after a partition heals or one restarts."""
        ok: list[str] = []
        for addr in addrs:
            peer = peer_of(addr)
            if peer is None:  # bootstrap addresses are checked to name one (parse_peer_addr)
                continue
            if not self.connected(peer):
                try:
                    if await dial_once(self.host, addr, timeout) is not None:
                        continue
                    await self.dht.add_peer(ID.from_base58(peer), skip_server_mode_check=True)
                except Exception as exc:  # a bad address or a failed dial: the next round
                    log.debug("redial %s: %s", addr, exc)
                    continue
            ok.append(addr)
        return ok

    def unblock(self, peer_id: str) -> None:
        """Let the next dial to ``peer_id`` happen (``swarm.net.host.unblock``); a malformed
        ID has nothing to unblock (the dial that follows says what is wrong with it)."""
        try:
            peer = check_peer_id(peer_id)
        except SwarmError:
            return
        unblock(self.host, peer)

    def connected(self, peer_id: str) -> bool:
        try:
            return bool(self.host.get_network().connections.get(check_peer_id(peer_id)))
        except SwarmError:
            return False

    async def connect(
        self, peer_id: str, addrs: Sequence[str], timeout: float = 3.0, *, circuits: bool = True
    ) -> str | None:
        """Connect to ``peer_id`` at one of ``addrs`` unless connected: direct addresses
        first, then (with ``circuits``) circuits through their relays. ``None`` when
        connected, else why not (every address's reason)."""
        if self.connected(peer_id):
            return None
        whys: list[str] = []
        ordered = sorted(addrs, key=is_circuit)  # direct ones first
        for addr in ordered:
            if not addr.endswith(f"/p2p/{peer_id}"):
                continue
            try:
                if is_circuit(addr):
                    if self.relay is None or not circuits:
                        continue
                    await self.relay.dial_circuit(addr, timeout=3 * timeout)
                    return None
                why = await dial_once(self.host, addr, timeout)
            except SwarmError as exc:
                why = str(exc)
            if why is None:
                return None
            whys.append(f"{addr}: {why}")
        return "; ".join(whys) or "no address to dial"

    # -- gossip ---------------------------------------------------------------------------------

    def flood_publish(self, topic: str) -> None:
        """Send what we publish on ``topic`` to every subscriber we are connected to, not only
        to our mesh (``SwarmGossipSub``)."""
        self.gossipsub.flood_topics = self.gossipsub.flood_topics | {topic}

    def set_gate(self, topic: str, gate: Gate) -> None:
        """Validate every message of ``topic`` (ours included) with ``gate``."""

        def validator(_forwarder: Any, msg: Any) -> bool:
            try:
                return bool(gate(bytes(msg.data)))
            except Exception:  # a gate bug drops the message, never the node
                log.exception("topic gate for %s failed", topic)
                return False

        self.pubsub.set_topic_validator(topic, validator, False)

    async def subscribe(self, topic: str) -> Any:
        """Subscribe; the result's ``await sub.get()`` yields accepted messages (``.data``)."""
        if topic not in self._subscriptions:
            self._subscriptions[topic] = await self.pubsub.subscribe(topic)
        return self._subscriptions[topic]

    async def publish(self, topic: str, data: bytes) -> None:
        try:
            await self.pubsub.publish(topic, data)
        except Exception as exc:
            raise NetworkError(f"publishing on {topic} failed: {exc}") from exc

    def topic_peers(self, topic: str) -> list[str]:
        return [str(p) for p in self.pubsub.peer_topics.get(topic, ())]

    def mesh_peers(self, topic: str) -> list[str]:
        return [str(p) for p in self.gossipsub.mesh.get(topic, ())]


def _late_spawn(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "closed to new arrivals" in str(exc)

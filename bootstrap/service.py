"""The bootstrap peer: a long-lived DHT server and gossip router for any run.

It holds no run of its own. It serves the Kademlia DHT (with the RoleAdvert record validator,
so it stores only records signed by the peer they describe) and joins the gossip topics of any
run its peers subscribe to, so that the mesh of a small run does not depend on its members
finding each other first. For a run whose genesis it was given (``--run``) it validates gossip
exactly as a member does; for any other run it forwards only what is well-formed: within the
size limit, a valid signed envelope of the right kind, of the topic's run, not seen before.

With ``ledger_dir`` (what ``--http`` sets) it also keeps a replica of the ledger of every run
whose genesis it holds: the verdicts and events its gate let through, stored as any member
stores them (``LedgerStore``), so its dashboard can show contributors, balances and slashes,
and the held-out evaluations beside it (``EvaluationStore``: the evaluation curve).

It is also a circuit relay v2 hop with limits (``swarm.net.relay.RELAY_LIMITS``: reservations,
circuits, bytes and seconds per circuit) for nodes behind a NAT, and answers dial-back
requests (``swarm.net.reach``) so that nodes learn whether they are reachable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from swarm import process
from swarm.errors import SwarmError
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.ledger.evaluations import EvaluationStore
from swarm.messages import (
    Evaluation,
    LedgerEvent,
    PolicyAnnouncement,
    RunGenesis,
    Signed,
    Verdict,
    decode_any,
    run_id_of,
)
from swarm.net import (
    KEEP_CONNECTED_S,
    LEDGER_MAX_BYTES,
    POLICY_MAX_BYTES,
    DialPolicy,
    GossipStats,
    LedgerGate,
    Overlay,
    OverlayConfig,
    PolicyGate,
    PolicyTracker,
    ledger_topic,
    parse_topic,
    policy_topic,
)
from swarm.net.gossip import Refused, SeenIds

log = logging.getLogger(__name__)

MAX_RUNS = 64
"""Topics of at most this many runs are routed (a peer cannot make us join unbounded topics)."""


@dataclass
class BootstrapConfig:
    key: NodeKey
    listen: Sequence[str] = ("/ip4/0.0.0.0/tcp/4001",)
    peers: Sequence[str] = ()
    genesis: Sequence[Signed[RunGenesis]] = ()
    heartbeat: float = 1.0
    dial: DialPolicy = field(default_factory=DialPolicy)
    ledger_dir: Path | None = None
    """Keep a ledger replica of each run of ``genesis`` at ``ledger_dir/<run_id>/ledger.db``."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1 at this port (0: any free one)."""


class WellFormedGate:
    """Gossip gate for a run whose genesis we do not hold (see the module docstring)."""

    def __init__(self, run_id: str, kind: str, stats: GossipStats) -> None:
        self.run_id = run_id
        self.kind = kind
        self.stats = stats
        self.limit = POLICY_MAX_BYTES if kind == "policy" else LEDGER_MAX_BYTES
        self.types: tuple[type, ...] = (
            (PolicyAnnouncement,) if kind == "policy" else (Verdict, LedgerEvent, Evaluation)
        )
        self._seen = SeenIds()

    def __call__(self, data: bytes) -> bool:
        try:
            if len(data) > self.limit:
                raise Refused("oversize", f"{len(data)} bytes")
            try:
                signed = decode_any(data)
            except SwarmError as exc:
                raise Refused("malformed", str(exc)) from exc
            message = signed.message
            if not isinstance(
                message, (PolicyAnnouncement, Verdict, LedgerEvent, Evaluation)
            ) or not (isinstance(message, self.types)):
                raise Refused("wrong-kind", signed.envelope.kind)
            if message.run_id != self.run_id:
                raise Refused("wrong-run", message.run_id[:40])
            if signed.id in self._seen:
                raise Refused("duplicate", "seen before")
        except Refused as exc:
            self.stats.rejected[self.kind, exc.reason] += 1
            return False
        self._seen.add(signed.id)
        self.stats.accepted[self.kind] += 1
        return True


class BootstrapPeer:
    """A running bootstrap peer (use ``BootstrapPeer.start``)."""

    def __init__(self, config: BootstrapConfig, overlay: Overlay) -> None:
        self.config = config
        self.overlay = overlay
        self.stats = GossipStats()
        self.started_at = time.monotonic()
        self.trackers: dict[str, PolicyTracker] = {}
        self._known: dict[str, Signed[RunGenesis]] = {run_id_of(g): g for g in config.genesis}
        self._routed: set[str] = set()
        self.ledgers: dict[str, LedgerStore] = {}
        self.evaluations: dict[str, EvaluationStore] = {}
        """Per run with a ledger replica: the held-out evaluations gossiped beside it."""
        self.metrics_port: int | None = None
        """The port ``metrics_port`` serves on (the one picked when asked for 0)."""
        self.status_snapshot: dict[str, Any] | None = None
        """The last ``status()`` taken by the event loop, for the metrics thread."""

    @classmethod
    @asynccontextmanager
    async def start(cls, config: BootstrapConfig) -> AsyncIterator[BootstrapPeer]:
        async with Overlay.start(
            config.key,
            OverlayConfig(
                listen=config.listen,
                heartbeat=config.heartbeat,
                relay_hop=True,
                dialback_server=True,
            ),
        ) as overlay:
            peer = cls(config, overlay)
            for run_id in peer._known:
                await peer._route(run_id)
            if config.peers:
                await overlay.dial(config.peers, config.dial)
            async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
                if config.metrics_port is not None:
                    from node.net_metrics import keep_status_snapshot, serve_metrics

                    await nursery.start(keep_status_snapshot, peer)
                    stack.enter_context(serve_metrics(peer, config.metrics_port))
                nursery.start_soon(peer._follow_topics, config.heartbeat)
                if config.peers:
                    nursery.start_soon(peer._keep_peers)
                if config.ledger_dir is not None:
                    for run_id, genesis in peer._known.items():
                        store = LedgerStore(config.ledger_dir / run_id / "ledger.db", genesis)
                        peer.ledgers[run_id] = store
                        peer.evaluations[run_id] = EvaluationStore.beside(store.path)
                        nursery.start_soon(peer._keep_ledger, store)
                try:
                    yield peer
                    overlay.stopping = True  # ended normally: what follows is its teardown
                finally:
                    nursery.cancel_scope.cancel()
                    for store in peer.ledgers.values():
                        store.close()
                    for evaluations in peer.evaluations.values():
                        evaluations.close()

    async def _keep_peers(self) -> None:
        """Redial the other bootstrap peers we are not connected to, every
        ``KEEP_CONNECTED_S`` (py-libp2p's auto-connector is off: ``swarm.net.host``)."""
        while True:
            await trio.sleep(KEEP_CONNECTED_S)
            await self.overlay.redial(self.config.peers)

    def addrs(self) -> list[str]:
        return self.overlay.addrs()

    @property
    def peer_id(self) -> str:
        return self.overlay.peer_id

    async def _route(self, run_id: str) -> None:
        """Join the run's topics with the strictest gates we can build for it."""
        if run_id in self._routed or len(self._routed) >= MAX_RUNS:
            return
        self._routed.add(run_id)
        genesis = self._known.get(run_id)
        for kind, topic_of in (("policy", policy_topic), ("ledger", ledger_topic)):
            topic = topic_of(run_id)
            gate: Any
            if genesis is None:
                gate = WellFormedGate(run_id, kind, self.stats)
            elif kind == "policy":
                tracker = self.trackers.setdefault(run_id, PolicyTracker(run_id))
                policy = PolicyGate(run_id, genesis.message.trainers, tracker, self.stats)
                gate = lambda data, g=policy: g.accept(data) is not None  # noqa: E731
            else:
                signers = (*genesis.message.validators, genesis.signer)
                ledger = LedgerGate(
                    run_id,
                    signers,
                    self.stats,
                    validators=genesis.message.validators,
                    eval_every=genesis.message.params.eval_every,
                )
                gate = lambda data, g=ledger: g.accept(data) is not None  # noqa: E731
            self.overlay.set_gate(topic, gate)
            await self.overlay.subscribe(topic)
        log.info("routing gossip of run %s%s", run_id, "" if genesis else " (well-formed only)")

    async def _keep_ledger(self, store: LedgerStore) -> None:
        """Store every verdict and event of the run that the gate accepted (a replica), and its
        held-out evaluations beside it (``swarm.ledger.evaluations``)."""
        sub = await self.overlay.subscribe(ledger_topic(store.run_id))
        while True:
            msg = await sub.get()
            try:
                signed = decode_any(bytes(msg.data))
                if isinstance(signed.message, LedgerEvent):
                    store.add([signed])
                elif isinstance(signed.message, Verdict):
                    store.add_verdict(signed)
                elif isinstance(signed.message, Evaluation):
                    self.evaluations[store.run_id].add(signed)
            except SwarmError as exc:
                log.warning("ledger replica of run %s refused a message: %s", store.run_id, exc)

    async def _follow_topics(self, every: float) -> None:
        """Join the topics of every run our peers subscribe to (bounded by MAX_RUNS)."""
        while True:
            for topic in list(self.overlay.pubsub.peer_topics):
                parsed = parse_topic(topic)
                if parsed is not None:
                    await self._route(parsed[0])
            await trio.sleep(every)

    def status(self) -> dict[str, Any]:
        return {
            "role": "bootstrap",
            "peer_id": self.peer_id,
            "listen_addrs": self.addrs(),
            "connected_peers": len(self.overlay.connected_peers()),
            "dht_routing_table": self.overlay.dht.get_routing_table_size(),
            "runs_routed": sorted(self._routed),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "gossip": self.stats.as_dict(),
            "relay": self.overlay.relay_hop.status() if self.overlay.relay_hop else None,
            "warnings": list(self.overlay.internals_missing),
            "process": process.usage(),
        }

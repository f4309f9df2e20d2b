"""SHARDCAST on a running node: the store in the node's home, serving (libp2p streams plus the
data channel), provider records per version, and fetching from every provider found.

``ShardcastService`` composes the swarm parts for one ``node.runtime.Node``; the CLI uses it for
``swarm-node shardcast publish/fetch``, and the runtime can own one to fetch announced versions
and report ``status()`` (progress and per-peer rates).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from swarm.errors import NetworkError, PeerError, SwarmError
from swarm.messages import RunGenesis, ShardManifest, Signed, run_id_of
from swarm.net.host import peer_ids
from swarm.shardcast import (
    FetchConfig,
    FetchProgress,
    FetchResult,
    ShardStore,
    fetch_manifest,
    fetch_version,
)
from swarm.shardcast.datachannel import DataChannelConfig, DataChannelServer
from swarm.shardcast.fetch import ProgressCallback
from swarm.shardcast.serve import ShardServer
from swarm.shardcast.streams import StreamShardSource, serve_shardcast

log = logging.getLogger(__name__)
MIB = 1024 * 1024
ENOUGH_PROVIDERS = 8
UPLOAD_SLOTS = 4
"""Spans a node sends at once (``ShardServer.max_uploads``); more askers are told it is busy."""
SEED_COPIES = 2
"""Copies of each shard of its own version a trainer serves before it super-seeds (refers
askers to the peers it gave it to; ``ShardServer.grant``), while 3 of its 4 upload slots are
in use."""
MAX_SOURCES = 8
"""Peers other than the trainers that one fetch asks (``have`` every ``have_refresh`` s each):
a random sample of the candidates, so the polling a swarm does grows with N, not with N x
its connections."""
"""Known candidate holders (trainers, connected run peers) above which a fetch does not look
the version's provider records up in the DHT."""


def shard_root(home: Path, run_id: str) -> Path:
    """Where a node keeps a run's policy versions: ``<home>/shards/<run_id>``."""
    return home / "shards" / run_id


def version_provider_key(run_id: str, version: int) -> str:
    """The DHT provider key (hex sha2-256 multihash) of policy ``version`` of a run."""
    name = f"swarm-node/{run_id}/policy/{version}".encode()
    return (bytes([0x12, 0x20]) + hashlib.sha256(name).digest()).hex()


def _bootstrap_ids(node: Any) -> set[str]:
    """The peer ids in the node's ``--bootstrap`` addresses (``.../p2p/<id>``)."""
    config = getattr(node, "config", None)
    addrs = getattr(config, "bootstrap", ()) or ()
    return set(peer_ids(addrs))


def channel_host(listen: Sequence[str]) -> str:
    """Where the data channel listens: the IP of the node's libp2p listen addresses (its own
    interfaces, so peers on other hosts reach it), the wildcard when they name several."""
    hosts = {
        parts[2]
        for addr in listen
        if len(parts := addr.split("/")) > 2 and parts[1] in ("ip4", "ip6")
    }
    if len(hosts) == 1:
        return hosts.pop()
    return "::" if hosts and all(":" in h for h in hosts) else "0.0.0.0"


def open_store(home: Path, genesis: Signed[RunGenesis], max_disk_mib: int | None) -> ShardStore:
    """The run's store: keeps ``async_level + 1`` versions (plus pinned), within ``max_disk``."""
    return ShardStore(
        shard_root(home, run_id_of(genesis)),
        keep=genesis.message.params.async_level + 1,
        max_disk=None if max_disk_mib is None else max_disk_mib * MIB,
    )


def version_costs(store: ShardStore) -> dict[str, Any]:
    """What each stored version costs to move: its bytes (a patch's, or the whole version's)
    against its full size, and the bytes that patches saved (``summary.json``, the audit)."""
    versions: dict[str, dict[str, int | bool]] = {}
    for v in store.versions():
        try:
            m = store.manifest(v).message
        except SwarmError:
            continue
        versions[str(v)] = {"bytes": m.total_size, "full": m.full_size, "patch": m.is_patch}
    moved = sum(int(x["bytes"]) for x in versions.values())
    full = sum(int(x["full"]) for x in versions.values())
    return {
        "versions": versions,
        "bytes": moved,
        "full_bytes": full,
        "saved_bytes": full - moved,
        "patches": sum(bool(x["patch"]) for x in versions.values()),
    }


@dataclass
class ShardcastService:
    node: Any  # node.runtime.Node: overlay, handle/request, peers_by_role
    genesis: Signed[RunGenesis]
    store: ShardStore
    server: ShardServer
    channel: DataChannelServer | None
    progress: FetchProgress | None = None
    paths: dict[str, int] = field(
        default_factory=lambda: {"data_channel": 0, "stream": 0, "refused_offers": 0}
    )
    """Shards fetched over each path since start, and data channel offers refused."""
    last_fetch: dict[str, Any] | None = None
    background: trio.Nursery | None = None
    """Where provider records are published after a fetch (``start`` sets it)."""
    stopping: bool = False
    """The service is stopping: a fetch that still finishes publishes no provider record."""
    _holders: dict[int, set[str]] = field(default_factory=dict)
    """Per version, the peers its provider records named (tried first; a few versions)."""
    _lacking: frozenset[str] = frozenset()
    """The peers the running fetch asked for its manifest in vain (``expendable``)."""

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        node: Any,
        genesis: Signed[RunGenesis],
        store: ShardStore,
        *,
        data_channel: DataChannelConfig | None = None,
        advertised_host: str | None = None,
        upload_slots: int | None = UPLOAD_SLOTS,
        seed_copies: int | None = SEED_COPIES,
    ) -> AsyncIterator[ShardcastService]:
        """Serve ``store`` on ``node`` (streams, plus a data channel unless
        ``data_channel`` is ``None``) until the block ends; at most ``upload_slots`` spans
        at once (``None``: no limit); versions this node signed are super-seeded past
        ``seed_copies`` copies of a shard (``None``: never)."""
        server = ShardServer(
            store,
            max_uploads=upload_slots,
            origin=node.peer_id,
            seed_copies=seed_copies,
            seed_busy=None if upload_slots is None else upload_slots // 2 + 1,
        )
        async with trio.open_nursery() as nursery:
            channel = None
            if data_channel is not None:
                channel = DataChannelServer(server, data_channel)
                await nursery.start(channel.run)
            serve_shardcast(node, server, channel, advertised_host)
            service = cls(node, genesis, store, server, channel, background=nursery)
            trimmer = getattr(node, "connections", None)
            if trimmer is not None:  # our fetch's empty peers may go for a request of ours
                trimmer.expendable = service.expendable
            try:
                yield service
            finally:
                if trimmer is not None:
                    trimmer.expendable = frozenset
                # A fetch in another task may still finish: its provider record is then
                # skipped, never spawned into this nursery, closed from here on.
                service.background = None
                service.stopping = True
                nursery.cancel_scope.cancel()
                server.close()

    @property
    def run_id(self) -> str:
        return run_id_of(self.genesis)

    def expendable(self) -> frozenset[str]:
        """The peers the running fetch has no use for (``ConnectionTrimmer.expendable``): those
        it polls that hold none of its version, and those it asked for the manifest in vain.
        Each such ask left its peer in use for ``ConnectionBounds.in_use_s``: a newcomer at
        its cap, its connections all peers that had answered "not held", could make no room
        for the holders its provider records named, and its fetch failed at its own cap (2 of
        15 runs of ``tests/integration/test_connection_bounds.py``)."""
        empty = frozenset(self.progress.empty) if self.progress is not None else frozenset()
        return empty | self._lacking

    async def advertise(self, version: int) -> None:
        """Publish our provider record for ``version`` (best effort: logged on failure)."""
        try:
            await self.node.overlay.records.provide(version_provider_key(self.run_id, version))
        except NetworkError as exc:
            log.warning("could not advertise version %d: %s", version, exc)

    async def providers(self, version: int | None, *, records: bool = False) -> list[str]:
        """Peers that may hold ``version``: the trainers, every connected run peer (asking
        costs one small request each), and its provider records when those are fewer than
        ``ENOUGH_PROVIDERS``, no trainer is known yet, or ``records`` (none of the others held
        it: ``_manifest_and_peers``).

        The DHT lookup is skipped for a node well connected in the run: right after an
        announcement the records name the trainer alone (holders advertise once complete),
        and on 25 loopback nodes the lookup took 2.9 s (median) before the first byte moved
        (docs/BENCHMARKS.md, Scale); the connected peers are the ones that trade shards."""
        by_role = self.node.peers_by_role()
        # The genesis trainers we are connected to count even before their adverts are read
        # (on a loaded 50-node swarm, discovery had not reached them when a version came).
        connected = set(self.node.overlay.connected_peers())
        trainers = [p for p in self.genesis.message.trainers if p in connected]
        found: list[str] = [*by_role.get("trainer", []), *trainers]
        # Every run peer we know may hold verified shards (bootstrap peers serve none).
        run_peers = {p for role, peers in by_role.items() if role != "bootstrap" for p in peers}
        found += [p for p in connected if p in run_peers]
        # Then connected peers whose advert we have not read yet (on a loaded swarm, discovery
        # lags the announcement; on 25 loopback nodes some fetches knew the trainer alone, and
        # a super-seeding trainer left them nobody to take the other copies from). A peer that
        # is not in the run refuses the first request and is dropped for the version.
        boots = set(by_role.get("bootstrap", ())) | _bootstrap_ids(self.node)
        found += sorted(connected - run_peers - boots)
        trainer_known = bool(by_role.get("trainer") or trainers)
        # ``records``: with bounded connections a node holds a sample of the run, which may
        # hold nothing of this version (a 30-node test's newcomer: none of its peers did);
        # then the records are asked, and their holders tried first (``_sample``), by a DHT
        # walk when the closest peers we know name none (``DhtRecords.find_providers``).
        few = len(set(found)) < ENOUGH_PROVIDERS or not trainer_known
        if version is not None and (few or records):
            try:
                holders = await self.node.overlay.records.find_providers(
                    version_provider_key(self.run_id, version), walk=records
                )
                self._holders = {v: h for v, h in self._holders.items() if v > version - 4}
                self._holders[version] = set(holders)
                for peer in holders:  # it holds the version: dial it (``unblock`` below)
                    self.node.overlay.unblock(peer)
                found += holders
            except NetworkError as exc:
                log.debug("provider lookup failed: %s", exc)
        # A trainer (or a holder) that refused one dial at its connection cap sits in
        # py-libp2p's negative dial cache for 60 s; it is the origin of every version.
        for peer in self.genesis.message.trainers:
            self.node.overlay.unblock(peer)
        me = self.node.peer_id
        return [p for p in dict.fromkeys(found) if p != me]

    async def manifest(self, version: int, only: Sequence[str] = ()) -> Signed[ShardManifest]:
        """The verified manifest of ``version`` from its providers (``only``: these peers),
        held copies first."""
        try:
            return self.store.manifest(version)
        except SwarmError:
            pass
        peers = list(only) or self._sample(await self.providers(version))
        if not peers:
            raise PeerError(
                f"no provider of policy v{version} is known: no trainer or connected peer;"
                " check --bootstrap and that a trainer serves the version"
            )
        source = StreamShardSource(self.node)
        try:
            manifest, _ = await self._manifest_and_peers(source, version, peers, bool(only))
            return manifest
        finally:
            source.close()
            self._lacking = frozenset()

    async def _manifest_and_peers(
        self, source: StreamShardSource, version: int | None, peers: list[str], only: bool
    ) -> tuple[Signed[ShardManifest], list[str]]:
        """The manifest of ``version`` from ``peers``; when none of them holds it (a node with
        bounded connections holds a sample of the run, which may hold nothing of a version:
        ``tests/integration/test_connection_bounds.py``, and the trainer may be at its cap),
        the version's provider records are asked, their holders unblocked, and the manifest
        asked of them. Returns it and the peers to fetch from."""
        try:
            manifest = await fetch_manifest(
                source, peers, self.genesis, version, origins=self.genesis.message.trainers
            )
            return manifest, peers
        except PeerError:
            if only or version is None:
                raise
            log.info("no connected peer held v%d: asking its provider records", version)
        # Until the fetch ends (``fetch``), the record lookup's own dials included; a trainer
        # is the origin of every version, and one the records name may have its copy since.
        self._lacking = frozenset(peers) - set(self.genesis.message.trainers)
        peers = self._sample(await self.providers(version, records=True))
        self._lacking -= self._holders.get(version, set())
        manifest = await fetch_manifest(
            source, peers, self.genesis, version, origins=self.genesis.message.trainers
        )
        return manifest, peers

    async def _record_holders(self, version: int) -> list[str]:
        """The peers the version's provider records name (asked when few of ours hold it:
        ``swarm.shardcast.fetch.MIN_SOURCES``)."""
        return await self.providers(version, records=True)

    async def fetch(
        self,
        version: int | None = None,
        *,
        config: FetchConfig | None = None,
        on_progress: ProgressCallback | None = None,
        only: Sequence[str] = (),
        manifest: Signed[ShardManifest] | None = None,
    ) -> FetchResult:
        """Fetch ``version`` (default: the newest any provider holds), then advertise it.
        ``only``: fetch from these peers and no others (``shardcast fetch --from``);
        ``manifest``: the version's verified manifest when the caller has it (carried by the
        announcement), so no provider is asked for it."""
        for peer in only:  # asked for by name: dialed even if it refused us a moment ago
            self.node.overlay.unblock(peer)
        peers = list(only) or self._sample(await self.providers(version))
        if not peers:
            raise PeerError(
                "no provider of the policy is known yet: no trainer or connected peer;"
                " check --bootstrap and that a trainer serves the version"
            )
        source = StreamShardSource(self.node)
        log.info(
            "fetching v%s: asking %d peers for the manifest",
            "?" if version is None else version,
            len(peers),
        )
        try:
            if manifest is None or manifest.message.version != version:
                manifest, peers = await self._manifest_and_peers(source, version, peers, bool(only))
            if version is None and not only:
                peers = self._sample(await self.providers(manifest.message.version))

            done = -1

            def progress(p: FetchProgress) -> None:
                nonlocal done
                self.progress = p
                if p.shards_done != done:  # a new shard here: answer the waiting ``have``s
                    done = p.shards_done
                    self.server.changed()
                if on_progress is not None:
                    on_progress(p)

            more_peers = None if only else partial(self._record_holders, manifest.message.version)
            result = await fetch_version(
                self.store,
                manifest,
                source,
                peers,
                config=config,
                on_progress=progress,
                rng=random.Random(),
                origins=self.genesis.message.trainers,
                more_peers=more_peers,
            )
        finally:
            source.close()
            self._lacking = frozenset()
            self._count_paths(source, version, peers)
        # The provider record is best effort and takes a DHT walk (seconds under load): the
        # copy is usable, and served to connected peers, before it is published.
        if self.background is not None:
            self.background.start_soon(self.advertise, manifest.message.version)
        elif not self.stopping:
            await self.advertise(manifest.message.version)
        return result

    def _sample(self, peers: list[str]) -> list[str]:
        """The trainers among ``peers`` and at most ``MAX_SOURCES`` of the others, at random,
        known run peers before peers of no known role."""
        trainers = set(self.genesis.message.trainers)
        members = {p for role, ps in self.node.peers_by_role().items() for p in ps}
        holders = set().union(*self._holders.values()) if self._holders else set()
        recorded = [p for p in peers if p not in trainers and p in holders]
        known = [p for p in peers if p not in trainers and p in members and p not in holders]
        unknown = [p for p in peers if p not in trainers and p not in members | holders]
        others = random.sample(recorded, min(len(recorded), MAX_SOURCES))
        others += random.sample(known, min(len(known), MAX_SOURCES - len(others)))
        others += random.sample(unknown, min(len(unknown), MAX_SOURCES - len(others)))
        return [p for p in peers if p in trainers] + others

    def path_to(self, peer: str) -> str:
        """ "direct", "relayed" (only a circuit through a relay) or "none" (not connected)."""
        if self.node.direct_path(peer) is not None:
            return "direct"
        return "relayed" if self.node.overlay.connected(peer) else "none"

    def _count_paths(
        self, source: StreamShardSource, version: int | None, peers: Sequence[str] = ()
    ) -> None:
        """Say which path the download's shards took (status and the log)."""
        self.paths["data_channel"] += source.channel_pulls
        self.paths["stream"] += source.stream_pulls
        self.paths["refused_offers"] += source.refused_offers
        self.last_fetch = {
            "version": version,
            "data_channel_shards": source.channel_pulls,
            "stream_shards": source.stream_pulls,
            "refused_offers": source.refused_offers,
            "peer_paths": {p: self.path_to(p) for p in peers},
        }
        if source.channel_pulls or source.stream_pulls:
            log.info(
                "policy v%s: %d shards over data channels, %d over libp2p streams%s",
                "?" if version is None else version,
                source.channel_pulls,
                source.stream_pulls,
                f" ({source.refused_offers} offers refused)" if source.refused_offers else "",
            )

    def status(self) -> dict[str, Any]:
        """For ``swarm-node status``: stored versions, the current fetch, what was served."""
        return {
            "versions": [
                {
                    "version": v.version,
                    "complete": v.complete,
                    "shards": f"{v.verified}/{v.shards}",
                    "bytes": v.total_size,
                    "pinned": v.pinned,
                }
                for v in self.store.iter_info()
            ],
            "fetch": None if self.progress is None else self.progress.view(),
            "served_bytes": self.server.served_bytes,
            "served_shards": self.server.served_shards,
            "data_channel_port": None if self.channel is None else self.channel.port,
            "data_channel_host": None if self.channel is None else self.channel.config.host,
            "paths": dict(self.paths),
            "last_fetch": self.last_fetch,
        }

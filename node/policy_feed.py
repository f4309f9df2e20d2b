"""Policy weights for a role on a running node: the trainer publishes and announces, everyone
else fetches each announced version through SHARDCAST (``node.shardcast.ShardcastService``), and
every holder serves and advertises what it holds.

Gossip does not replay the past, and it loses messages (a peer that dies mid-forward takes a
message with it), so a node that joins after an announcement, or missed one, would wait for the
next one; a validator that missed version n refuses all work of version n and no version n + 1
ever comes (found by the netns test). ``/swarm-node/<run>/policy/1`` closes that gap: every node
answers with the newest announcement it holds (the trainer's own signature, checked by the same
gate as gossip). A node with none asks its peers until it has one; after that it asks one or two
peers whenever the policy has been quiet for ``refresh_every_s`` (anti-entropy), and at once when
someone shows it work of a version it has not heard of (``pull``).

Version 0 is the run's model: when the genesis binds a model card, every node checks that the
assembled v0 file is the card's weights (sha256) before using it, refuses (and deletes) one that
is not, and pins v0, so a contributor who joins late can still fetch the model from its peers.

A version may travel as a patch against its parent (``ShardManifest.base``; docs/shardcast.md):
``node.version_chain.VersionChain`` fetches its base first (through ``fetch_version``, so the
chain back to the newest snapshot takes the same locks and the v0 check), reconstructs and checks
it, and counts the bytes each version moved.
"""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from node.model.card import weights_mismatch
from node.runtime import Node
from node.shardcast import ShardcastService, channel_host
from node.version_chain import VersionChain
from swarm.errors import PeerError, SwarmError, ValidationError
from swarm.messages import Fields, PolicyAnnouncement, ShardManifest, Signed
from swarm.net import StreamLimits
from swarm.net.names import POLICY
from swarm.shardcast import (
    FetchConfig,
    ShardStore,
    announced_manifest,
    inline_manifest,
)
from swarm.shardcast.datachannel import DataChannelConfig
from swarm.shardcast.fetch import ProgressCallback
from swarm.shardcast.publish import publish_version
from swarm.wire import canonical, decode_canonical

log = logging.getLogger(__name__)

CATCH_UP_MAX_S = 60.0
"""The longest wait between two asks for a run's first announcement (``PolicyFeed._catch_up``)."""
POLICY_LIMITS = StreamLimits(max_request=64, max_response=PolicyAnnouncement.MAX_BYTES + 256)


class PolicyFeed:
    def __init__(
        self,
        node: Node,
        root: Path,
        *,
        data_channel: bool = True,
        fetch: FetchConfig | None = None,
        max_disk: int | None = None,
        catch_up_every_s: float = 2.0,
        refresh_every_s: float = 10.0,
    ) -> None:
        params = node.config.genesis.message.params
        self.node = node
        # One version more than the window: the newest may arrive while the oldest is in use.
        self.store = ShardStore(root, keep=params.async_level + 2, max_disk=max_disk)
        self.data_channel = data_channel
        self.fetch_config = fetch or FetchConfig(
            stall_timeout=10.0, give_up_after=30.0, have_refresh=0.5
        )
        self.catch_up_every_s = catch_up_every_s
        self.refresh_every_s = refresh_every_s
        self.service: ShardcastService | None = None
        self._locks: dict[int, trio.Lock] = {}
        self._v0_checked = False
        self.chain = VersionChain(self.store)
        """Patches and their bases, and the bytes each version moved."""
        self._refused_v0: bytes | None = None
        """The manifest id of a v0 refused as not the card's weights: never fetched again."""

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve shards and the newest announcement; catch up on the policy until cancelled."""
        listen = self.node.config.listen
        channel = DataChannelConfig(host=channel_host(listen)) if self.data_channel else None
        async with ShardcastService.start(
            self.node, self.node.config.genesis, self.store, data_channel=channel
        ) as service:
            self.service = service
            self.node.handle(POLICY, self._on_policy, POLICY_LIMITS)
            task_status.started()
            await self._catch_up()

    async def _on_policy(self, peer: str, body: bytes) -> bytes:
        """The newest announcement held here; a request naming a version (``{"version": N}``)
        gets the one accepted for it."""
        if body:
            request = Fields("policy-request", decode_canonical(body, POLICY_LIMITS.max_request))
            wanted = request.integer("version", minimum=0)
            held = self.node.policy.accepted.get(wanted)
            if held is None:
                raise PeerError(f"no announcement of policy v{wanted} held here")
            return held.raw
        newest = self.node.policy.newest
        if newest is None:
            raise PeerError("no policy announcement known here yet")
        return newest.raw

    async def _catch_up(self) -> None:
        """Until some announcement is known, ask trainers first, then other peers; after that,
        ask a peer or two whenever no announcement has come for ``refresh_every_s``."""
        wait = self.catch_up_every_s
        while self.node.policy.newest is None:
            trainers = self.node.peers_by_role().get("trainer", [])
            await self.pull([*trainers, *self._some_peers(3)])
            # Back off (2 s, 4 s, ... up to ``CATCH_UP_MAX_S``) while nobody has one: before
            # a run's first announcement every node asked the trainer and 3 peers every 2 s
            # (50 requests/s at the trainer with 100 nodes, a third of an idle node's CPU;
            # docs/BENCHMARKS.md, Scale), and every 10 s was still 9% of an idle node's loop
            # (bench/idle.py --profile, N = 25). A node joining a running swarm gets its
            # answer on the first ask; the first announcement itself comes by gossip,
            # whatever this waits.
            with trio.move_on_after(wait):
                await self.node.policy.wait_for(0)
            wait = min(2 * wait, max(CATCH_UP_MAX_S, self.catch_up_every_s))
        while True:
            version = self.node.policy.version
            with trio.move_on_after(self.refresh_every_s):
                await self.node.policy.wait_for((version or 0) + 1)
                continue  # gossip is flowing
            await self.pull(self._some_peers(2))

    def _some_peers(self, n: int) -> list[str]:
        """``n`` run peers to ask for the newest announcement (any peer's answer carries the
        trainer's signature), those we are connected to first: with bounded connections a
        request to another dials it, and that connection is trimmed again (churn)."""
        connected = set(self.node.overlay.connected_peers())
        peers = [p for ps in self.node.peers_by_role().values() for p in ps]
        random.shuffle(peers)
        peers.sort(key=lambda p: p not in connected)  # stable: random within each half
        return peers[:n]

    async def pull(self, peers: list[str], timeout: float = 5.0) -> bool:
        """Ask ``peers`` at once for their newest announcement; ``True`` when one was newer
        than ours (the others are cancelled then). The answer carries the trainer's signature
        and goes through the gossip gate, so any peer may be asked. At once, not in turn: the
        trainer is asked first and, serving a new version to every node, it may not answer
        within ``timeout``; asked in turn, it used up the whole budget (12 of 100 nodes never
        learnt a version in 90 s; docs/BENCHMARKS.md, Scale)."""

        def take(raw: bytes, peer: str) -> None:
            signed = self.node.policy_gate.check(raw)
            self.node.policy_gate.keep(signed)
            log.info("policy v%d learnt from %s", signed.message.version, peer[-8:])

        return await self._first_answer(peers, b"", take, timeout)

    async def announcement_of(
        self, version: int, peers: Sequence[str] = (), timeout: float = 5.0
    ) -> Signed[PolicyAnnouncement] | None:
        """The announcement accepted for ``version``, asked of ``peers``, the trainers and a
        few others at once when gossip never brought it (kept in ``policy.accepted``, checked
        like gossip but for being the newest: ``PolicyGate.check_past``); None when nobody
        answered with it within ``timeout``. A validator that missed one announcement (its
        gossip lost while v+1's arrived) could not audit that version: the weights are fetched
        by the announcement, which binds the manifest (tests/integration/test_role_healing.py,
        docs/RELIABILITY.md)."""
        held = self.node.policy.accepted.get(version)
        if held is not None or self.node.policy.newest is None:
            return held

        def take(raw: bytes, peer: str) -> None:
            self.node.policy.remember(self.node.policy_gate.check_past(raw, version))
            log.info("policy v%d's announcement asked for and had from %s", version, peer[-8:])

        trainers = self.node.peers_by_role().get("trainer", [])
        asked = [*peers, *trainers, *self._some_peers(3)]
        await self._first_answer(asked, canonical({"version": version}), take, timeout)
        return self.node.policy.accepted.get(version)

    async def _first_answer(
        self,
        peers: Sequence[str],
        body: bytes,
        take: Callable[[bytes, str], None],
        timeout: float,
    ) -> bool:
        """Ask ``peers`` at once with ``body``; ``take(answer, peer)`` checks and keeps an
        answer (raising ``SwarmError`` for one refused), with no await between the two. The
        first answer taken cancels the other asks: ``True``; ``False`` when none was taken
        within ``timeout``. A refusal is the usual answer (stale, duplicate, none held): a
        debug line."""
        taken = False

        async def ask(peer: str, cancel: trio.CancelScope) -> None:
            nonlocal taken
            try:
                take(await self.node.request(peer, POLICY, body, POLICY_LIMITS), peer)
            except SwarmError as exc:
                log.debug("policy answer of %s not taken: %s", peer[-8:], exc)
                return
            taken = True
            cancel.cancel()

        with trio.move_on_after(timeout) as scope:
            async with trio.open_nursery() as nursery:
                for peer in dict.fromkeys(peers):
                    if peer != self.node.peer_id:
                        nursery.start_soon(ask, peer, scope)
        return taken

    def manifest_id(self, version: int) -> bytes | None:
        """The manifest id of ``version`` when known here: from its accepted announcement (the
        gossip gate keeps one per version), else from the manifest of a held copy (checked
        against its announcement when it was fetched). The assignment of a run with a quota
        mixes it (``swarm.assignment``)."""
        announced = self.node.policy.accepted.get(version)
        if announced is not None:
            return announced.message.manifest_id
        try:
            return self.store.manifest(version).id
        except SwarmError:
            return None  # not held, or unreadable leftovers

    def manifests(self, versions: range) -> dict[int, bytes]:
        """``manifest_id`` of each of ``versions`` that is known here."""
        known = {v: self.manifest_id(v) for v in versions}
        return {v: m for v, m in known.items() if m is not None}

    def path_of(self, version: int) -> Path | None:
        """What loads a complete local version (its safetensors file, or the directory of a
        sharded version's files), or None."""
        return self.store.weights_path(version)

    def _service(self) -> ShardcastService:
        if self.service is None:
            raise RuntimeError("PolicyFeed.run must be started first")
        return self.service

    async def publish(self, version: int, weights: Path | Sequence[Path]) -> Signed[ShardManifest]:
        """Trainer: cut, sign, store, serve and advertise ``weights`` (a safetensors file, or
        the files of a sharded checkpoint) as ``version``, a patch against ``version - 1``
        where the run's rules say so (``publish_version``); announce.
        A version already stored (a restarted trainer) is announced again as it is."""
        node = self.node
        if self.store.is_complete(version):
            # Published before a restart: serve and announce what is stored; a new cut would
            # be a second manifest for the same version.
            manifest = self.store.manifest(version)
            await self._service().advertise(version)
            known = node.policy.version
            if known is not None and known >= version:
                # Its peers answered the catch-up with this very announcement before the
                # restarted trainer got here: announcing it again would be refused as stale.
                log.info("policy v%d is known to the swarm already; serving it", version)
            else:
                await node.announce_policy(version, manifest.id, inline_manifest(manifest))
            return manifest
        self._discard_own_partial(version)
        manifest = await trio.to_thread.run_sync(
            lambda: publish_version(
                weights,
                key=node.key,
                genesis=node.config.genesis,
                version=version,
                store=self.store,
            )
        )
        self.chain.count(manifest.message, manifest.message.total_size)
        self.chain.totals["published_versions"] += 1
        self.chain.totals["published_bytes"] += manifest.message.total_size
        await trio.to_thread.run_sync(self.chain.finish, version)
        if version == 0:
            held = self.path_of(0)
            await self._check_v0(held or self.store.directory(0) / "data")
        await self._service().advertise(version)
        await node.announce_policy(version, manifest.id, inline_manifest(manifest))
        return manifest

    def discard_own(self, version: int) -> None:
        """Remove our own cut of ``version`` (several trainers: another copy won)."""
        self._discard_own_partial(version)

    def _discard_own_partial(self, version: int) -> None:
        """A publish cut short by kill -9 leaves this trainer's own manifest with unfinished
        data; a new cut signs a new manifest, which the store would refuse. Nobody can hold a
        complete copy of the partial one (it was never announced), so it is removed."""
        if version not in self.store.versions():
            return
        try:
            mine = self.store.manifest(version).signer == self.node.peer_id
        except SwarmError:
            mine = True  # unreadable leftovers of a crashed cut
        if mine:
            log.warning("removing policy v%d left unfinished by a crashed publish", version)
            shutil.rmtree(self.store.directory(version), ignore_errors=True)

    async def fetch(
        self,
        announcement: Signed[PolicyAnnouncement],
        on_progress: ProgressCallback | None = None,
    ) -> Path:
        """The local file of the announced version, fetched (or resumed) when missing."""
        version = announcement.message.version
        if version == 0 and announcement.message.manifest_id == self._refused_v0:
            raise ValidationError(
                "policy v0 of this announcement was refused before (not the run's model weights)"
            )
        self._drop_own_losing_cut(announcement)
        try:
            carried = announced_manifest(announcement, self.node.config.genesis)
        except SwarmError as exc:  # signed by its trainer, yet unusable: ask the peers
            log.warning("the manifest carried by the v%d announcement: %s", version, exc)
            carried = None
        local = await self.fetch_version(version, on_progress, manifest=carried)
        if self.store.manifest(version).id != announcement.message.manifest_id:
            raise ValidationError(
                f"the trainer signed two manifests for v{version}; the held one is not the"
                " announced one"
            )
        return local

    def _drop_own_losing_cut(self, announcement: Signed[PolicyAnnouncement]) -> None:
        """Our own cut of the announced version that is not the announced one lost to another
        trainer's (we were killed, or slower, between cutting and announcing it): remove it,
        so that we fetch and hold the announced copy like every other node. Kept, it made
        this trainer hold a second manifest of the version and refuse the announced one
        (tests/system/test_trainer_group.py, after a kill -9 of the publishing trainer)."""
        version = announcement.message.version
        if version not in self.store.versions():
            return
        try:
            held = self.store.manifest(version)
        except SwarmError:
            return  # unreadable: the fetch reports it
        if held.signer == self.node.peer_id and held.id != announcement.message.manifest_id:
            log.warning(
                "removing our own cut of policy v%d: the swarm took another trainer's", version
            )
            shutil.rmtree(self.store.directory(version), ignore_errors=True)

    async def fetch_version(
        self,
        version: int,
        on_progress: ProgressCallback | None = None,
        manifest: Signed[ShardManifest] | None = None,
    ) -> Path:
        """The local file of ``version``, fetched from its providers when missing (version 0
        checked against the model card); ``manifest``: its verified manifest if known."""
        async with self._locks.setdefault(version, trio.Lock()):
            local = await self.chain.weights(
                self._service(),
                version,
                manifest=manifest,
                config=self.fetch_config,
                on_progress=on_progress,
                base=self.fetch_version,
            )
            if version == 0:
                await self._check_v0(local)
        self._locks.pop(version, None)
        return local

    @property
    def transfers(self) -> dict[int, dict[str, int | bool]]:
        return self.chain.transfers

    @property
    def refused_versions(self) -> int:
        return self.chain.refused_versions

    def transfer_view(self) -> dict[str, Any]:
        return self.chain.view()

    async def _check_v0(self, path: Path) -> None:
        """Version 0 must be the model card's weights; pinned once checked."""
        card = self.node.config.genesis.message.model
        if not card.all_weights() or self._v0_checked:
            return
        why = await trio.to_thread.run_sync(weights_mismatch, card, path)
        if why is not None:
            self._refused_v0 = self.store.manifest(0).id
            shutil.rmtree(self.store.directory(0), ignore_errors=True)
            names = ", ".join(ref.name for ref in card.all_weights()[:3])
            raise ValidationError(
                f"policy v0 {why}: the trainer's version 0 is not the run's model weights"
                f" ({names}); refused and deleted"
            )
        self.store.pin(0)
        self._v0_checked = True

    def status(self) -> dict[str, Any]:
        if self.service is None:
            return {}
        return {**self.service.status(), "transfers": self.transfer_view()}

"""Audit from the swarm alone: ``swarm-node audit --run RUN.genesis --bootstrap ADDR``.

An auditor holds the genesis and a bootstrap address, nothing else. ``gather`` joins the run as
a throwaway node (a fresh key, role ``inference``, advertising nothing it would serve besides
what it fetched), and copies what the audit reads into a work folder:

1. the ledger, by ledger sync with every validator (and any other peer) until a full round
   brings nothing new;
2. the evidence of every slash and dispute, and of a sample of ``credits`` counted credits
   (``sample_credits``, the same draw ``audit_ledger`` replays), by the evidence protocol from
   the accuser first, then any holder (``EvidenceService.keep``);
3. the weights of every policy version those verdicts judged, by SHARDCAST (``--max-versions``
   bounds it), into a shard store of the folder (a patch with the chain it needs, reconstructed
   and checked against its manifest's tensor hashes; ``node.version_chain``);
4. the policy announcements the node accepted while it ran (trainer-signed: version ->
   manifest id), into the evidence store, pinned. With the manifests of the shard store
   (``Gathered.manifest_id``) they give the manifest id that the assignment of a run with a
   quota mixes.

``audit_ledger`` then replays the folder offline (the model runs only after the node left, so
the replay never stalls a live event loop). What no peer served shows as a failed or unchecked
row, never as agreement.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from node.audit import sample_credits
from node.roles.evidence import EvidenceService, cited
from node.roles.ledger_sync import LedgerReplica
from node.runtime import Node, RuntimeConfig
from node.shardcast import ShardcastService
from node.version_chain import VersionChain
from swarm.errors import NetworkError, PeerError, SwarmError
from swarm.evidence import EvidenceStore
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import LedgerEvent, PolicyAnnouncement, RunGenesis, Signed, Verdict, decode
from swarm.net import DialPolicy
from swarm.shardcast import FetchConfig, ShardStore

log = logging.getLogger(__name__)

SYNC_ROUNDS = 5
STEP_S = 60.0
"""At most this long for one sync exchange or one slash's evidence (a peer that stalls costs
a bounded wait; what it did not serve shows as a failed row)."""


@dataclass
class Gathered:
    ledger: Path
    evidence: Path
    shards: Path
    versions: list[int]
    """Policy versions whose weights were fetched."""
    missing_versions: list[int]
    synced_from: list[str]

    def policy_path(self, version: int) -> Path | None:
        """What loads ``version`` (a patch reconstructed; checked against its manifest's
        tensor hashes by ``node.audit_weights.checked_source`` before a replay)."""
        return ShardStore(self.shards, keep=1 << 20).weights_path(version)

    def manifest_id(self, version: int) -> bytes | None:
        """The id of the trainer-signed manifest of ``version`` fetched here (None: not held)."""
        try:
            return ShardStore(self.shards, keep=1 << 20).manifest(version).id
        except SwarmError:
            return None


async def gather(
    genesis: Signed[RunGenesis],
    bootstrap: Sequence[str],
    workdir: Path,
    *,
    credits: int | None = 8,
    listen: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
    discover_s: float = 60.0,
    dial: DialPolicy | None = None,
) -> Gathered:
    """Copy the ledger, the evidence and the weights an audit needs from the swarm."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = auditor_config(genesis, bootstrap, listen, dial)
    ledger = LedgerStore(workdir / "ledger.db", genesis)
    evidence_store = EvidenceStore(workdir / "evidence.db")
    shards = ShardStore(workdir / "shards", keep=1 << 20)
    try:
        async with Node.start(config) as node:
            started = trio.current_time()

            def done(what: str) -> None:
                log.info("audit: %s (%.1f s)", what, trio.current_time() - started)

            evidence = EvidenceService(node, evidence_store)
            evidence.serve()
            validators = await _find_validators(node, genesis, discover_s)
            done(f"{len(validators)} validators reached")
            synced = await _sync(LedgerReplica(node, ledger), validators)
            done(f"ledger of {len(ledger)} events synced")
            replayed = await _keep_evidence(ledger, evidence, validators, credits)
            done(f"evidence of {len(replayed)} events fetched")
            versions = _versions_judged(ledger, evidence_store, replayed)
            fetched, missing = await _fetch_weights(node, genesis, shards, versions)
            done(f"weights of versions {fetched} fetched ({missing} missing)")
            for announcement in list(node.policy.accepted.values()):
                evidence_store.put(announcement.raw, PolicyAnnouncement.KIND, pinned=True)
    finally:
        ledger.close()
        evidence_store.close()
    return Gathered(
        workdir / "ledger.db", workdir / "evidence.db", workdir / "shards", fetched, missing, synced
    )


def auditor_config(
    genesis: Signed[RunGenesis],
    bootstrap: Sequence[str],
    listen: Sequence[str],
    dial: DialPolicy | None,
) -> RuntimeConfig:
    """The throwaway node an audit joins as: a fresh key, role ``inference``."""
    return RuntimeConfig(
        key=NodeKey.generate(),
        genesis=genesis,
        role="inference",
        listen=listen,
        bootstrap=bootstrap,
        discover_every_s=1.0,
        dial=dial or DialPolicy(),
    )


async def _find_validators(node: Node, genesis: Signed[RunGenesis], wait_s: float) -> list[str]:
    """Connect to the genesis validators: their peer ids are in the genesis, their addresses in
    their signed adverts on the DHT (one lookup each, no role enumeration)."""
    from swarm.errors import ConfigError
    from swarm.net.dial import dial_once

    wanted = list(genesis.message.validators)
    found: list[str] = []
    with trio.move_on_after(wait_s):
        while len(found) < len(wanted):
            for peer in wanted:
                if peer in found:
                    continue
                # Dial the advertised addresses even when a connection exists: the dial puts
                # them in the peerstore, so a stream can be opened again if it drops.
                advert = node.membership.advert_of(peer)
                if advert is None:
                    with trio.move_on_after(5.0):
                        advert = await node.overlay.records.get_advert(node.run_id, peer)
                for addr in advert.message.addrs if advert is not None else ():
                    try:
                        if await dial_once(node.overlay.host, addr, 5.0) is None:
                            found.append(peer)
                            break
                    except ConfigError:
                        continue  # an address we cannot parse: the next one
            if len(found) < len(wanted):
                await trio.sleep(0.5)
    if not found:
        raise PeerError(
            f"no validator of run {node.run_id} reached in {wait_s:.0f} s through"
            f" {len(node.bootstrap_connected)} bootstrap peer(s); check --bootstrap, or wait"
            " longer (--discover)"
        )
    if len(found) < len(wanted):
        log.warning("%d of %d validators reached; auditing with those", len(found), len(wanted))
    return found


async def _sync(replica: LedgerReplica, validators: list[str]) -> list[str]:
    """Sync with every validator (each holds the whole ledger it judged and synced) until a
    round adds nothing; each exchange bounded by ``STEP_S``."""
    answered: list[str] = []
    for _ in range(SYNC_ROUNDS):
        added = 0
        for peer in validators:
            with trio.move_on_after(STEP_S):
                try:
                    added += (await replica.sync_with(peer)).added
                except SwarmError as exc:
                    log.info("ledger sync with %s failed: %s", peer[-8:], exc)
                    if type(exc) is NetworkError:  # no stream at all: dial afresh next round
                        await replica.node.forget_peer(peer)
                    continue
                if peer not in answered:
                    answered.append(peer)
        if not added:
            break
    return answered


async def _keep_evidence(
    ledger: LedgerStore, evidence: EvidenceService, validators: list[str], credits: int | None
) -> list[Signed[LedgerEvent]]:
    """Fetch the evidence of every slash and dispute and of the sampled credits; returns
    those events (what the audit replays)."""
    events = list(ledger.events())
    counted = {e.id for e in events if ledger.is_counted(e.id)}
    accusing = [e for e in events if e.message.event in ("slash", "dispute")]
    replayed = [*accusing, *sample_credits(events, counted, credits)]
    for event in replayed:
        with trio.move_on_after(STEP_S):
            await evidence.keep(cited(event), [event.signer, *validators], pinned=True)
    return replayed


def _versions_judged(
    ledger: LedgerStore, evidence: EvidenceStore, events: list[Signed[LedgerEvent]]
) -> list[int]:
    versions: set[int] = set()
    for event in events:
        for object_id in cited(event):
            raw = evidence.get(object_id) or ledger.verdict_raw(object_id)
            if raw is None:
                continue
            try:
                verdict = decode(raw, Verdict)
            except SwarmError:
                continue  # a submission: its verdict names the same version
            if verdict.message.policy_version >= 0:
                versions.add(verdict.message.policy_version)
    return sorted(versions)


async def _fetch_weights(
    node: Node, genesis: Signed[RunGenesis], shards: ShardStore, versions: list[int]
) -> tuple[list[int], list[int]]:
    fetched: list[int] = []
    missing: list[int] = []
    chain = VersionChain(shards)  # a patch brings its base chain with it
    async with ShardcastService.start(node, genesis, shards, data_channel=None) as service:
        for version in versions:
            if shards.weights_path(version) is not None:
                fetched.append(version)
                continue
            with trio.move_on_after(STEP_S):
                try:
                    await chain.weights(
                        service, version, config=FetchConfig(stall_timeout=10.0, give_up_after=30.0)
                    )
                except SwarmError as exc:
                    log.warning("weights of policy v%d not fetched: %s", version, exc)
            (fetched if shards.weights_path(version) is not None else missing).append(version)
    return fetched, missing

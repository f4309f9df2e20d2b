"""What a node knows about its run, gathered for the dashboard: a ``RunView``.

Decisions this module owns:
- **One view, two kinds of node.** ``RunView`` holds what the page shows that is not in the
  ledger: the node's own status, the policy versions it has seen (``PolicyLog``, fed by the
  ``PolicyTracker``), SHARDCAST holders per version (``HolderWatch``: provider records in the
  DHT plus the node's own store) and the download rates of its own fetches. ``node_view``
  builds one for a role node (``join``), ``bootstrap_view`` for a bootstrap peer given the run's
  genesis, whose ledger is the replica it keeps from gossip.
- **Nothing private leaves.** ``public_status`` keeps only plain data and replaces any string
  that holds the node's home path or the user's home directory; key material is never in a
  status to begin with (the tests check both).
- **Evidence from the holders.** A slash cites a verdict; the verdict names the submission (and
  an equivocation's verdict the other one). A node that lacks one of them (a bootstrap peer, a
  worker) fetches it by id over the ``evidence`` protocol from the run's validators, checks that
  the bytes hash to the id and every signature, then packs the bundle. The bundle of a run with
  a quota also holds the trainer-signed announcement of the submission's version (the
  assignment mixes its manifest id, so the bundle replays alone): the one the node's policy
  tracker accepted (``RunView.announced``), else one kept in the evidence store beside the
  ledger (what validators keep, kind ``policy-announcement``); none when neither holds it.
- Holder lookups are bounded: the newest ``HOLDER_VERSIONS`` versions, every ``every_s``.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import trio

from node.bundle import pack_bundle, policy_of
from node.web.queries import LedgerQueries
from swarm.errors import PeerError, SwarmError
from swarm.evidence import address_of
from swarm.ledger.evaluations import read_curve
from swarm.ledger.training import read_disputes
from swarm.messages import (
    Message,
    PolicyAnnouncement,
    RolloutSubmission,
    RunGenesis,
    Signed,
    Verdict,
    decode,
    run_id_of,
)
from swarm.net import StreamLimits, request, stream_protocol
from swarm.net.names import EVIDENCE

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

MAX_VERSIONS_KEPT = 100_000
HOLDER_VERSIONS = 8
EVIDENCE_LIMITS = StreamLimits(max_request=256, max_response=8 * 1024 * 1024, timeout=10.0)
EVIDENCE_ROUNDS = 3
EVIDENCE_PAUSE_S = 1.0
HIDDEN = "[hidden]"
STATUS_EVERY_S = 0.5


def public_status(status: Any, private: Iterable[str]) -> Any:
    """``status`` as plain JSON data, with every string that holds one of ``private`` (paths)
    replaced by ``HIDDEN``."""
    needles = [p for p in private if p and p != "/"]

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple, set, frozenset)):
            return [clean(v) for v in value]
        if isinstance(value, str):
            return HIDDEN if any(n in value for n in needles) else value
        if isinstance(value, bytes):
            return value.hex()
        if value is None or isinstance(value, (bool, int, float)):
            return value
        return str(value)

    return clean(status)


@dataclass
class PolicyLog:
    """Every policy announcement the node kept, with when it arrived (bounded)."""

    entries: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_VERSIONS_KEPT))

    def record(self, signed: Signed[PolicyAnnouncement]) -> None:
        a = signed.message
        self.entries.append(
            {
                "version": a.version,
                "manifest": a.manifest_id.hex(),
                "announced_at_ms": a.issued_at,
                "seen_at_ms": int(time.time() * 1000),
                "trainer": signed.signer,
            }
        )

    def newest(self) -> int | None:
        return self.entries[-1]["version"] if self.entries else None

    def page(self, limit: int, before: int | None) -> list[dict[str, Any]]:
        """Newest first, versions below ``before`` (versions only grow: a version cursor)."""
        out = []
        for entry in reversed(self.entries):
            if before is not None and entry["version"] >= before:
                continue
            out.append(entry)
            if len(out) == limit:
                break
        return out


class HolderWatch:
    """Who holds which policy version (DHT provider records, refreshed every ``every_s``),
    and the download rates of this node's own fetches, per version."""

    def __init__(
        self, records: Any, me: str, run_id: str, versions: Callable[[], list[int]]
    ) -> None:
        self.records = records
        """The node's ``swarm.net.DhtRecords``."""
        self.me = me
        self.run_id = run_id
        self.versions = versions
        self.holders: dict[int, list[str]] = {}
        self.downloads: dict[int, dict[str, Any]] = {}
        self.local: Callable[[], list[int]] = list
        """Complete versions in this node's own store."""
        self.progress: Callable[[], dict[str, Any] | None] = lambda: None

    def note_progress(self) -> None:
        view = self.progress()
        if view and isinstance(view.get("version"), int):
            self.downloads[int(view["version"])] = view
            while len(self.downloads) > HOLDER_VERSIONS * 4:
                self.downloads.pop(min(self.downloads))

    async def run(self, every_s: float = 5.0) -> None:
        from node.shardcast import version_provider_key

        while True:
            self.note_progress()
            wanted = sorted(self.versions())[-HOLDER_VERSIONS:]
            own = set(self.local())
            for version in wanted:
                try:
                    found = await self.records.find_providers(
                        version_provider_key(self.run_id, version)
                    )
                except SwarmError as exc:
                    log.debug("holder lookup of v%d failed: %s", version, exc)
                    found = self.holders.get(version, [])
                if version in own:
                    found = [self.me, *found]
                self.holders[version] = list(dict.fromkeys(found))
            for version in [v for v in self.holders if v not in wanted]:
                del self.holders[version]
            await trio.sleep(every_s)


@dataclass
class RunView:
    """Everything the dashboard reads about one run from one node (see the module docstring)."""

    run_id: str
    genesis: Signed[RunGenesis]
    status: Callable[[], dict[str, Any]]
    policy: PolicyLog
    holders: HolderWatch
    queries: LedgerQueries | None
    roles: Callable[[], dict[str, str]]
    live_seen_ms: Callable[[], dict[str, int]] = dict
    private: tuple[str, ...] = ()
    host: Any = None
    """The libp2p host, to fetch evidence this node does not hold."""
    peer_id: str = ""
    announced: Mapping[int, Signed[PolicyAnnouncement]] = field(default_factory=dict)
    """The announcement the node's policy tracker accepted per version (``accepted``), for
    bundles."""
    evaluations: Callable[[], list[dict[str, Any]]] = list
    """The held-out evaluation curve the node keeps (``swarm.ledger.evaluations.read_curve``)."""
    training_disputes: Callable[[], list[dict[str, Any]]] = list
    """The training disputes the node keeps (``swarm.ledger.training.read_disputes``)."""

    @property
    def params(self) -> Any:
        return self.genesis.message.params

    _status_cache: tuple[float, Any] = field(default=(-1.0, None), init=False, repr=False)

    def public_status(self) -> Any:
        """The node's status without private strings; read at most once per
        ``STATUS_EVERY_S`` however many pages ask."""
        at, cached = self._status_cache
        now = time.monotonic()
        if cached is None or now - at >= STATUS_EVERY_S:
            cached = public_status(self.status(), self.private)
            self._status_cache = (now, cached)
        return cached

    async def bundle(self, worker: str, verdict_id: bytes) -> bytes | None:
        """The audit bundle of the verdict ``verdict_id`` (what a slash cites): the verdict, the
        submission it judged and any other submission it names, from this node's ledger and
        evidence, else from the validators; None when some part is held by nobody reachable. A run
        with a quota: with the announcement of the submission's version when this node holds it
        (module docstring)."""
        from node.roles.judge import OTHER_SUBMISSION

        try:
            verdict = await self._envelope(verdict_id, Verdict)
            if verdict is None or (worker and verdict.message.worker != worker):
                return None
            submission = await self._envelope(verdict.message.submission_id, RolloutSubmission)
            if submission is None:
                return None
            related = []
            other = verdict.message.metrics.get(OTHER_SUBMISSION)
            if isinstance(other, str) and len(other) == 64:
                found = await self._envelope(bytes.fromhex(other), RolloutSubmission)
                related = [found.raw] if found is not None else []
        except (SwarmError, ValueError) as exc:
            log.info("bundle of %s: %s", verdict_id.hex()[:16], exc)
            return None
        version = submission.message.policy_version
        policy = await anyio.to_thread.run_sync(
            policy_of, self.genesis, version, self._announcements(version)
        )
        return pack_bundle(self.genesis.raw, submission.raw, verdict.raw, related, policy)

    def _announcements(self, version: int) -> Iterator[bytes]:
        """Announcements that may be of ``version``, read lazily: the tracker's, then the
        evidence store's beside the ledger (read-only, opened only when the tracker lacks it)."""
        held = self.announced.get(version)
        if held is not None:
            yield held.raw
        if self.queries is not None:
            yield from _kept_announcements(self.queries.path.with_name("evidence.db"))

    async def _envelope(self, object_id: bytes, kind: type[M]) -> Signed[M] | None:
        raw = None
        if self.queries is not None:
            raw = await anyio.to_thread.run_sync(self.queries.envelope, object_id)
        if raw is None and self.host is not None:
            raw = await self._fetch(object_id)
        return None if raw is None else decode(raw, kind)  # signatures checked here

    async def _fetch(self, object_id: bytes) -> bytes | None:
        """``object_id`` from the genesis validators: asked in turn, ``EVIDENCE_ROUNDS`` rounds
        at most, a validator that refused (it holds no such object) not again. One missed answer
        (a busy validator, a connection being replaced) is no reason to 404 a bundle."""
        asked = [v for v in self.genesis.message.validators if v != self.peer_id]
        for round_ in range(EVIDENCE_ROUNDS):
            if round_:
                await trio.sleep(EVIDENCE_PAUSE_S * round_)
            for validator in list(asked):
                try:
                    raw = await request(
                        self.host,
                        validator,
                        stream_protocol(self.run_id, EVIDENCE),
                        object_id,
                        EVIDENCE_LIMITS,
                    )
                except SwarmError as exc:
                    log.info("evidence %s from %s: %s", object_id.hex()[:16], validator[-8:], exc)
                    if isinstance(exc, PeerError):
                        asked.remove(validator)  # an answer: not held there
                    continue
                if address_of(raw) == object_id:
                    return raw
                log.info("evidence %s from %s: other bytes", object_id.hex()[:16], validator[-8:])
                asked.remove(validator)
        return None


def _kept_announcements(evidence: Path) -> list[bytes]:
    """Every policy announcement an evidence store file holds, oldest first, on a read-only
    connection of its own ([] when there is no such file or it cannot be read)."""
    if not evidence.exists():
        return []
    try:
        db = sqlite3.connect(f"{evidence.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = db.execute(
                "SELECT raw FROM objects WHERE kind = ? ORDER BY rowid", (PolicyAnnouncement.KIND,)
            ).fetchall()
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        log.info("announcements of %s: %s", evidence, exc)
        return []
    return [bytes(raw) for (raw,) in rows]


def _genesis_roles(genesis: Signed[RunGenesis]) -> dict[str, str]:
    g = genesis.message
    return {**{p: "validator" for p in g.validators}, **{p: "trainer" for p in g.trainers}}


def _private_paths(home: Path | None) -> tuple[str, ...]:
    paths = [str(Path.home())]
    if home is not None:
        paths += [str(home), str(home.resolve())]
    return tuple(paths)


def node_view(node: Any, ledger_path: Path | None, feed: Any = None) -> RunView:
    """A role node's view (``node.runtime.Node``; ``feed``: its ``PolicyFeed``, if any)."""
    genesis = node.config.genesis
    policy = PolicyLog()
    if node.policy.newest is not None:
        policy.record(node.policy.newest)
    node.policy.on_change(policy.record)
    holders = HolderWatch(
        node.overlay.records,
        node.peer_id,
        node.run_id,
        lambda: [e["version"] for e in policy.entries],
    )
    if feed is not None:
        holders.local = lambda: [v for v in feed.store.versions() if feed.store.is_complete(v)]
        holders.progress = lambda: (
            feed.service.progress.view() if feed.service and feed.service.progress else None
        )

    def roles() -> dict[str, str]:
        found = {p: role for role, ps in node.peers_by_role().items() for p in ps}
        return {**found, **_genesis_roles(genesis), node.peer_id: node.role}

    def live_seen() -> dict[str, int]:
        out = {}
        for peers in node.peers_by_role().values():
            for peer in peers:
                advert = node.membership.advert_of(peer)
                if advert is not None:
                    out[peer] = int(advert.message.issued_at)
        return out

    g = genesis.message.params
    queries = (
        LedgerQueries(
            ledger_path,
            initial_balance=g.initial_balance,
            ban_threshold=g.ban_threshold,
            quota=g.quota,
            window=g.async_level + 1,
        )
        if ledger_path is not None
        else None
    )
    home = node.config.home.path if node.config.home is not None else None
    return RunView(
        run_id=node.run_id,
        genesis=genesis,
        status=node.status,
        policy=policy,
        holders=holders,
        queries=queries,
        roles=roles,
        live_seen_ms=live_seen,
        private=_private_paths(home),
        host=node.overlay.host,
        peer_id=node.peer_id,
        announced=node.policy.accepted,
        evaluations=(lambda: read_curve(ledger_path)) if ledger_path is not None else list,
        training_disputes=(
            (lambda: read_disputes(ledger_path)) if ledger_path is not None else list
        ),
    )


def bootstrap_view(boot: Any, genesis: Signed[RunGenesis], home: Path | None) -> RunView:
    """A bootstrap peer's view of one run it holds the genesis of (``--run``): its policy
    tracker, the DHT's provider records, and the ledger replica it keeps from gossip."""
    run_id = run_id_of(genesis)
    tracker = boot.trackers[run_id]
    policy = PolicyLog()
    if tracker.newest is not None:
        policy.record(tracker.newest)
    tracker.on_change(policy.record)
    holders = HolderWatch(
        boot.overlay.records,
        boot.overlay.peer_id,
        run_id,
        lambda: [e["version"] for e in policy.entries],
    )
    store = boot.ledgers.get(run_id)
    g = genesis.message.params
    queries = (
        LedgerQueries(
            store.path,
            initial_balance=g.initial_balance,
            ban_threshold=g.ban_threshold,
            quota=g.quota,
            window=g.async_level + 1,
        )
        if store is not None
        else None
    )
    roles = _genesis_roles(genesis) | {boot.peer_id: "bootstrap"}
    return RunView(
        run_id=run_id,
        genesis=genesis,
        status=boot.status,
        policy=policy,
        holders=holders,
        queries=queries,
        roles=lambda: roles,
        private=_private_paths(home),
        host=boot.overlay.host,
        peer_id=boot.peer_id,
        announced=tracker.accepted,
        evaluations=(lambda: read_curve(store.path)) if store is not None else list,
        training_disputes=(lambda: read_disputes(store.path)) if store is not None else list,
    )

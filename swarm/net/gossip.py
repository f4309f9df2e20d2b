"""Gossip validation: what a node accepts (and so forwards) on a run's topics.

A topic validator runs on every message before GossipSub delivers or forwards it; returning
``False`` drops it here, so a refused message never reaches a peer behind us. Checks, cheapest
first: size, envelope (typed decode, signature), signer holds the genesis role, run id, not a
duplicate, and (policy topic) a version newer than the newest known. Every verdict is counted by
reason in ``GossipStats`` for ``swarm-node status`` and metrics.

``PolicyTracker`` keeps the newest valid PolicyAnnouncement; the policy gate updates it the moment
a message is accepted, so two racing announcements of one version cannot both pass.

One policy per version: the gate remembers the manifest accepted for each recent version
(``MANIFESTS_KEPT``). A genesis trainer's announcement of a known version with another manifest
is refused (reason ``conflict``, never forwarded) and kept as a ``PolicyConflict``: both signed
announcements, for ``status``, the ledger's evidence and ``ledger show``. The first manifest a
node accepted stays its policy, so the run does not fork.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import trio

from swarm.errors import (
    NotAuthorizedError,
    OversizeError,
    SignatureError,
    SwarmError,
    UnknownKindError,
    WireError,
)
from swarm.messages import (
    Evaluation,
    LedgerEvent,
    PolicyAnnouncement,
    Signed,
    TrainingDispute,
    TrainingRecord,
    Verdict,
    decode,
    decode_any,
    eval_due,
    eval_validator,
)

log = logging.getLogger(__name__)

ENVELOPE_OVERHEAD = 256
"""Bytes an envelope adds around a payload (array, kind, 32-byte key, 64-byte signature)."""

POLICY_MAX_BYTES = PolicyAnnouncement.MAX_BYTES + ENVELOPE_OVERHEAD
LEDGER_MAX_BYTES = (
    max(Verdict.MAX_BYTES, LedgerEvent.MAX_BYTES, Evaluation.MAX_BYTES, TrainingRecord.MAX_BYTES)
    + ENVELOPE_OVERHEAD
)

REASONS = (
    "oversize",
    "malformed",
    "bad-signature",
    "wrong-kind",
    "not-authorized",
    "wrong-run",
    "duplicate",
    "stale",
    "conflict",
    "not-due",
)
POLICY_CONFLICT = "policy-conflict"
"""Ledger evidence kind under which nodes keep both halves of a ``PolicyConflict``."""
MANIFESTS_KEPT = 4096
"""Versions whose accepted manifest id the policy gate remembers, to detect conflicts."""


@dataclass(frozen=True)
class PolicyConflict:
    """Two signed announcements of one version with different manifests (the first accepted)."""

    version: int
    accepted: Signed[PolicyAnnouncement]
    refused: Signed[PolicyAnnouncement]

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "accepted": {
                "manifest": self.accepted.message.manifest_id.hex(),
                "signer": self.accepted.signer,
            },
            "refused": {
                "manifest": self.refused.message.manifest_id.hex(),
                "signer": self.refused.signer,
            },
        }


class Refused(SwarmError):
    """A gossip message a topic validator refuses; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class GossipStats:
    """Messages accepted and rejected (by reason) per topic kind ("policy", "ledger")."""

    accepted: Counter[str] = field(default_factory=Counter)
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        rejected: dict[str, dict[str, int]] = {}
        for (topic, reason), n in sorted(self.rejected.items()):
            rejected.setdefault(topic, {})[reason] = n
        return {"accepted": dict(self.accepted), "rejected": rejected}


class SeenIds:
    """A bounded set of envelope ids (oldest forgotten first), for duplicate detection."""

    def __init__(self, capacity: int = 4096) -> None:
        self._ids: OrderedDict[bytes, None] = OrderedDict()
        self._capacity = capacity

    def __contains__(self, item: bytes) -> bool:
        return item in self._ids

    def add(self, item: bytes) -> None:
        self._ids[item] = None
        self._ids.move_to_end(item)
        while len(self._ids) > self._capacity:
            self._ids.popitem(last=False)


def _classify(exc: SwarmError) -> str:
    if isinstance(exc, OversizeError):
        return "oversize"
    if isinstance(exc, SignatureError):
        return "bad-signature"
    if isinstance(exc, UnknownKindError):
        return "wrong-kind"
    if isinstance(exc, NotAuthorizedError):
        return "not-authorized"
    if isinstance(exc, WireError):
        return "malformed"
    return "malformed"


def _check_size(data: bytes, limit: int) -> None:
    if len(data) > limit:
        raise Refused("oversize", f"{len(data)} bytes is over the topic limit of {limit}")


class PolicyTracker:
    """The newest valid PolicyAnnouncement of one run, with a way to wait for a version."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.newest: Signed[PolicyAnnouncement] | None = None
        self._changed = trio.Event()
        self._listeners: list[Callable[[Signed[PolicyAnnouncement]], None]] = []
        self.accepted: OrderedDict[int, Signed[PolicyAnnouncement]] = OrderedDict()
        """The announcement accepted for each recent version."""
        self.conflicts: list[PolicyConflict] = []
        self._conflict_listeners: list[Callable[[PolicyConflict], None]] = []

    @property
    def version(self) -> int | None:
        return None if self.newest is None else self.newest.message.version

    def offer(self, signed: Signed[PolicyAnnouncement]) -> bool:
        """Keep ``signed`` if it is newer than what we hold; ``True`` when it was kept."""
        if self.newest is not None and signed.message.version <= self.newest.message.version:
            return False
        self.newest = signed
        self.accepted[signed.message.version] = signed
        while len(self.accepted) > MANIFESTS_KEPT:
            self.accepted.popitem(last=False)
        self._changed.set()
        self._changed = trio.Event()
        for listener in list(self._listeners):
            try:
                listener(signed)
            except Exception:  # a listener's bug must not take gossip validation down
                log.exception("policy listener failed")
        return True

    def remember(self, signed: Signed[PolicyAnnouncement]) -> None:
        """Keep the announcement of a version older than the newest that gossip never brought
        (asked for by number; ``PolicyGate.check_past``) in ``accepted``, the newest and its
        listeners untouched; one already held, or not older, is left as it is."""
        version = signed.message.version
        if (
            self.newest is None
            or version >= self.newest.message.version
            or version in self.accepted
        ):
            return
        self.accepted[version] = signed
        ordered = sorted(self.accepted.items())  # in place: views hold this very dict
        self.accepted.clear()
        self.accepted.update(ordered[-MANIFESTS_KEPT:])

    def on_change(self, listener: Callable[[Signed[PolicyAnnouncement]], None]) -> None:
        self._listeners.append(listener)

    def conflicting(self, signed: Signed[PolicyAnnouncement]) -> PolicyConflict | None:
        """The conflict ``signed`` makes with the accepted announcement of its version, if any
        (recorded once, and listeners told)."""
        held = self.accepted.get(signed.message.version)
        if held is None or held.message.manifest_id == signed.message.manifest_id:
            return None
        for known in self.conflicts:
            if known.refused.id == signed.id:
                return known
        conflict = PolicyConflict(signed.message.version, held, signed)
        self.conflicts.append(conflict)
        log.error(
            "two manifests for policy v%d: kept %s from %s, refused %s from %s",
            conflict.version,
            held.message.manifest_id.hex()[:16],
            held.signer,
            signed.message.manifest_id.hex()[:16],
            signed.signer,
        )
        for listener in list(self._conflict_listeners):
            try:
                listener(conflict)
            except Exception:
                log.exception("policy conflict listener failed")
        return conflict

    def on_conflict(self, listener: Callable[[PolicyConflict], None]) -> None:
        self._conflict_listeners.append(listener)

    async def wait_for(self, version: int) -> Signed[PolicyAnnouncement]:
        """Return once a version >= ``version`` is known (cancel to give up)."""
        while self.newest is None or self.newest.message.version < version:
            await self._changed.wait()
        return self.newest


class PolicyGate:
    """Validator of a run's policy topic: only genesis trainers, only newer versions."""

    def __init__(
        self, run_id: str, trainers: Collection[str], tracker: PolicyTracker, stats: GossipStats
    ) -> None:
        self.run_id = run_id
        self.trainers = frozenset(trainers)
        self.tracker = tracker
        self.stats = stats
        self._seen = SeenIds()

    def check(self, data: bytes) -> Signed[PolicyAnnouncement]:
        """Decode and check one message without counting or keeping it; raise ``Refused``."""
        signed = self._signed(data)
        if signed.id in self._seen:
            raise Refused("duplicate", "announcement seen before")
        self._no_conflict(signed)
        newest = self.tracker.version
        if newest is not None and signed.message.version <= newest:
            raise Refused("stale", f"version {signed.message.version} is not newer than {newest}")
        return signed

    def check_past(self, data: bytes, version: int) -> Signed[PolicyAnnouncement]:
        """An announcement of ``version`` asked for by number (``PolicyFeed.announcement_of``:
        one whose gossip never reached us), checked like gossip but for being the newest;
        ``Refused`` (``stale``) when it is of another version."""
        signed = self._signed(data)
        if signed.message.version != version:
            raise Refused("stale", f"asked for version {version}, got {signed.message.version}")
        self._no_conflict(signed)
        return signed

    def _signed(self, data: bytes) -> Signed[PolicyAnnouncement]:
        _check_size(data, POLICY_MAX_BYTES)
        try:
            signed = decode(data, PolicyAnnouncement)
        except SwarmError as exc:
            raise Refused(_classify(exc), str(exc)) from exc
        if signed.signer not in self.trainers:
            raise Refused("not-authorized", f"{signed.signer} is not a genesis trainer")
        if signed.message.run_id != self.run_id:
            raise Refused("wrong-run", f"announcement of run {signed.message.run_id[:40]!r}")
        return signed

    def _no_conflict(self, signed: Signed[PolicyAnnouncement]) -> None:
        conflict = self.tracker.conflicting(signed)
        if conflict is not None:
            raise Refused(
                "conflict",
                f"version {conflict.version} has manifest"
                f" {conflict.accepted.message.manifest_id.hex()[:16]} already",
            )

    def accept(self, data: bytes) -> Signed[PolicyAnnouncement] | None:
        """Check, count, and keep; ``None`` when refused."""
        try:
            signed = self.check(data)
        except Refused as exc:
            self.stats.rejected["policy", exc.reason] += 1
            log.info("refused policy gossip (%s)", exc)
            return None
        self.keep(signed)
        return signed

    def keep(self, signed: Signed[PolicyAnnouncement]) -> None:
        """Count and keep an announcement ``check`` passed (one that came by request rather
        than gossip: a refusal there is the usual answer and is not counted or logged)."""
        self._seen.add(signed.id)
        self.tracker.offer(signed)
        self.stats.accepted["policy"] += 1
        log.info(
            "policy version %d accepted (manifest %s, from %s)",
            signed.message.version,
            signed.message.manifest_id.hex()[:16],
            signed.signer,
        )


class LedgerGate:
    """Validator of a run's ledger topic: verdicts and ledger events from genesis validators
    (stake grants from the run owner), and held-out evaluations from the validator due to
    evaluate their version (``eval_validator`` over ``validators``, versions ``eval_due`` at
    ``eval_every``; anything else is refused as ``not-due``), training records from genesis
    ``trainers`` and training disputes from genesis validators, of this run, each once."""

    def __init__(
        self,
        run_id: str,
        signers: Collection[str],
        stats: GossipStats,
        capacity: int = 65536,
        *,
        validators: Collection[str] = (),
        eval_every: int = 0,
        trainers: Collection[str] = (),
    ) -> None:
        self.run_id = run_id
        self.signers = frozenset(signers)
        self.trainers = frozenset(trainers)
        self.validators = tuple(validators)
        self.eval_every = eval_every
        self.stats = stats
        self._seen = SeenIds(capacity)

    def check(self, data: bytes) -> Signed[Any]:
        _check_size(data, LEDGER_MAX_BYTES)
        try:
            signed = decode_any(data)
        except SwarmError as exc:
            raise Refused(_classify(exc), str(exc)) from exc
        if not isinstance(
            signed.message, (Verdict, LedgerEvent, Evaluation, TrainingRecord, TrainingDispute)
        ):
            raise Refused("wrong-kind", f"{signed.envelope.kind} does not belong on the ledger")
        if isinstance(signed.message, TrainingRecord):
            allowed, who = self.trainers, "trainer"
        elif isinstance(signed.message, TrainingDispute):
            allowed, who = frozenset(self.validators), "validator"
        else:
            allowed, who = self.signers, "validator"
        if signed.signer not in allowed:
            raise Refused("not-authorized", f"{signed.signer} is not a genesis {who}")
        if signed.message.run_id != self.run_id:
            raise Refused("wrong-run", f"message of run {signed.message.run_id[:40]!r}")
        if isinstance(signed.message, Evaluation):
            self._check_due(signed.message.version, signed.signer)
        if signed.id in self._seen:
            raise Refused("duplicate", "ledger message seen before")
        return signed

    def _check_due(self, version: int, signer: str) -> None:
        if not eval_due(version, self.eval_every):
            every = f"every {self.eval_every}" if self.eval_every else "off"
            raise Refused("not-due", f"version {version} is not evaluated (cadence {every})")
        due = eval_validator(self.run_id, version, self.validators)
        if signer != due:
            raise Refused("not-due", f"version {version} is evaluated by {due}, not {signer}")

    def accept(self, data: bytes) -> Signed[Any] | None:
        try:
            signed = self.check(data)
        except Refused as exc:
            self.stats.rejected["ledger", exc.reason] += 1
            log.info("refused ledger gossip (%s)", exc)
            return None
        self._seen.add(signed.id)
        self.stats.accepted["ledger"] += 1
        return signed


def refuse_reason(exc: BaseException) -> str:
    """The stats reason of an exception raised while checking a message."""
    if isinstance(exc, Refused):
        return exc.reason
    if isinstance(exc, SwarmError):
        return _classify(exc)
    return "malformed"


__all__ = [
    "LEDGER_MAX_BYTES",
    "POLICY_CONFLICT",
    "POLICY_MAX_BYTES",
    "REASONS",
    "GossipStats",
    "LedgerGate",
    "PolicyConflict",
    "PolicyGate",
    "PolicyTracker",
    "Refused",
    "SeenIds",
]

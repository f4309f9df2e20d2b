"""Audit: re-verify a ledger (or one proof bundle) from nothing but its bytes and the weights.

For a ledger database: every event's signature and the run's rules, every balance (the stored
balances against a fresh fold), and for every counted slash and credit its evidence: the
worker's signed submission and the validator's signed verdict, re-judged on the policy version
it claims. The auditor agrees with a slash when its own judgement is also a hard rejection, and
with a credit when it also accepts, with the same rewards. Evidence lives in the validator's
ledger (a replica of the events alone cannot be replayed: audit the validator's copy, or bundles).

A proof bundle (``export_bundle``) holds the genesis, the submission, the verdict and any related
submissions (the earlier one of a replay) as signed envelopes in a msgpack map, so it replays
without the ledger.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from node.bundle import BUNDLE_FORMAT, pack_bundle
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.roles.judge import JudgeContext, judge
from node.run import suite_for
from swarm.errors import ConfigError, MalformedError, StorageError, SwarmError
from swarm.ledger import LedgerStore, check_event, fold
from swarm.messages import (
    REWARD_SCALE,
    LedgerEvent,
    RolloutSubmission,
    RunGenesis,
    Signed,
    Verdict,
    decode,
    run_id_of,
)

PolicySource = Callable[[int], Path | None]


@dataclass(frozen=True)
class AuditRow:
    subject: str
    check: str
    ok: bool | None
    """True: agrees; False: disagrees; None: could not be checked (weights missing)."""
    detail: str


def policy_dir_source(directory: Path | None) -> PolicySource:
    """Weights of version v at ``DIR/v{v}.safetensors``; version 0 defaults to the embedded
    model's own weights."""

    def find(version: int) -> Path | None:
        if directory is not None:
            candidate = directory / f"v{version}.safetensors"
            if candidate.exists():
                return candidate
        if version == 0:
            return DEFAULT_MODEL_DIR / "model.safetensors"
        return None

    return find


class _Engines:
    """One fp32 engine, reloaded per version on demand."""

    def __init__(self, source: PolicySource) -> None:
        self.source = source
        self._engine: TorchEngine | None = None
        self._version: int | None = None

    def get(self, version: int) -> TorchEngine:
        path = self.source(version)
        if path is None:
            raise ConfigError(
                f"weights of policy version {version} not found; pass --policy-dir with"
                f" v{version}.safetensors (or fetch it with `swarm-node shardcast fetch`)"
            )
        if self._engine is None:
            self._engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="float32")
        if self._version != version:
            self._engine.load_weights(str(path))
            self._version = version
        return self._engine


def replay_slash(
    genesis: Signed[RunGenesis],
    submission: Signed[RolloutSubmission],
    verdict: Signed[Verdict],
    related: list[Signed[RolloutSubmission]],
    engines: _Engines,
) -> AuditRow:
    """Re-judge the evidence of one slash; ok when the auditor also rejects it hard."""
    subject = submission.id.hex()[:16]
    g = genesis.message
    if verdict.signer not in g.validators:
        return AuditRow(subject, "slash evidence", False, "verdict not signed by a validator")
    if (
        verdict.message.submission_id != submission.id
        or verdict.message.worker != submission.signer
    ):
        return AuditRow(subject, "slash evidence", False, "verdict does not match the submission")
    s = submission.message
    seen = any(
        r.id != submission.id
        and r.signer == submission.signer
        and (r.message.policy_version, r.message.counter) == (s.policy_version, s.counter)
        for r in related
    )
    ctx = JudgeContext(
        run_id_of(genesis), g.params, suite_for(g), s.policy_version, fold([], g.params)
    )
    try:
        engine = engines.get(s.policy_version)
    except ConfigError as exc:
        return AuditRow(subject, "slash replay", None, f"cannot replay: {exc}")
    try:
        mine = judge(submission, ctx, engine, counter_seen=seen)
    except SwarmError as exc:
        return AuditRow(subject, "slash replay", False, f"cannot replay: {exc}")
    agree = not mine.accepted and mine.severity == "hard"
    theirs = "; ".join(verdict.message.reasons)[:120]
    detail = f"validator: {theirs} | auditor: {'; '.join(mine.reasons)[:120] or 'accepted'}"
    return AuditRow(subject, "slash replay", agree, detail)


def audit_ledger(path: Path, source: PolicySource, *, credits: int | None = None) -> list[AuditRow]:
    """Every check of the module docstring. Counted credits are re-judged too (the validator's
    accepted work must replay to an accept with the same rewards): all of them by default, a
    random sample of ``credits`` of them (0: none) when a full replay would take too long."""
    store = LedgerStore.open_existing(path)
    genesis = store.genesis
    rows: list[AuditRow] = []
    events: list[Signed[LedgerEvent]] = []
    for raw in store.raw_events():
        try:
            event = decode(raw, LedgerEvent)
            check_event(event, genesis)
        except SwarmError as exc:
            rows.append(AuditRow("event", "signature and rules", False, str(exc)))
            continue
        events.append(event)
    rows.append(AuditRow("events", "signature and rules", True, f"{len(events)} events verified"))
    balances = fold(events, genesis.message.params)
    stored = store.stored_balances()
    wrong = {p: (b, balances.of(p)) for p, b in stored.items() if balances.of(p) != b}
    missing = set(balances.by_peer) - set(stored)
    rows.append(
        AuditRow(
            "balances",
            "fold",
            not wrong and not missing,
            f"{len(balances.by_peer)} balances agree"
            if not wrong and not missing
            else f"stored balances differ from the fold: {wrong or sorted(missing)}",
        )
    )
    engines = _Engines(source)
    counted = [e for e in events if e.id in balances.counted]
    chosen = [e for e in counted if e.message.event == "credit"]
    if credits is not None and credits < len(chosen):
        chosen = random.Random(0).sample(chosen, credits)
        rows.append(
            AuditRow("credits", "sample", True, f"replaying {credits} of {len(counted)} credits")
        )
    slashes = [e for e in counted if e.message.event == "slash"]
    for event in [*slashes, *sorted(chosen, key=lambda e: e.message.created_at)]:
        rows.append(_replay_from_store(store, genesis, event, engines))
    store.close()
    return rows


def _evidence_of(store: LedgerStore, subject: bytes) -> tuple[Any, Any, list[Any]]:
    subs = [decode(r, RolloutSubmission) for r in store.evidence(subject, "submission")]
    verdicts = [decode(r, Verdict) for r in store.evidence(subject, "verdict")]
    main = next((s for s in subs if s.id == subject), None)
    verdict = next((v for v in verdicts if v.message.submission_id == subject), None)
    return main, verdict, subs


def _replay_from_store(
    store: LedgerStore, genesis: Signed[RunGenesis], event: Signed[LedgerEvent], engines: _Engines
) -> AuditRow:
    subject = event.message.evidence
    try:
        submission, verdict, related = _evidence_of(store, subject)
    except SwarmError as exc:
        return AuditRow(subject.hex()[:16], "slash evidence", False, f"bad evidence: {exc}")
    if submission is None or verdict is None:
        return AuditRow(subject.hex()[:16], "slash evidence", False, "evidence missing")
    if submission.signer != event.message.peer:
        return AuditRow(subject.hex()[:16], "evidence", False, "the event's peer did not sign")
    if event.message.event == "credit":
        if not verdict.message.accepted:
            return AuditRow(subject.hex()[:16], "credit evidence", False, "verdict did not accept")
        return _replay_accept(genesis, submission, verdict, engines)
    return replay_slash(genesis, submission, verdict, related, engines)


def export_bundle(ledger: Path, submission_id: bytes, out: Path) -> None:
    """Write the self-contained proof bundle of one judged submission."""
    store = LedgerStore.open_existing(ledger)
    submission, verdict, related = _evidence_of(store, submission_id)
    if submission is None or verdict is None:
        raise ConfigError(f"no evidence for submission {submission_id.hex()} in {ledger}")
    related_raw = [r.raw for r in related if r.id != submission.id]
    data = pack_bundle(store.genesis.raw, submission.raw, verdict.raw, related_raw)
    store.close()
    out.write_bytes(data)


def audit_bundle(path: Path, source: PolicySource) -> list[AuditRow]:
    try:
        bundle = msgpack.unpackb(path.read_bytes(), raw=False)
        if not isinstance(bundle, dict) or bundle.get("format") != BUNDLE_FORMAT:
            raise MalformedError("not a proof bundle")
        genesis = decode(bundle["genesis"], RunGenesis)
        submission = decode(bundle["submission"], RolloutSubmission)
        verdict = decode(bundle["verdict"], Verdict)
        related = [decode(r, RolloutSubmission) for r in bundle.get("related", [])]
    except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise ConfigError(f"{path} is not a readable proof bundle: {exc}") from exc
    if verdict.message.accepted:
        row = _replay_accept(genesis, submission, verdict, _Engines(source))
    else:
        row = replay_slash(genesis, submission, verdict, related, _Engines(source))
    return [row]


def _replay_accept(
    genesis: Signed[RunGenesis],
    submission: Signed[RolloutSubmission],
    verdict: Signed[Verdict],
    engines: _Engines,
) -> AuditRow:
    g = genesis.message
    s = submission.message
    ctx = JudgeContext(
        run_id_of(genesis), g.params, suite_for(g), s.policy_version, fold([], g.params)
    )
    try:
        engine = engines.get(s.policy_version)
    except ConfigError as exc:
        return AuditRow(submission.id.hex()[:16], "accept replay", None, f"cannot replay: {exc}")
    mine = judge(submission, ctx, engine, counter_seen=False)
    same_rewards = [round(r * REWARD_SCALE) for r in mine.rewards] == list(verdict.message.rewards)
    ok = mine.accepted and same_rewards
    detail = (
        "accepted with the same rewards" if ok else f"auditor: {mine.reasons or 'rewards differ'}"
    )
    return AuditRow(submission.id.hex()[:16], "accept replay", ok, detail)


def is_ledger_file(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(16) == b"SQLite format 3\0"
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror}") from exc

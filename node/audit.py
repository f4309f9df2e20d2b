"""Audit: re-verify a ledger (or one proof bundle) from nothing but its bytes and the weights.

For a ledger database: every event's signature and the run's rules, every balance (the stored
balances against a fresh fold), and for every counted slash and credit its evidence: the
validator's signed verdict (the event cites it) and the worker's signed submission (the verdict
names it), re-judged on the policy version it claims. The auditor agrees with a slash when its
own judgement is also a hard rejection (an equivocation: when the two envelopes are two
different signed submissions of one assignment, no model needed), and with a credit when it
also accepts, with the same rewards. Disputes are settled by replaying the disputed submission.

Evidence is looked up by id (``EvidenceLookup``): in the content-addressed evidence store next
to the ledger (``<run dir>/evidence.db``, what every validator keeps), then the ledger's own
verdicts. ``node.audit_swarm`` fills such a store from the swarm (``audit --run --bootstrap``).
Evidence a holder's budget summarized (``swarm.evidence``: sha256 and size kept, bytes dropped)
is reported as such, an unchecked row naming the object, never as agreement or as missing.

The run's model is the one its genesis's card binds: ``AuditAssets.model`` (``--model``, checked
against the card: a copy that differs is refused, the file named), else the home's cache that
``join`` filled, else the embedded model when the card binds it. Version 0 replays on the card's
weights file. A data-set run needs its data set the same way (``--tasks`` or the cache).

A run with a quota (``RunParams.quota``) assigns prompts and seeds from the policy version's
manifest id (``swarm.assignment``), so a replay needs it too (``ManifestSource``): from the
caller (``manifests=``: the swarm audit reads the manifests of the shard store it fetched into),
else from the trainer-signed announcements that validators keep in their evidence store (kind
``policy-announcement``; only announcements of this run signed by a genesis trainer count, the
first held per version). A replay whose version's manifest id is not known is an unchecked row
naming the version, never agreement. A legacy run (``quota == 0``) needs none.

The held-out evaluations stored beside the ledger (``evaluations.db``,
``swarm.ledger.evaluations``) are checked too (``audit_evaluations``): each record's cadence,
signer, seed and items, and one item per record, drawn from the record's id, regenerated alone
on the version's weights (``node.rl.evaluation.replay_item``) and scored: a different score is
a failed row naming the version and the item.

A proof bundle (``export_bundle``) holds the genesis, the submission, the verdict and any related
submissions (the other one of an equivocation) as signed envelopes in a msgpack map, so it
replays without the ledger; the announcement of the submission's version, when the bundle holds
it (``policy``: a list of envelopes), gives the manifest id.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack

from node.bundle import BUNDLE_FORMAT, pack_bundle, policy_of, trainer_announcements
from node.compute.torch_engine import TorchEngine
from node.home import resolve_home
from node.model.text import chat_template_wanted
from node.rl.evaluation import replay_item
from node.roles.judge import OTHER_SUBMISSION, JudgeContext, equivocation, judge
from node.run import TaskSource, eval_ids, suite_for
from node.run_assets import AssetDirs, local_data_set, local_model
from swarm.errors import ConfigError, MalformedError, StorageError, SwarmError
from swarm.evidence import EvidenceStore, Summary
from swarm.ledger import EQUIVOCATION, LedgerStore, fold
from swarm.ledger.evaluations import EvaluationStore
from swarm.ledger.recheck import recheck
from swarm.messages import (
    REWARD_SCALE,
    Evaluation,
    LedgerEvent,
    PolicyAnnouncement,
    RolloutSubmission,
    RunGenesis,
    Signed,
    Verdict,
    decode,
    eval_due,
    eval_seed,
    eval_validator,
    run_id_of,
)

PolicySource = Callable[[int], Path | None]
ManifestSource = Callable[[int], bytes | None]
"""Policy version -> its manifest id (None when not known)."""


def no_manifests(version: int) -> bytes | None:
    return None


def announced_manifests(genesis: Signed[RunGenesis], raws: Iterable[bytes]) -> dict[int, bytes]:
    """Version -> manifest id from signed announcements: only those of this run signed by one
    of its genesis trainers, the first of each version (what the validators' gate accepted)."""
    out: dict[int, bytes] = {}
    for _, a in trainer_announcements(genesis, raws):
        out.setdefault(a.version, a.manifest_id)
    return out


@dataclass(frozen=True)
class AuditRow:
    subject: str
    check: str
    ok: bool | None
    """True: agrees; False: disagrees; None: could not be checked (weights missing)."""
    detail: str


def policy_dir_source(directory: Path | None) -> PolicySource:
    """Weights of version v at ``DIR/v{v}.safetensors`` (version 0, when missing, replays on
    the run's model: ``AuditAssets.v0_from_model``)."""

    def find(version: int) -> Path | None:
        if directory is not None:
            candidate = directory / f"v{version}.safetensors"
            if candidate.exists():
                return candidate
        return None

    return find


class EvidenceLookup:
    """Signed envelopes by id: the evidence store first, then the ledger's verdicts table."""

    def __init__(self, store: LedgerStore, evidence: EvidenceStore | None) -> None:
        self.store = store
        self.evidence = evidence

    def raw(self, object_id: bytes) -> bytes | None:
        held = None if self.evidence is None else self.evidence.get(object_id)
        return held if held is not None else self.store.verdict_raw(object_id)

    def summary(self, object_id: bytes) -> Summary | None:
        """What is left of evidence a budget dropped (None: held, or never known)."""
        return None if self.evidence is None else self.evidence.summary(object_id)

    def verdict(self, object_id: bytes) -> Signed[Verdict] | None:
        raw = self.raw(object_id)
        return None if raw is None else decode(raw, Verdict)

    def submission(self, object_id: bytes) -> Signed[RolloutSubmission] | None:
        raw = self.raw(object_id)
        return None if raw is None else decode(raw, RolloutSubmission)

    def announcements(self) -> Iterable[bytes]:
        """The policy announcements the evidence store holds (validators keep every one)."""
        return () if self.evidence is None else self.evidence.of_kind(PolicyAnnouncement.KIND)

    def related(self, verdict: Signed[Verdict]) -> list[Signed[RolloutSubmission]]:
        """The other submission an equivocation's verdict names (when held)."""
        other = verdict.message.metrics.get(OTHER_SUBMISSION)
        try:
            found = self.submission(bytes.fromhex(other)) if isinstance(other, str) else None
        except ValueError:
            return []
        return [] if found is None else [found]


@dataclass(frozen=True)
class AuditAssets:
    """Local copies of the run's model and data set (``--model``/``--tasks``), else the cache
    of ``home`` (default: the usual node home)."""

    model: Path | None = None
    tasks: Path | None = None
    home: Path | None = None
    v0_from_model: bool = True
    """Version 0 replays on the model's own weights (the card's file) when the policy source
    has none (False: only on what the source holds)."""

    def dirs(self) -> AssetDirs:
        return AssetDirs.under(resolve_home(self.home))


class _Engines:
    """One fp32 engine on the run's model, reloaded per version on demand; the run's tasks and
    the manifest ids of its versions (what a replay's ``JudgeContext`` needs)."""

    def __init__(
        self,
        source: PolicySource,
        genesis: RunGenesis,
        assets: AuditAssets | None = None,
        manifests: ManifestSource = no_manifests,
    ) -> None:
        self.source = source
        self.genesis = genesis
        self.assets = assets or AuditAssets()
        self.manifests = manifests
        self._engine: TorchEngine | None = None
        self._version: int | None = None
        self._model_dir: Path | None = None
        self._suite: TaskSource | None = None
        if self.assets.model is not None:
            self.model_dir()  # a --model that differs from the card is an error, not a row

    def model_dir(self) -> Path:
        if self._model_dir is None:
            card = self.genesis.model
            found = local_model(card, self.assets.model, self.assets.dirs())
            if found is None:
                raise ConfigError(
                    f"the run's model {card.name} (card {card.card_id()}) is not in"
                    f" {self.assets.dirs().model(card)}; pass --model DIR with a copy of it,"
                    " or join the run once so the home caches it"
                )
            self._model_dir = found
        return self._model_dir

    def suite(self) -> TaskSource:
        if self._suite is None:
            dirs = self.assets.dirs()
            data = local_data_set(self.genesis, self.assets.tasks, dirs)
            self._suite = suite_for(self.genesis, data, cache=dirs.data)
        return self._suite

    def get(self, version: int) -> TorchEngine:
        card = self.genesis.model
        path = self.source(version)
        if path is None and version == 0 and self.assets.v0_from_model:
            # Version 0 is the model's own weights: the card's file, the model directory of a
            # sharded card (its index names the shards), or (a genesis from before cards) the
            # model directory's model.safetensors.
            name = card.weights.name if card.weights is not None else "model.safetensors"
            path = self.model_dir() if card.sharded else self.model_dir() / name
        if path is None:
            raise ConfigError(
                f"weights of policy version {version} not found; pass --policy-dir with"
                f" v{version}.safetensors (or fetch it with `swarm-node shardcast fetch`)"
            )
        if self._engine is None:
            self._engine = TorchEngine.from_dir(
                self.model_dir(), dtype="float32", chat_template=chat_template_wanted(self.genesis)
            )
        if self._version != version:
            self._engine.load_weights(str(path))
            self._version = version
        return self._engine


def _context(genesis: Signed[RunGenesis], engines: _Engines, version: int) -> JudgeContext:
    """The replay's context: the submission's own version as the newest, a ledger where nobody
    is banned, and the version's manifest id (``ConfigError`` when a run with a quota needs it
    and it is not known)."""
    g = genesis.message
    manifests: dict[int, bytes] = {}
    if g.params.quota:
        manifest_id = engines.manifests(version)
        if manifest_id is None:
            raise ConfigError(
                f"the manifest id of policy v{version} is not known (the assignment mixes it):"
                " audit with the evidence store that holds the validators' announcements"
                " (evidence.db beside the ledger), or from the swarm (--run --bootstrap)"
            )
        manifests[version] = manifest_id
    return JudgeContext(
        run_id_of(genesis), g.params, engines.suite(), version, fold([], g.params), manifests
    )


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
    if EQUIVOCATION in verdict.message.reasons:
        both = any(equivocation(submission, r) is not None for r in related)
        detail = (
            "two different signed submissions of one assignment"
            if both
            else "the other submission of the equivocation is missing or not a copy"
        )
        return AuditRow(subject, "equivocation", both, detail)
    s = submission.message
    seen = any(
        r.id != submission.id
        and r.signer == submission.signer
        and (r.message.policy_version, r.message.counter) == (s.policy_version, s.counter)
        for r in related
    )
    try:
        ctx = _context(genesis, engines, s.policy_version)
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


def sample_credits(
    events: Sequence[Signed[LedgerEvent]], counted: Collection[bytes], n: int | None
) -> list[Signed[LedgerEvent]]:
    """The counted credits an audit replays: all (``n`` None) or a draw of ``n`` seeded by
    nothing but the event set, so an auditor that gathers evidence for a sample
    (``node.audit_swarm``) and the replay draw the same ones."""
    credits = sorted(
        (e for e in events if e.message.event == "credit" and e.id in counted), key=lambda e: e.id
    )
    if n is None or n >= len(credits):
        return credits
    return random.Random(0).sample(credits, n)


def audit_ledger(
    path: Path,
    source: PolicySource,
    *,
    credits: int | None = None,
    evidence: EvidenceStore | None = None,
    assets: AuditAssets | None = None,
    manifests: ManifestSource = no_manifests,
) -> list[AuditRow]:
    """Every check of the module docstring. Counted credits are re-judged too (the validator's
    accepted work must replay to an accept with the same rewards): all of them by default, a
    random sample of ``credits`` of them (0: none) when a full replay would take too long.
    ``evidence``: default, the store next to the ledger when there is one. ``manifests``: the
    manifest ids of policy versions, asked before the evidence store's announcements."""
    store = LedgerStore.open_existing(path)
    opened = None
    if evidence is None and path.with_name("evidence.db").exists():
        evidence = opened = EvidenceStore.beside(path)
    lookup = EvidenceLookup(store, evidence)
    genesis = store.genesis
    rows: list[AuditRow] = []
    checked = recheck(store)
    for why in checked.refused:
        rows.append(AuditRow("event", "signature and rules", False, why))
    events = checked.events
    rows.append(AuditRow("events", "signature and rules", True, f"{len(events)} events verified"))
    ok = not checked.balance_errors
    rows.append(
        AuditRow(
            "balances",
            "fold",
            ok,
            f"{len(checked.balances.by_peer) if checked.balances else 0} balances agree"
            if ok
            else "stored balances differ from the fold: " + "; ".join(checked.balance_errors[:5]),
        )
    )
    announced = announced_manifests(genesis, lookup.announcements())

    def manifest_of(version: int) -> bytes | None:
        return manifests(version) or announced.get(version)

    engines = _Engines(source, genesis.message, assets, manifest_of)
    for dispute in (e for e in events if e.message.event == "dispute"):
        rows.append(_settle_dispute(lookup, genesis, dispute, engines))
    counted = [e for e in events if e.id in checked.counted]
    chosen = sample_credits(events, checked.counted, credits)
    if credits is not None:
        rows.append(
            AuditRow("credits", "sample", True, f"replaying {len(chosen)} of the counted credits")
        )
    slashes = [e for e in counted if e.message.event == "slash"]
    for event in [*slashes, *sorted(chosen, key=lambda e: e.message.created_at)]:
        rows.append(_replay_from_store(lookup, genesis, event, engines))
    rows += audit_evaluations(path, genesis, engines)
    store.close()
    if opened is not None:
        opened.close()
    return rows


def audit_evaluations(
    ledger: Path, genesis: Signed[RunGenesis], engines: _Engines
) -> list[AuditRow]:
    """One row per held-out evaluation stored beside ``ledger`` (``evaluations.db``; none when
    absent): its signer and cadence, its items (the genesis's split) and seed, and one item,
    drawn by the record's id, regenerated alone on the version's weights; ok when it scores
    what the record says."""
    if not ledger.with_name(EvaluationStore.FILE).exists():
        return []
    store = EvaluationStore.beside(ledger, read_only=True)
    try:
        records = store.records()
    finally:
        store.close()
    return [_replay_evaluation(genesis, record, engines) for record in records]


def _replay_evaluation(
    genesis: Signed[RunGenesis], record: Signed[Evaluation], engines: _Engines
) -> AuditRow:
    e = record.message
    subject = f"evaluation v{e.version}"
    g = genesis.message
    run_id = run_id_of(genesis)
    if not eval_due(e.version, g.params.eval_every):
        return AuditRow(subject, "evaluation", False, "version not due at the run's cadence")
    due = eval_validator(run_id, e.version, g.validators)
    if record.signer != due or e.run_id != run_id:
        return AuditRow(subject, "evaluation", False, f"not signed by its due validator {due}")
    if e.seed != eval_seed(run_id, e.version):
        return AuditRow(subject, "evaluation", False, f"seed {e.seed} is not the version's seed")
    try:
        source = engines.suite()
        if list(e.item_ids) != eval_ids(g, source):
            return AuditRow(subject, "evaluation", False, "items are not the held-out split")
        engine = engines.get(e.version)
    except ConfigError as exc:
        return AuditRow(subject, "evaluation replay", None, f"cannot replay: {exc}")
    at = random.Random(record.id).randrange(len(e.item_ids))
    item = e.item_ids[at]
    try:
        mine = replay_item(engine, source, item, g.params, e.seed)
    except SwarmError as exc:
        return AuditRow(subject, "evaluation replay", False, f"item {item}: cannot replay: {exc}")
    theirs = e.scores[at]
    detail = (
        f"item {item}: signed {theirs / REWARD_SCALE:.3f}, replayed {mine / REWARD_SCALE:.3f};"
        f" mean {e.mean_score:.3f} over {len(e.item_ids)} items"
    )
    return AuditRow(subject, "evaluation replay", mine == theirs, detail)


def _replay_from_store(
    lookup: EvidenceLookup,
    genesis: Signed[RunGenesis],
    event: Signed[LedgerEvent],
    engines: _Engines,
) -> AuditRow:
    cited = event.message.evidence  # the verdict's id (the contract in swarm.ledger)
    try:
        verdict = lookup.verdict(cited)
        if verdict is None:
            return _missing(lookup, cited, "the cited verdict is missing")
        subject = verdict.message.submission_id
        submission = lookup.submission(subject)
        related = [r for r in map(lookup.submission, event.message.related) if r is not None]
    except SwarmError as exc:
        return AuditRow(cited.hex()[:16], "evidence", False, f"bad evidence: {exc}")
    if submission is None:
        return _missing(lookup, subject, "the submission is missing")
    dropped = [i for i in event.message.related if lookup.summary(i) is not None]
    if dropped:
        return _missing(lookup, dropped[0], "")
    if submission.signer != event.message.peer:
        return AuditRow(subject.hex()[:16], "evidence", False, "the event's peer did not sign")
    if event.message.event == "credit":
        if not verdict.message.accepted:
            return AuditRow(subject.hex()[:16], "credit evidence", False, "verdict did not accept")
        return _replay_accept(genesis, submission, verdict, engines)
    return replay_slash(genesis, submission, verdict, related, engines)


def _missing(lookup: EvidenceLookup, object_id: bytes, why: str) -> AuditRow:
    """A failed row for missing evidence, or an unchecked one naming what a budget summarized."""
    summary = lookup.summary(object_id)
    if summary is None:
        return AuditRow(object_id.hex()[:16], "evidence", False, why)
    return AuditRow(object_id.hex()[:16], "evidence summarized", None, summary.describe())


def _settle_dispute(
    lookup: EvidenceLookup,
    genesis: Signed[RunGenesis],
    dispute: Signed[LedgerEvent],
    engines: _Engines,
) -> AuditRow:
    """Replay the disputed submission: the dispute is upheld (row ok) when the auditor rejects
    the work the disputed verdict accepted."""
    subject = dispute.id.hex()[:16]
    try:
        verdict = lookup.verdict(dispute.message.related[0])
        submission = None if verdict is None else lookup.submission(verdict.message.submission_id)
    except SwarmError as exc:
        return AuditRow(subject, "dispute", False, f"bad evidence: {exc}")
    if verdict is None:
        return AuditRow(subject, "dispute", False, "the disputed verdict is missing")
    if submission is None:
        return AuditRow(subject, "dispute", None, "the disputed submission is not held here")
    row = _replay_accept(genesis, submission, verdict, engines)
    if row.ok is None:
        return AuditRow(subject, "dispute", None, row.detail)
    upheld = row.ok is False
    who = dispute.message.peer[-12:]
    detail = (
        f"upheld: {who} credited work the replay rejects" if upheld else f"overruled: {row.detail}"
    )
    return AuditRow(subject, "dispute", upheld, detail)


def ledger_manifests(ledger: Path) -> ManifestSource:
    """The manifest ids of the announcements kept in the evidence store beside ``ledger``."""
    store = LedgerStore.open_existing(ledger)
    genesis = store.genesis
    store.close()
    if not ledger.with_name("evidence.db").exists():
        return no_manifests
    evidence = EvidenceStore.beside(ledger)
    try:
        return announced_manifests(genesis, evidence.of_kind(PolicyAnnouncement.KIND)).get
    finally:
        evidence.close()


def export_bundle(ledger: Path, submission_id: bytes, out: Path) -> None:
    """Write the self-contained proof bundle of one judged submission, with the announcement of
    its policy version when the evidence store beside ``ledger`` holds it (a run with a quota:
    ``node.bundle.policy_of``), so that ``audit BUNDLE`` replays it without ``--db``."""
    store = LedgerStore.open_existing(ledger)
    evidence = EvidenceStore.beside(ledger) if ledger.with_name("evidence.db").exists() else None
    lookup = EvidenceLookup(store, evidence)
    submission = lookup.submission(submission_id)
    # A one-off command may scan the verdicts: the newest one about this submission.
    verdict = next(
        (
            v
            for v in reversed([decode(raw, Verdict) for raw in store.raw_verdicts()])
            if v.message.submission_id == submission_id
        ),
        None,
    )
    if submission is None or verdict is None:
        raise ConfigError(f"no evidence for submission {submission_id.hex()} in {ledger}")
    related_raw = [r.raw for r in lookup.related(verdict)]
    policy = policy_of(store.genesis, submission.message.policy_version, lookup.announcements())
    data = pack_bundle(store.genesis.raw, submission.raw, verdict.raw, related_raw, policy)
    store.close()
    if evidence is not None:
        evidence.close()
    out.write_bytes(data)


def audit_bundle(
    path: Path,
    source: PolicySource,
    assets: AuditAssets | None = None,
    *,
    manifests: ManifestSource = no_manifests,
) -> list[AuditRow]:
    """Replay one proof bundle. The manifest id of its version (a run with a quota) comes from
    the announcements the bundle holds (``policy``), else from ``manifests`` (``audit BUNDLE
    --db LEDGER_DB``: the evidence store beside that ledger)."""
    try:
        bundle = msgpack.unpackb(path.read_bytes(), raw=False)
        if not isinstance(bundle, dict) or bundle.get("format") != BUNDLE_FORMAT:
            raise MalformedError("not a proof bundle")
        genesis = decode(bundle["genesis"], RunGenesis)
        submission = decode(bundle["submission"], RolloutSubmission)
        verdict = decode(bundle["verdict"], Verdict)
        related = [decode(r, RolloutSubmission) for r in bundle.get("related", [])]
        policy = bundle.get("policy", [])
        if not isinstance(policy, list) or not all(isinstance(r, bytes) for r in policy):
            raise TypeError("its policy entry is not a list of signed announcements")
    except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise ConfigError(f"{path} is not a readable proof bundle: {exc}") from exc
    announced = announced_manifests(genesis, policy)

    def manifest_of(version: int) -> bytes | None:
        return announced.get(version) or manifests(version)

    engines = _Engines(source, genesis.message, assets, manifest_of)
    if verdict.message.accepted:
        row = _replay_accept(genesis, submission, verdict, engines)
    else:
        row = replay_slash(genesis, submission, verdict, related, engines)
    return [row]


def _replay_accept(
    genesis: Signed[RunGenesis],
    submission: Signed[RolloutSubmission],
    verdict: Signed[Verdict],
    engines: _Engines,
) -> AuditRow:
    s = submission.message
    try:
        ctx = _context(genesis, engines, s.policy_version)
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

"""The validator's judgement of one RolloutSubmission, cheapest checks first.

1. run id; 2. signer not banned; 3. policy version inside the async window; 4. request counter
inside the run's quota (``swarm.assignment.within_quota``) and not seen before; 5. prompts,
seed and sample layout equal the assignment (which, in a run with a quota, mixes the version's
manifest id: ``JudgeContext.manifests``), and the termination fields that need no tokenizer
(token count, ``length`` rule, proof count and size); 6. EOS
termination, sampling and TOPLOC by prefill on that version (``node.verify``), staged: first a
slice of ``SLICE_SAMPLES`` samples picked by the submission's id (``slice_of``), where a hard
failure ends the judgement; else the rest. Honest work costs one check of every sample as
before, well-formed garbage the slice's (issue 15: cheap before dear); a submission with bad
samples outside the slice is still checked whole and caught. Rewards come from
the task verifier here, never from the worker. ``precheck`` is 1-5 (no model); ``judge`` runs it
unless the caller did (``prechecked=True``), then 6. ``equivocation`` judges two signed
submissions of one assignment (no model either). Each precheck judgement names its ``check``:
the validator refuses such work before it claims, stores or prefills anything (issue 15: cheap
before dear), and counts refusals by check.

``decide`` is the validator's one call: every stage in order, the precheck, then (let in by the
``Desk``: the judge lock) the assignment's claims shared by the validators, then the model. The
``Desk`` is the validator's I/O (its claim book, the evidence protocol, the engine), so the
order of the checks lives here alone and the validator only fetches, locks and records.

Severity follows the design: ``hard`` (slash) for what only a cheater produces (replays,
unassigned prompts or seeds, wrong tokens, false finishes, proofs far outside the thresholds);
``soft`` (reject, no slash) for what honest nodes can cause (a version that fell out of the window
while in flight, proofs just past a threshold; a version whose manifest id this validator does
not know, check ``manifest``); ``none`` for accepted work and for refusals that need no judgement
(another run, a banned signer).

A counter at or above the quota (check ``quota``) is ``hard``: honest software never signs one
(the worker stops at ``quota - 1`` and waits for the next version), so the worker's own signature
over it is the whole proof, as for an equivocation. At the validator's door it is a refusal like
every precheck's (nothing claimed, stored, prefilled or slashed: grinding costs the grinder its
time and earns nothing); the severity speaks where a judgement is recorded: a validator that
credited such work is disputed on re-judge (``Validator.rejudge``), and the audit replays it as
a hard rejection.

The result is a plain description; the caller signs the Verdict and the ledger events.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from node.compute.engine import Engine
from node.rl.rollout import sample_index, score_samples
from node.roles.claims import Claim
from node.run import TaskSource
from node.verify import SampleClaim, SampleVerdict, submission_tolerated, verify_samples
from swarm.assignment import assign, assignment_key, quota_refusal
from swarm.errors import ConfigError
from swarm.ledger import EQUIVOCATION, Balances
from swarm.messages import REWARD_SCALE, RolloutSubmission, RunParams, Signed, Verdict
from swarm.toploc import CHUNK_SIZE, ProofCheck, ProofThresholds, proof_size

OTHER_SUBMISSION = "other_submission"
"""The metric (hex id) by which an equivocation's Verdict names the other submission."""


@dataclass(frozen=True)
class Judgement:
    accepted: bool
    severity: str
    reasons: list[str]
    rewards: list[float] = field(default_factory=list)
    metrics: dict[str, int | str] = field(default_factory=dict)
    check: str = "model"
    """Which check decided (``run``, ``ban``, ``window``, ``quota``, ``manifest``,
    ``assignment``, ``layout``, ``seed``, ``termination``, ``claim``, ``claims``, ``model``):
    the validator counts refusals by it; not part of the Verdict."""
    refused: bool = False
    """Not judged: the validator refuses the submission at its door (nothing claimed, stored or
    slashed there). A re-judge of work another validator credited records a hard one."""
    related: tuple[Signed[RolloutSubmission], ...] = ()
    """Other signed submissions the verdict rests on (an equivocation's other one): stored
    with it as evidence."""

    def verdict(self, submission: Signed[RolloutSubmission], created_at: int) -> Verdict:
        return Verdict(
            run_id=submission.message.run_id,
            submission_id=submission.id,
            worker=submission.signer,
            accepted=self.accepted,
            severity=self.severity,  # type: ignore[arg-type]
            reasons=tuple(self.reasons),
            rewards=tuple(round(r * REWARD_SCALE) for r in self.rewards),
            created_at=created_at,
            metrics=self.metrics,
            policy_version=submission.message.policy_version,
            counter=submission.message.counter,
        )


def _reject(severity: str, *reasons: str, **metrics: int | str) -> Judgement:
    return Judgement(False, severity, list(reasons), metrics=dict(metrics))


def _refuse(check: str, severity: str, *reasons: str, **metrics: int | str) -> Judgement:
    return Judgement(
        False, severity, list(reasons), metrics=dict(metrics), check=check, refused=True
    )


@dataclass
class JudgeContext:
    """What a validator knows when it judges: the run, its newest version, the ledger, and the
    manifest id of the versions it knows."""

    run_id: str
    params: RunParams
    suite: TaskSource
    newest_version: int
    balances: Balances
    manifests: Mapping[int, bytes] = field(default_factory=dict)
    """Policy version -> its manifest id (the trainer's signed SHARDCAST manifest), for the
    versions of the window; the assignment of a run with a quota mixes it. A legacy run
    (``quota == 0``) needs none."""


def precheck(
    submission: Signed[RolloutSubmission], ctx: JudgeContext, *, counter_seen: bool
) -> Judgement | None:
    """Checks that need no model; a Judgement when they already decide, else None."""
    s = submission.message
    p = ctx.params
    if s.run_id != ctx.run_id:
        return _refuse("run", "none", f"submission for run {s.run_id[:32]!r}, not {ctx.run_id}")
    if ctx.balances.banned(submission.signer):
        return _refuse("ban", "none", f"worker {submission.signer} is banned")
    oldest = ctx.newest_version - p.async_level
    if not oldest <= s.policy_version <= ctx.newest_version:
        return _refuse(
            "window",
            "soft",
            f"policy version {s.policy_version} outside the window {oldest}..{ctx.newest_version}",
            policy_version=s.policy_version,
            newest_version=ctx.newest_version,
        )
    beyond = quota_refusal(s.counter, p.quota)
    if beyond is not None:
        return _refuse("quota", "hard", beyond, counter=s.counter, quota=p.quota)
    if counter_seen:
        return _reject("hard", f"replay: request {s.counter} of version {s.policy_version} seen")
    manifest_id = ctx.manifests.get(s.policy_version)
    if p.quota and manifest_id is None:
        return _refuse(
            "manifest",
            "soft",
            f"the manifest of policy v{s.policy_version} is not known to this validator (the"
            " assignment mixes it); retry later or send to another validator",
            policy_version=s.policy_version,
        )
    try:
        expected = assign(
            s.run_id,
            s.policy_version,
            submission.signer,
            s.counter,
            n_prompts=p.batch_prompts,
            suite_size=ctx.suite.size,
            excluded=ctx.suite.excluded,
            manifest_id=assignment_key(p.quota, manifest_id),
        )
    except ConfigError as exc:
        return _refuse("assignment", "soft", f"cannot derive the assignment: {exc}")
    wanted = [str(i) for i in expected.prompt_ids]
    if list(s.prompt_ids) != wanted:
        return _refuse(
            "assignment", "hard", "prompts differ from the assignment", assigned=",".join(wanted)
        )
    g = p.group_size
    if len(s.samples) != len(wanted) * g:
        return _refuse("layout", "hard", f"{len(s.samples)} samples, expected {len(wanted) * g}")
    for j, sample in enumerate(s.samples):
        if sample.prompt_id != wanted[j // g]:
            return _refuse(
                "assignment",
                "hard",
                f"sample {j} answers prompt {sample.prompt_id!r}, not assigned",
            )
        if sample.seed != expected.seed:
            return _refuse(
                "seed", "hard", f"sample {j} uses seed {sample.seed}, not the assigned seed"
            )
        why = _termination_fields(sample.tokens, sample.finish_reason, sample.proofs, p.max_tokens)
        if why is not None:
            return _refuse("termination", "hard", f"sample {j}: {why}")
    return None


def _termination_fields(
    tokens: tuple[int, ...], finish_reason: str, proofs: tuple[bytes, ...], max_tokens: int
) -> str | None:
    """What the termination and proof fields show without the model (the EOS checks need the
    tokenizer, in the engine child): token count, the ``length`` rule, one proof of at most
    ``proof_size()`` bytes per started chunk of ``CHUNK_SIZE`` tokens."""
    n = len(tokens)
    if n > max_tokens:
        return f"{n} tokens exceed max_tokens={max_tokens}"
    if finish_reason == "length" and n != max_tokens:
        return f"finish reason 'length' with {n} tokens, not max_tokens={max_tokens}"
    chunks = -(-n // CHUNK_SIZE)
    if len(proofs) != chunks:
        return f"{len(proofs)} proofs for {chunks} chunks of {CHUNK_SIZE} tokens"
    if any(len(proof) > proof_size() for proof in proofs):
        return f"a proof longer than {proof_size()} bytes"
    return None


def equivocation(
    submission: Signed[RolloutSubmission], other: Signed[RolloutSubmission]
) -> Judgement | None:
    """The hard Judgement of an equivocation when ``other`` is a different signed submission
    of the same assignment (worker, run, policy version, counter), else None. Needs no model:
    two signatures over two payloads for one assignment are the whole proof."""
    s, o = submission.message, other.message
    if (
        other.id == submission.id
        or other.signer != submission.signer
        or (o.run_id, o.policy_version, o.counter) != (s.run_id, s.policy_version, s.counter)
    ):
        return None
    return Judgement(
        False,
        "hard",
        [
            EQUIVOCATION,
            f"request {s.counter} of policy v{s.policy_version} was also signed as submission"
            f" {other.id.hex()[:16]}",
        ],
        metrics={OTHER_SUBMISSION: other.id.hex()},
        check="claims",
        related=(other,),
    )


def tie_tolerance(params: RunParams, worker_dtype: str, validator_dtype: str) -> float:
    """The sampling check's tolerance for this pair of precisions: ``tie_tol_fp32`` where the
    worker declared float32 and the validator runs float32, else ``tie_tol_bf16`` (either side
    bf16, or a submission that declares nothing, as before issue 24)."""
    if worker_dtype == "float32" and validator_dtype == "float32":
        return params.tie_tol_fp32
    return params.tie_tol_bf16


TOLERATED_LISTED = 256
"""Tolerated positions a verdict lists at most (the count is always whole)."""


def tolerated_metrics(results: list[SampleVerdict]) -> dict[str, int | str]:
    """What a verdict records of the tolerated near ties: their count and, per sample that has
    any, ``sample:pos,pos`` joined by ``;`` (``tolerated_at``), at most TOLERATED_LISTED."""
    listed: list[str] = []
    left = TOLERATED_LISTED
    total = 0
    for j, r in enumerate(results):
        if r.sampling is None or not r.sampling.tolerated_at:
            continue
        total += r.sampling.tolerated
        at = r.sampling.tolerated_at[: max(left, 0)]
        left -= len(at)
        if at:
            listed.append(f"{j}:{','.join(str(t) for t in at)}")
    return {"tolerated": total, "tolerated_at": ";".join(listed)} if total else {"tolerated": 0}


SLICE_SAMPLES = 8
"""Samples of a submission checked first (``slice_of``); a hard failure among them decides."""


def slice_of(submission_id: bytes, n: int, k: int = SLICE_SAMPLES) -> list[int]:
    """The ``k`` sample indices (of ``n``, ascending) checked first: those whose hash with the
    submission's id is smallest. The validator's rule picks them, not the worker (which cannot
    know them before it signs: the id is the hash of its signed envelope), and every replay
    picks the same: an auditor re-judging the verdict checks the same slice."""
    if n <= k:
        return list(range(n))

    def rank(j: int) -> bytes:
        return hashlib.sha256(submission_id + j.to_bytes(4, "big")).digest()

    return sorted(sorted(range(n), key=rank)[:k])


SUBMISSION_HARD_FACTOR = 1.25
"""A submission's mean mantissa error past this multiple of the run's limit is a hard failure
(other weights); between the limit and this it is soft (honest hardware near the edge)."""


def _submission_proof_check(
    checks: list[ProofCheck], limit: float, metrics: dict[str, int | str]
) -> Judgement | None:
    if limit <= 0 or not checks:
        return None
    mean = sum(c.mant_err_mean for c in checks) / len(checks)
    metrics["submission_mant_err_mean"] = f"{mean:.4g}"
    if mean <= limit:
        return None
    severity = "hard" if mean > limit * SUBMISSION_HARD_FACTOR else "soft"
    why = (
        f"submission: mean mantissa error {mean:.3g} over {len(checks)} proof chunks exceeds"
        f" {limit:g} (the work was not made with this policy's weights)"
    )
    return Judgement(False, severity, [why], metrics=metrics)


def _slice_rejection(checked: list[tuple[int, SampleVerdict]]) -> Judgement:
    """The hard Judgement of a slice with a hard failure; ``slice`` in its metrics names the
    samples checked (the rest were not needed to decide)."""
    failed = [(j, r) for j, r in checked if not r.ok]
    checks = [c for _, r in checked for c in r.proofs]
    metrics: dict[str, int | str] = {
        "samples": len(checked),
        "slice": ",".join(str(j) for j, _ in checked),
        "failed_samples": len(failed),
        "proof_chunks": len(checks),
        "max_exp_mismatches": max((c.exp_mismatches for c in checks), default=0),
        "max_mant_err_mean": f"{max((c.mant_err_mean for c in checks), default=0.0):.4g}",
    }
    reasons = [f"sample {j}: {why}" for j, r in failed if r.hard for why in r.reasons[:2]]
    return Judgement(False, "hard", reasons[:16], metrics=metrics)


def judge(
    submission: Signed[RolloutSubmission],
    ctx: JudgeContext,
    engine: Engine,
    *,
    counter_seen: bool,
    prechecked: bool = False,
) -> Judgement:
    """Judge ``submission``; ``engine`` must hold its policy version's weights.

    ``prechecked``: the caller ran ``precheck`` already (and it decided nothing), so the
    submission passes each check once; auditors and tests leave it False.
    """
    if not prechecked:
        early = precheck(submission, ctx, counter_seen=counter_seen)
        if early is not None:
            return early
    s = submission.message
    p = ctx.params
    g = p.group_size
    vocab = engine.info.vocab_size
    for j, sample in enumerate(s.samples):
        # Before any prefill: a token id the model has no embedding for would crash it (an
        # IndexError, or a dead engine child), and anyone can sign such a sample (issue 15).
        outside = next((t for t in sample.tokens if not 0 <= t < vocab), None)
        if outside is not None:
            return _reject(
                "hard", f"sample {j}: token id {outside} outside the vocabulary ({vocab})"
            )
    prompt_ids = [int(i) for i in s.prompt_ids]
    prompts = engine.encode_prompts([ctx.suite.task(i).prompt for i in prompt_ids])
    claims = [
        SampleClaim(
            prompt=prompts[j // g],
            tokens=list(sample.tokens),
            seed=sample.seed,
            sample_index=sample_index(j // g, j % g, g),
            finish_reason=sample.finish_reason,
            proofs=list(sample.proofs),
        )
        for j, sample in enumerate(s.samples)
    ]
    thresholds = ProofThresholds(
        p.toploc_max_exp_mismatches, p.toploc_max_mant_mean, p.toploc_max_mant_median
    )

    tolerance = tie_tolerance(p, s.dtype, engine.info.dtype)

    def verify(indices: list[int]) -> list[SampleVerdict]:
        return verify_samples(
            engine,
            [claims[j] for j in indices],
            temperature=p.temperature,
            max_tokens=p.max_tokens,
            thresholds=thresholds,
            tie_tolerance=tolerance,
            sampler=p.sampler,
            max_tolerated_per_1k=p.max_tolerated_per_1k,
        )

    picked = slice_of(submission.id, len(claims))
    rest = sorted(set(range(len(claims))) - set(picked))
    first = verify(picked)
    if rest and any(not r.ok and r.hard for r in first):
        # A hard failure in the slice: the judgement ends here, at the slice's cost.
        return _slice_rejection(list(zip(picked, first, strict=True)))
    by_index = dict(zip(picked, first, strict=True))
    if rest:
        by_index |= dict(zip(rest, verify(rest), strict=True))
    results = [by_index[j] for j in range(len(claims))]
    failed = [(j, r) for j, r in enumerate(results) if not r.ok]
    checks = [c for r in results for c in r.proofs]
    metrics: dict[str, int | str] = {
        "samples": len(results),
        "failed_samples": len(failed),
        "proof_chunks": len(checks),
        "max_exp_mismatches": max((c.exp_mismatches for c in checks), default=0),
        "max_mant_err_mean": f"{max((c.mant_err_mean for c in checks), default=0.0):.4g}",
        "near_ties": sum(r.sampling.near_ties for r in results if r.sampling is not None),
        "tie_tolerance": f"{tolerance:g}",
        **tolerated_metrics(results),
    }
    over = submission_tolerated(results, p.max_tolerated_per_1k)
    if over is not None and not failed:
        hard, why = over
        return Judgement(False, "hard" if hard else "soft", [why], metrics=metrics)
    aggregate = _submission_proof_check(checks, p.toploc_max_submission_mant_mean, metrics)
    if aggregate is not None and not failed:
        return aggregate
    if failed:
        hard = any(r.hard for _, r in failed)
        reasons = [f"sample {j}: {why}" for j, r in failed[:8] for why in r.reasons[:2]]
        return Judgement(False, "hard" if hard else "soft", reasons, metrics=metrics)
    rewards = score_samples(
        engine,
        ctx.suite,
        [prompt_ids[j // g] for j in range(len(s.samples))],
        [list(x.tokens) for x in s.samples],
        p,
    )
    metrics["mean_reward_micro"] = round(sum(rewards) / len(rewards) * REWARD_SCALE)
    return Judgement(True, "none", [], rewards, metrics)


class Desk(Protocol):
    """The I/O around one judgement (``decide``): what the validator holds and fetches."""

    @property
    def me(self) -> str:
        """This validator's peer id."""
        ...

    async def admit(self) -> None:
        """Let the submission in to the dear stages (the claims, the model): called once the
        precheck passed. Takes the judge lock, held until the caller has recorded the
        judgement; raises to refuse (a newcomer past its share, a validator that no longer
        judges)."""

    def claims(self, submission: Signed[RolloutSubmission]) -> list[Claim]:
        """The claims known here on the submission's assignment."""
        ...

    def claim(self, submission: Signed[RolloutSubmission]) -> None:
        """Claim the assignment for this validator, before the model judges it."""

    async def fetch(self, claim: Claim) -> Signed[Any] | None:
        """The envelope a claim names, from its validator (None when it is not served)."""

    async def on_engine(
        self, submission: Signed[RolloutSubmission], work: Callable[[Engine], Judgement]
    ) -> Judgement | None:
        """``work`` on an engine holding the submission's policy version, off the event loop;
        None when that version's weights are not held here."""


async def decide(
    submission: Signed[RolloutSubmission], ctx: JudgeContext, desk: Desk, *, claims: bool = True
) -> Judgement:
    """The whole judgement of ``submission``, cheapest stage first: the precheck (no lock, no
    model), then, once ``desk.admit()`` let it in, the assignment's claims (``claims=False``
    when re-judging work judged elsewhere, which claims nothing), then the model. A refused
    judgement (``Judgement.refused``) is the caller's to refuse, not to record."""
    early = precheck(submission, ctx, counter_seen=False)
    if early is not None:
        return early
    await desk.admit()
    if claims:
        decided = await _claims_stage(submission, desk)
        if decided is not None:
            return decided
        desk.claim(submission)

    def on(engine: Engine) -> Judgement:
        return judge(submission, ctx, engine, counter_seen=False, prechecked=True)

    judged = await desk.on_engine(submission, on)
    version = submission.message.policy_version
    return judged or _reject("soft", f"policy v{version} is not held here")


async def _claims_stage(submission: Signed[RolloutSubmission], desk: Desk) -> Judgement | None:
    """None when nobody else claimed the assignment; an equivocation's Judgement when another
    signed submission of it did; a refusal for a copy judged by another validator, and for an
    assignment claimed by a submission nobody serves (judged once, by whoever claimed it)."""
    s = submission.message
    where = f"request {s.counter} of policy v{s.policy_version}"
    known = desk.claims(submission)
    for claim in known:
        if claim.submission == submission.id and claim.validator != desk.me:
            return _refuse(
                "claim",
                "none",
                f"{where} was judged by validator {claim.validator}; it is not judged twice",
            )
    others = [c for c in known if c.submission != submission.id]
    for claim in others:
        other = await desk.fetch(claim)
        if other is None or not isinstance(other.message, RolloutSubmission):
            continue
        judgement = equivocation(submission, other)
        if judgement is not None:
            return judgement
    if others:
        return _refuse(
            "claim",
            "none",
            f"{where} is claimed by submission {others[0].submission.hex()[:16]}"
            f" (validator {others[0].validator[-8:]}); not judged",
        )
    return None

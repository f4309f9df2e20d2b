"""The validator's judgement of one RolloutSubmission, cheapest checks first.

1. run id; 2. signer not banned; 3. policy version inside the async window; 4. request counter
not seen before; 5. prompts, seed and sample layout equal the assignment; 6. termination,
sampling and TOPLOC by prefill on that version (``node.verify``). Rewards come from the task
verifier here, never from the worker.

Severity follows the design: ``hard`` (slash) for what only a cheater produces (replays,
unassigned prompts or seeds, wrong tokens, false finishes, proofs far outside the thresholds);
``soft`` (reject, no slash) for what honest nodes can cause (a version that fell out of the window
while in flight, proofs just past a threshold); ``none`` for accepted work and for refusals that
need no judgement (another run, a banned signer).

The result is a plain description; the caller signs the Verdict and the ledger events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from node.compute.engine import Engine
from node.compute.groups import Group
from node.model import tokenizer
from node.rl.rollout import sample_index, score
from node.tasks.suite import TaskSuite
from node.verify import SampleClaim, verify_samples
from swarm.assignment import assign
from swarm.errors import ConfigError
from swarm.ledger import Balances
from swarm.messages import REWARD_SCALE, RolloutSubmission, RunParams, Signed, Verdict
from swarm.toploc import ProofCheck, ProofThresholds


@dataclass(frozen=True)
class Judgement:
    accepted: bool
    severity: str
    reasons: list[str]
    rewards: list[float] = field(default_factory=list)
    metrics: dict[str, int | str] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    """Accepted samples as GRPO groups, for the trainer."""

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


@dataclass
class JudgeContext:
    """What a validator knows when it judges: the run, its newest version, the ledger."""

    run_id: str
    params: RunParams
    suite: TaskSuite
    newest_version: int
    balances: Balances


def precheck(
    submission: Signed[RolloutSubmission], ctx: JudgeContext, *, counter_seen: bool
) -> Judgement | None:
    """Checks that need no model; a Judgement when they already decide, else None."""
    s = submission.message
    p = ctx.params
    if s.run_id != ctx.run_id:
        return _reject("none", f"submission for run {s.run_id[:32]!r}, not {ctx.run_id}")
    if ctx.balances.banned(submission.signer):
        return _reject("none", f"worker {submission.signer} is banned")
    oldest = ctx.newest_version - p.async_level
    if not oldest <= s.policy_version <= ctx.newest_version:
        return _reject(
            "soft",
            f"policy version {s.policy_version} outside the window {oldest}..{ctx.newest_version}",
            policy_version=s.policy_version,
            newest_version=ctx.newest_version,
        )
    if counter_seen:
        return _reject("hard", f"replay: request {s.counter} of version {s.policy_version} seen")
    try:
        expected = assign(
            s.run_id,
            s.policy_version,
            submission.signer,
            s.counter,
            n_prompts=p.batch_prompts,
            suite_size=ctx.suite.size,
            excluded=ctx.suite.excluded,
        )
    except ConfigError as exc:
        return _reject("soft", f"cannot derive the assignment: {exc}")
    wanted = [str(i) for i in expected.prompt_ids]
    if list(s.prompt_ids) != wanted:
        return _reject("hard", "prompts differ from the assignment", assigned=",".join(wanted))
    g = p.group_size
    if len(s.samples) != len(wanted) * g:
        return _reject("hard", f"{len(s.samples)} samples, expected {len(wanted) * g}")
    for j, sample in enumerate(s.samples):
        if sample.prompt_id != wanted[j // g]:
            return _reject("hard", f"sample {j} answers prompt {sample.prompt_id!r}, not assigned")
        if sample.seed != expected.seed:
            return _reject("hard", f"sample {j} uses seed {sample.seed}, not the assigned seed")
    return None


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


def judge(
    submission: Signed[RolloutSubmission],
    ctx: JudgeContext,
    engine: Engine,
    *,
    counter_seen: bool,
) -> Judgement:
    """Judge ``submission``; ``engine`` must hold its policy version's weights."""
    early = precheck(submission, ctx, counter_seen=counter_seen)
    if early is not None:
        return early
    s = submission.message
    p = ctx.params
    g = p.group_size
    prompt_ids = [int(i) for i in s.prompt_ids]
    prompts = [tokenizer.encode(ctx.suite.task(i).prompt) for i in prompt_ids]
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
    results = verify_samples(
        engine, claims, temperature=p.temperature, max_tokens=p.max_tokens, thresholds=thresholds
    )
    failed = [(j, r) for j, r in enumerate(results) if not r.ok]
    checks = [c for r in results for c in r.proofs]
    metrics: dict[str, int | str] = {
        "samples": len(results),
        "failed_samples": len(failed),
        "proof_chunks": len(checks),
        "max_exp_mismatches": max((c.exp_mismatches for c in checks), default=0),
        "max_mant_err_mean": f"{max((c.mant_err_mean for c in checks), default=0.0):.4g}",
        "near_ties": sum(r.sampling.near_ties for r in results if r.sampling is not None),
    }
    aggregate = _submission_proof_check(checks, p.toploc_max_submission_mant_mean, metrics)
    if aggregate is not None and not failed:
        return aggregate
    if failed:
        hard = any(r.hard for _, r in failed)
        reasons = [f"sample {j}: {why}" for j, r in failed[:8] for why in r.reasons[:2]]
        return Judgement(False, "hard" if hard else "soft", reasons, metrics=metrics)
    rewards = [
        score(ctx.suite, prompt_ids[j // g], list(x.tokens), p) for j, x in enumerate(s.samples)
    ]
    groups = [
        Group(
            prompts[i],
            [list(x.tokens) for x in s.samples[i * g : (i + 1) * g]],
            rewards[i * g : (i + 1) * g],
            s.policy_version,
        )
        for i in range(len(prompts))
    ]
    metrics["mean_reward_micro"] = round(sum(rewards) / len(rewards) * REWARD_SCALE)
    return Judgement(True, "none", [], rewards, metrics, groups)

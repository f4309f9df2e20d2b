"""Validator-side checks of rollouts: termination, seeded sampling, and TOPLOC by prefill.

:func:`verify_samples` recomputes each sample with the validator's engine (one batched prefill)
and returns one :class:`SampleVerdict` per sample with the numbers that decided it:

1. termination (no model needed): ``"stop"`` must end with EOS and hold at most ``max_tokens``
   tokens; ``"length"`` exactly ``max_tokens``; no EOS before the last token.
2. sampling (:func:`swarm.sampling.check_sampling`): every token, the final EOS included, is the
   seeded Gumbel-max choice of the validator's logits, up to near-ties within the tolerance.
3. proofs (:func:`swarm.toploc.verify_proofs`): one proof per 32 tokens, checked against the
   validator's hidden states under the run's thresholds.

4. submission aggregate (optional, ``submission_mant_err_mean``): the mean of ``mant_err_mean``
   over every chunk of the submission. Per-chunk thresholds must leave room for honest precision
   noise, and on a tiny model a slightly different model (weights with 1% noise) stays inside
   them chunk by chunk; averaged over a submission the two separate cleanly. On the embedded
   default model honest mixed precision (bf16 <-> fp32) averages ~0.7 and 1%-noise weights
   ~1.65, hence :data:`DEFAULT_MODEL_SUBMISSION_MANT_ERR` = 1.2. Exceeding it rejects every
   sample of the submission (soft).

Severity: failures only a cheater produces are ``hard`` (slash): bad termination, a token that is
not the sampler's choice, malformed or missing proofs, proof errors beyond ``hard_factor`` times
a threshold. Proof errors between the threshold and that factor are ``soft`` (reject, no slash):
honest hardware near the thresholds can cause them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from node.compute.engine import Engine
from swarm.errors import ProofError
from swarm.sampling import DEFAULT_TIE_TOLERANCE, SamplingCheck, check_sampling
from swarm.toploc import CHUNK_SIZE, TOPK, ProofCheck, ProofThresholds, verify_proofs

DEFAULT_MODEL_SUBMISSION_MANT_ERR = 1.2
"""Submission-level bound on the mean mantissa error for the embedded default model (see above)."""


@dataclass(frozen=True)
class SampleClaim:
    """What a worker claims about one sample."""

    prompt: list[int]
    tokens: list[int]
    seed: int
    sample_index: int
    finish_reason: str
    proofs: list[bytes]


@dataclass(frozen=True)
class SampleVerdict:
    ok: bool
    hard: bool
    """True when the failure is one that only a cheater produces (slash)."""
    reasons: list[str] = field(default_factory=list)
    sampling: SamplingCheck | None = None
    proofs: list[ProofCheck] = field(default_factory=list)


def check_termination(
    tokens: list[int], finish_reason: str, max_tokens: int, eos_id: int
) -> str | None:
    """Why the claimed termination is impossible, or None when it is consistent."""
    n = len(tokens)
    if n == 0:
        return "no tokens"
    if n > max_tokens:
        return f"{n} tokens exceed max_tokens={max_tokens}"
    if eos_id in tokens[:-1]:
        return f"EOS at position {tokens.index(eos_id)} before the end"
    if finish_reason == "stop":
        if tokens[-1] != eos_id:
            return "finish reason 'stop' but the last token is not EOS"
    elif finish_reason == "length":
        if n != max_tokens:
            return f"finish reason 'length' with {n} tokens, not max_tokens={max_tokens}"
        if tokens[-1] == eos_id:
            return "finish reason 'length' but the last token is EOS"
    else:
        return f"unknown finish reason {finish_reason!r}"
    return None


def _proof_verdict(
    checks: list[ProofCheck], thresholds: ProofThresholds, hard_factor: float
) -> tuple[bool, bool, list[str]]:
    far = ProofThresholds(
        int(thresholds.max_exp_mismatches * hard_factor),
        thresholds.max_mant_err_mean * hard_factor,
        thresholds.max_mant_err_median * hard_factor,
    )
    reasons, hard = [], False
    for i, c in enumerate(checks):
        if not thresholds.passes(c):
            reasons.append(
                f"proof chunk {i}: exp_mismatches={c.exp_mismatches} "
                f"mant_err_mean={c.mant_err_mean:.3g} mant_err_median={c.mant_err_median:.3g}"
            )
            hard = hard or not far.passes(c)
    return not reasons, hard, reasons


def verify_samples(
    engine: Engine,
    claims: list[SampleClaim],
    *,
    temperature: float,
    max_tokens: int,
    thresholds: ProofThresholds | None = None,
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
    hard_factor: float = 2.0,
    submission_mant_err_mean: float | None = None,
    chunk_size: int = CHUNK_SIZE,
    topk: int = TOPK,
) -> list[SampleVerdict]:
    """Verify ``claims`` with ``engine`` (the policy version they claim); one verdict each."""
    thresholds = thresholds or ProofThresholds()
    eos = engine.info.eos_id
    verdicts: list[SampleVerdict | None] = [None] * len(claims)
    todo = []
    for i, c in enumerate(claims):
        why = check_termination(c.tokens, c.finish_reason, max_tokens, eos)
        if why is not None:
            verdicts[i] = SampleVerdict(False, True, [f"termination: {why}"])
        else:
            todo.append(i)
    prefills = engine.prefill_batch([(claims[i].prompt, claims[i].tokens) for i in todo])
    for i, pre in zip(todo, prefills, strict=True):
        c = claims[i]
        reasons: list[str] = []
        hard = False
        try:
            sampling = check_sampling(
                pre.logits,
                c.tokens,
                c.seed,
                temperature,
                sample=c.sample_index,
                tolerance=tie_tolerance,
            )
        except ProofError as exc:
            verdicts[i] = SampleVerdict(False, True, [f"sampling: {exc}"])
            continue
        if not sampling.ok:
            hard = True
            reasons.append(
                f"sampling: {sampling.mismatches} of {sampling.n_tokens} tokens are not the "
                f"seeded choice (first at {sampling.first_mismatch}, gap {sampling.max_gap:.3g})"
            )
        checks: list[ProofCheck] = []
        try:
            checks = verify_proofs(pre.hidden, list(c.proofs), chunk_size, topk)
        except ProofError as exc:
            hard = True
            reasons.append(f"proofs: {exc}")
        else:
            _, proof_hard, proof_reasons = _proof_verdict(checks, thresholds, hard_factor)
            hard = hard or proof_hard
            reasons.extend(proof_reasons)
        verdicts[i] = SampleVerdict(not reasons, hard and bool(reasons), reasons, sampling, checks)
    done = [v for v in verdicts if v is not None]
    if submission_mant_err_mean is not None:
        errs = [c.mant_err_mean for v in done if v.ok for c in v.proofs]
        mean = sum(errs) / len(errs) if errs else 0.0
        if mean > submission_mant_err_mean:
            why = (
                f"submission: mean mantissa error {mean:.3g} over {len(errs)} proof chunks "
                f"exceeds {submission_mant_err_mean:.3g} (a different model or weights)"
            )
            done = [replace(v, ok=False, reasons=[*v.reasons, why]) for v in done]
    return done

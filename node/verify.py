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

Where it runs (item 5 of issue 11): checks 1-3 are :func:`check_claims`, which
:meth:`Engine.verify <node.compute.engine.Engine.verify>` runs where the model is (the compute
child in a node), fed by the engine's :meth:`~node.compute.engine.Engine.prefill_stream`. The
sampling check walks each sample in chunks of positions whose logits take at most
``VerifySettings.chunk_bytes`` (default :data:`VERIFY_CHUNK_BYTES`, 256 MiB) including the
float64 work arrays of :func:`swarm.sampling.check_sampling` (:data:`BYTES_PER_LOGIT` = 56 bytes
per vocabulary entry and position); only the verdict numbers cross the pipe. Memory bound for a
150k vocabulary (Qwen2's 151,936) and a 64 x 1024-token submission: 256 MiB / (151,936 x 56 B)
= 31 positions per chunk, so the check holds <= 256 MiB of logits and work arrays at a time,
plus the bf16 hidden bits of the submission (64 x 1024 x hidden x 2 B: 117 MiB at hidden 896)
and one prefill micro-batch of the torch engine (``PREFILL_TOKENS`` = 8,192 tokens of
activations). Unchunked, the same submission's float32 logits alone are 64 x 1024 x 151,936 x
4 B = 37 GiB. ``tests/unit/test_verify_memory.py`` measures the peak with a 150k-vocabulary
fake prefill.

Severity: failures only a cheater produces are ``hard`` (slash): bad termination, a token that is
not the sampler's choice, malformed or missing proofs, proof errors beyond ``hard_factor`` times
a threshold. Proof errors between the threshold and that factor are ``soft`` (reject, no slash):
honest hardware near the thresholds can cause them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from node.compute.engine import Engine, PrefillStates
from swarm.errors import ProofError
from swarm.sampling import DEFAULT_TIE_TOLERANCE, SamplingCheck, check_sampling
from swarm.toploc import CHUNK_SIZE, TOPK, ProofCheck, ProofThresholds, verify_proofs

DEFAULT_MODEL_SUBMISSION_MANT_ERR = 1.2
"""Submission-level bound on the mean mantissa error for the embedded default model (see above)."""


VERIFY_CHUNK_BYTES = 256 * 1024 * 1024
"""Logits and sampling work arrays of one chunk of positions at most (see the docstring)."""
BYTES_PER_LOGIT = 56
"""float32 logits + float64 copy, Gumbel noise (drawn rows and their stack), scores, masked
scores and partition: 4 + 6 x 8 bytes per vocabulary entry and position."""


@dataclass(frozen=True)
class VerifySettings:
    """The run's verification parameters, sent with the claims to where the model is."""

    temperature: float
    max_tokens: int
    thresholds: ProofThresholds = field(default_factory=ProofThresholds)
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE
    hard_factor: float = 2.0
    chunk_size: int = CHUNK_SIZE
    topk: int = TOPK
    chunk_bytes: int = VERIFY_CHUNK_BYTES

    def rows_per_chunk(self, vocab: int) -> int:
        return max(1, self.chunk_bytes // (max(1, vocab) * BYTES_PER_LOGIT))

    def to_wire(self) -> dict[str, Any]:
        t = self.thresholds
        return {
            **{k: v for k, v in vars(self).items() if k != "thresholds"},
            "thresholds": [t.max_exp_mismatches, t.max_mant_err_mean, t.max_mant_err_median],
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> VerifySettings:
        e, mean, median = obj.pop("thresholds")
        return cls(thresholds=ProofThresholds(int(e), float(mean), float(median)), **obj)


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


def _check_sampling_chunked(
    states: PrefillStates, c: SampleClaim, settings: VerifySettings, rows: int
) -> SamplingCheck:
    """:func:`check_sampling` over ``rows`` positions at a time, merged into one result."""
    n = len(c.tokens)
    parts: list[tuple[int, SamplingCheck]] = []
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        part = check_sampling(
            states.logits(start, stop),
            c.tokens[start:stop],
            c.seed,
            settings.temperature,
            sample=c.sample_index,
            tolerance=settings.tie_tolerance,
            first_step=start,
        )
        parts.append((start, part))
    firsts = [s + p.first_mismatch for s, p in parts if p.first_mismatch is not None]
    return SamplingCheck(
        ok=all(p.ok for _, p in parts),
        n_tokens=n,
        mismatches=sum(p.mismatches for _, p in parts),
        tolerated=sum(p.tolerated for _, p in parts),
        near_ties=sum(p.near_ties for _, p in parts),
        first_mismatch=min(firsts) if firsts else None,
        max_gap=max((p.max_gap for _, p in parts), default=0.0),
    )


def check_claims(
    engine: Engine, claims: list[SampleClaim], settings: VerifySettings
) -> list[SampleVerdict]:
    """Checks 1-3 of every claim, where the model is; one verdict per claim, in order."""
    eos = engine.info.eos_id
    rows = settings.rows_per_chunk(engine.info.vocab_size)
    verdicts: list[SampleVerdict | None] = [None] * len(claims)
    todo = []
    for i, c in enumerate(claims):
        why = check_termination(c.tokens, c.finish_reason, settings.max_tokens, eos)
        if why is not None:
            verdicts[i] = SampleVerdict(False, True, [f"termination: {why}"])
        else:
            todo.append(i)
    stream = engine.prefill_stream([(claims[i].prompt, claims[i].tokens) for i in todo])
    for i, states in zip(todo, stream, strict=True):
        c = claims[i]
        reasons: list[str] = []
        hard = False
        try:
            sampling = _check_sampling_chunked(states, c, settings, rows)
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
            checks = verify_proofs(
                states.hidden, list(c.proofs), settings.chunk_size, settings.topk
            )
        except ProofError as exc:
            hard = True
            reasons.append(f"proofs: {exc}")
        else:
            _, proof_hard, proof_reasons = _proof_verdict(
                checks, settings.thresholds, settings.hard_factor
            )
            hard = hard or proof_hard
            reasons.extend(proof_reasons)
        verdicts[i] = SampleVerdict(not reasons, hard and bool(reasons), reasons, sampling, checks)
    return [v for v in verdicts if v is not None]


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
    settings = VerifySettings(
        temperature,
        max_tokens,
        thresholds or ProofThresholds(),
        tie_tolerance,
        hard_factor,
        chunk_size,
        topk,
    )
    done = engine.verify(claims, settings)
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


# -- wire forms, for the compute child's ``verify`` op -----------------------------------------


def claim_to_wire(c: SampleClaim) -> list[Any]:
    return [c.prompt, c.tokens, c.seed, c.sample_index, c.finish_reason, c.proofs]


def claim_from_wire(obj: list[Any]) -> SampleClaim:
    prompt, tokens, seed, sample, finish, proofs = obj
    return SampleClaim(
        [int(t) for t in prompt],
        [int(t) for t in tokens],
        int(seed),
        int(sample),
        str(finish),
        [bytes(p) for p in proofs],
    )


def verdict_to_wire(v: SampleVerdict) -> dict[str, Any]:
    return {
        "ok": v.ok,
        "hard": v.hard,
        "reasons": v.reasons,
        "sampling": None if v.sampling is None else list(vars(v.sampling).values()),
        "proofs": [[c.exp_mismatches, c.mant_err_mean, c.mant_err_median] for c in v.proofs],
    }


def verdict_from_wire(obj: dict[str, Any]) -> SampleVerdict:
    s = obj["sampling"]
    return SampleVerdict(
        bool(obj["ok"]),
        bool(obj["hard"]),
        [str(r) for r in obj["reasons"]],
        None if s is None else SamplingCheck(*s),
        [ProofCheck(int(e), float(m), float(md)) for e, m, md in obj["proofs"]],
    )

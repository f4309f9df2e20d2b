"""Validator-side checks of rollouts: termination, seeded sampling, and TOPLOC by prefill.

:func:`verify_samples` recomputes each sample with the validator's engine (one batched prefill)
and returns one :class:`SampleVerdict` per sample with the numbers that decided it:

1. termination (no model needed): ``"stop"`` must end with a stop id (any id of the model's stop
   set, :attr:`EngineInfo.stop_ids <node.compute.engine.EngineInfo.stop_ids>`) and hold at most
   ``max_tokens`` tokens; ``"length"`` exactly ``max_tokens``; no stop id before the last token.
2. sampling (:func:`swarm.sampling.check_positions`, the run's sampler): every token, the final
   stop id included, is the seeded Gumbel-max choice of the validator's logits, up to positions
   within ``tie_tolerance`` of the best score; those are *tolerated*, recorded per sample
   (``SamplingCheck.tolerated_at``), and bounded: a sample holding more than
   ``max_tolerated_per_1k`` per 1,000 tokens (counted as if it had at least 1,000) is rejected,
   soft up to ``hard_factor`` times the bound, hard beyond. The positions of every sample of a
   submission are checked in batches of at most ``rows_per_chunk`` positions across samples,
   on the device the logits are on: one noise draw and one comparison per batch, no Python
   loop over positions.
3. proofs (:func:`swarm.toploc.verify_proofs`): one proof per 32 tokens, checked against the
   validator's hidden states under the run's thresholds.

4. submission aggregates: the tolerated positions of all the samples together, bounded like a
   sample's (``max_tolerated_per_1k`` per 1,000 of their tokens, :func:`submission_tolerated`),
   and optionally (``submission_mant_err_mean``) the mean of ``mant_err_mean``
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
work arrays of :func:`swarm.sampling.check_positions` (:data:`BYTES_PER_LOGIT` = 56 bytes per
vocabulary entry and position, what gumbel-1's float64 arrays take; gumbel-2 takes less); only
the verdict numbers cross the pipe. Memory bound for a 150k vocabulary (Qwen2's 151,936) and a
64 x 1024-token submission: 256 MiB / (151,936 x 56 B) = 31 positions per chunk, so the check
holds <= 256 MiB of logits and work arrays at a time,
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

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from swarm.errors import ProofError
from swarm.sampling import (
    DEFAULT_TIE_TOLERANCE,
    GUMBEL_2,
    SamplingCheck,
    check_positions,
    summarize,
)
from swarm.toploc import CHUNK_SIZE, TOPK, ProofCheck, ProofThresholds, verify_proofs_batch


class PrefillStates(Protocol):
    """One sample's recomputed states (``node.compute.engine.PrefillStates``)."""

    hidden: Any

    def logits(self, start: int, stop: int) -> Any: ...


class EngineFacts(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def stop_ids(self) -> frozenset[int]: ...


class Engine(Protocol):
    """What the checks need of an engine (``node.compute.engine.Engine``, which calls them from
    its ``verify``: this module depends on this shape, not on that one)."""

    @property
    def info(self) -> EngineFacts: ...

    def prefill_stream(self, items: list[tuple[list[int], list[int]]]) -> Iterator[Any]: ...

    def verify(
        self, claims: list[SampleClaim], settings: VerifySettings
    ) -> list[SampleVerdict]: ...


DEFAULT_MODEL_SUBMISSION_MANT_ERR = 1.2
"""Submission-level bound on the mean mantissa error for the embedded default model (see above)."""


VERIFY_CHUNK_BYTES = 256 * 1024 * 1024
"""Logits and sampling work arrays of one chunk of positions at most (see the docstring)."""
BYTES_PER_LOGIT = 56
"""float32 logits + float64 copy, Gumbel noise (drawn rows and their stack), scores, masked
scores and partition: 4 + 6 x 8 bytes per vocabulary entry and position."""


def tolerated_allowed(max_per_1k: int, n_tokens: int) -> int:
    """Tolerated positions ``n_tokens`` tokens (a sample, or a submission's samples together)
    may hold: ``max_per_1k`` scaled to them, never below the 1,000-token allowance, so a short
    honest sample is not rejected for one near tie."""
    return max_per_1k * max(n_tokens, 1000) // 1000


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
    sampler: str = GUMBEL_2
    max_tolerated_per_1k: int = 0
    """Tolerated positions a sample may hold per 1,000 tokens (0 = no bound)."""

    def tolerated_allowed(self, n_tokens: int) -> int | None:
        """How many tolerated positions a sample of ``n_tokens`` may hold (None: no bound)."""
        if self.max_tolerated_per_1k <= 0:
            return None
        return tolerated_allowed(self.max_tolerated_per_1k, n_tokens)

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


SAMPLING_FIELDS = (
    "ok",
    "n_tokens",
    "mismatches",
    "tolerated",
    "near_ties",
    "first_mismatch",
    "max_gap",
    "tolerated_at",
)


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
    tokens: list[int], finish_reason: str, max_tokens: int, stop_ids: int | frozenset[int]
) -> str | None:
    """Why the claimed termination is impossible, or None when it is consistent; ``stop_ids``
    is the model's stop set (one id means a set of one)."""
    stops = frozenset((stop_ids,)) if isinstance(stop_ids, int) else stop_ids
    n = len(tokens)
    if n == 0:
        return "no tokens"
    if n > max_tokens:
        return f"{n} tokens exceed max_tokens={max_tokens}"
    early = next((i for i, t in enumerate(tokens[:-1]) if t in stops), None)
    if early is not None:
        return f"stop id {tokens[early]} (EOS) at position {early} before the end"
    if finish_reason == "stop":
        if tokens[-1] not in stops:
            return f"finish reason 'stop' but the last token {tokens[-1]} is not a stop id (EOS)"
    elif finish_reason == "length":
        if n != max_tokens:
            return f"finish reason 'length' with {n} tokens, not max_tokens={max_tokens}"
        if tokens[-1] in stops:
            return f"finish reason 'length' but the last token {tokens[-1]} is a stop id (EOS)"
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


def _sampling_batches(
    engine: Engine, claims: list[SampleClaim], todo: list[int], settings: VerifySettings
) -> tuple[dict[int, tuple[PrefillStates, SamplingCheck]], dict[int, str]]:
    """The prefill states and sampling check of every claim in ``todo``, and why the check
    could not run for the others (a malformed sample: a :class:`ProofError`'s message).

    Positions of consecutive samples are gathered into batches of at most ``rows_per_chunk``
    rows (a sample longer than that spans several), and each batch is one
    :func:`check_positions` call on the logits' device; only the per-position gaps and near-tie
    flags come back, and each sample's result is summarised once all its positions are in.
    """
    import numpy as np
    import torch

    budget = settings.rows_per_chunk(engine.info.vocab_size)
    stream = engine.prefill_stream([(claims[i].prompt, claims[i].tokens) for i in todo])
    states: dict[int, PrefillStates] = {}
    gaps: dict[int, list[Any]] = {i: [] for i in todo}
    nears: dict[int, list[Any]] = {i: [] for i in todo}
    pending: list[tuple[int, int, int]] = []  # (claim, start, stop) of the open batch
    done: dict[int, tuple[PrefillStates, SamplingCheck]] = {}
    failed: dict[int, str] = {}

    def flush() -> None:
        if not pending:
            return
        parts = [states[i].logits(a, b) for i, a, b in pending]
        logits = torch.cat([torch.as_tensor(p) for p in parts]) if len(parts) > 1 else parts[0]
        tokens = [t for i, a, b in pending for t in claims[i].tokens[a:b]]
        seeds = [claims[i].seed for i, a, b in pending for _ in range(a, b)]
        samples = [claims[i].sample_index for i, a, b in pending for _ in range(a, b)]
        steps = [t for _, a, b in pending for t in range(a, b)]
        try:
            pos = check_positions(
                logits,
                tokens,
                seeds,
                samples,
                steps,
                settings.temperature,
                tolerance=settings.tie_tolerance,
                sampler=settings.sampler,
            )
        except ProofError as exc:  # one bad sample must not sink its neighbours: one by one
            if len({i for i, _, _ in pending}) == 1:
                failed[pending[0][0]] = str(exc)
                pending.clear()
                return
            batch = list(pending)
            pending.clear()
            for piece in batch:
                pending.append(piece)
                flush()
            return
        gap, near = pos.gap.cpu().numpy(), pos.near.cpu().numpy()
        at = 0
        for i, a, b in pending:
            gaps[i].append(gap[at : at + b - a])
            nears[i].append(near[at : at + b - a])
            at += b - a
        pending.clear()

    def finish(i: int) -> None:
        if i in failed:
            return
        g = np.concatenate(gaps.pop(i)) if gaps[i] else np.zeros(0, np.float32)
        nr = np.concatenate(nears.pop(i)) if nears[i] else np.zeros(0, bool)
        done[i] = (states.pop(i), summarize(g, nr, settings.tie_tolerance))

    rows = 0
    complete: list[int] = []
    for i, st in zip(todo, stream, strict=True):
        states[i] = st
        n = len(claims[i].tokens)
        start = 0
        while start < n:
            take = min(n - start, budget - rows)
            pending.append((i, start, start + take))
            rows += take
            start += take
            if rows >= budget:
                flush()
                rows = 0
                for j in complete:
                    finish(j)
                complete.clear()
        complete.append(i)
    flush()
    for j in complete:
        finish(j)
    return done, failed


def _tolerance_verdict(
    sampling: SamplingCheck, settings: VerifySettings
) -> tuple[bool, str | None]:
    """(hard, reason) when the sample holds more tolerated positions than the bound allows."""
    allowed = settings.tolerated_allowed(sampling.n_tokens)
    if allowed is None or sampling.tolerated <= allowed:
        return False, None
    hard = sampling.tolerated > allowed * settings.hard_factor
    return hard, (
        f"sampling: {sampling.tolerated} tolerated near-tie positions in {sampling.n_tokens}"
        f" tokens exceed the bound of {allowed} (max_tolerated_per_1k="
        f"{settings.max_tolerated_per_1k}; positions {list(sampling.tolerated_at[:8])})"
    )


def check_claims(
    engine: Engine, claims: list[SampleClaim], settings: VerifySettings
) -> list[SampleVerdict]:
    """Checks 1-3 of every claim, where the model is; one verdict per claim, in order."""
    stops = engine.info.stop_ids
    verdicts: list[SampleVerdict | None] = [None] * len(claims)
    todo = []
    for i, c in enumerate(claims):
        why = check_termination(c.tokens, c.finish_reason, settings.max_tokens, stops)
        if why is not None:
            verdicts[i] = SampleVerdict(False, True, [f"termination: {why}"])
        else:
            todo.append(i)
    checked, failed = _sampling_batches(engine, claims, todo, settings)
    for i, why in failed.items():
        verdicts[i] = SampleVerdict(False, True, [f"sampling: {why}"])
    todo = [i for i in todo if i in checked]
    proof_checks = verify_proofs_batch(
        [checked[i][0].hidden for i in todo],
        [list(claims[i].proofs) for i in todo],
        settings.chunk_size,
        settings.topk,
    )
    for i, proof_result in zip(todo, proof_checks, strict=True):
        sampling = checked[i][1]
        reasons: list[str] = []
        hard = False
        if not sampling.ok:
            hard = True
            reasons.append(
                f"sampling: {sampling.mismatches} of {sampling.n_tokens} tokens are not the "
                f"seeded choice (first at {sampling.first_mismatch}, gap {sampling.max_gap:.3g})"
            )
        over_hard, over = _tolerance_verdict(sampling, settings)
        if over is not None:
            hard = hard or over_hard
            reasons.append(over)
        checks: list[ProofCheck] = []
        if isinstance(proof_result, ProofError):
            hard = True
            reasons.append(f"proofs: {proof_result}")
        else:
            checks = proof_result
            _, proof_hard, proof_reasons = _proof_verdict(
                checks, settings.thresholds, settings.hard_factor
            )
            hard = hard or proof_hard
            reasons.extend(proof_reasons)
        verdicts[i] = SampleVerdict(not reasons, hard and bool(reasons), reasons, sampling, checks)
    return [v for v in verdicts if v is not None]


def submission_tolerated(
    verdicts: list[SampleVerdict], max_per_1k: int, hard_factor: float = 2.0
) -> tuple[bool, str] | None:
    """(hard, reason) when the samples of one submission, together, hold more tolerated
    positions than ``max_per_1k`` per 1,000 of their tokens (counted as at least 1,000), else
    None. The per-sample bound alone lets each short sample use the whole 1,000-token
    allowance; together a submission's samples get one allowance for all their tokens, so a
    cheater swapping runner-ups keeps at most ``max_per_1k`` per 1,000 positions."""
    if max_per_1k <= 0:
        return None
    checks = [v.sampling for v in verdicts if v.sampling is not None]
    tokens = sum(c.n_tokens for c in checks)
    tolerated = sum(c.tolerated for c in checks)
    allowed = tolerated_allowed(max_per_1k, tokens)
    if tolerated <= allowed:
        return None
    return tolerated > allowed * hard_factor, (
        f"submission: {tolerated} tolerated near-tie positions in {tokens} tokens exceed the"
        f" bound of {allowed} (max_tolerated_per_1k={max_per_1k})"
    )


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
    sampler: str = GUMBEL_2,
    max_tolerated_per_1k: int = 0,
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
        sampler=sampler,
        max_tolerated_per_1k=max_tolerated_per_1k,
    )
    done = engine.verify(claims, settings)
    over = submission_tolerated(done, max_tolerated_per_1k, hard_factor)
    if over is not None:
        hard, why = over
        done = [replace(v, ok=False, hard=v.hard or hard, reasons=[*v.reasons, why]) for v in done]
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
        "sampling": None
        if v.sampling is None
        else [getattr(v.sampling, k) for k in SAMPLING_FIELDS],
        "proofs": [[c.exp_mismatches, c.mant_err_mean, c.mant_err_median] for c in v.proofs],
    }


def verdict_from_wire(obj: dict[str, Any]) -> SampleVerdict:
    s = obj["sampling"]
    return SampleVerdict(
        bool(obj["ok"]),
        bool(obj["hard"]),
        [str(r) for r in obj["reasons"]],
        None if s is None else _sampling_from_wire(s),
        [ProofCheck(int(e), float(m), float(md)) for e, m, md in obj["proofs"]],
    )


def _sampling_from_wire(s: list[Any]) -> SamplingCheck:
    fields = dict(zip(SAMPLING_FIELDS, s, strict=False))
    fields["tolerated_at"] = tuple(int(t) for t in fields.get("tolerated_at") or ())
    return SamplingCheck(**fields)

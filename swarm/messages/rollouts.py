"""What an inference worker submits (RolloutSubmission) and what a validator decides (Verdict)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self, cast

from swarm.errors import MalformedError
from swarm.messages._base import Fields, typed

FinishReason = Literal["stop", "length"]
Severity = Literal["none", "soft", "hard"]
# Rewards are signed values, so they travel as integers: millionths of a reward unit.
REWARD_SCALE = 1_000_000


@dataclass(frozen=True, slots=True)
class Sample:
    """One generated completion with everything a validator needs to replay it."""

    prompt_id: str
    tokens: tuple[int, ...]
    seed: int
    proofs: tuple[bytes, ...]
    finish_reason: FinishReason

    def to_wire(self) -> dict[str, Any]:
        return {
            "prompt_id": self.prompt_id,
            "tokens": list(self.tokens),
            "seed": self.seed,
            "proofs": list(self.proofs),
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        reason = f.text("finish_reason")
        if reason not in ("stop", "length"):
            raise MalformedError(f"finish_reason {reason[:16]!r} is not 'stop' or 'length'")
        return cls(
            prompt_id=f.text("prompt_id"),
            tokens=f.seq("tokens", _token),
            seed=f.integer("seed", minimum=0),
            proofs=f.seq("proofs", typed(bytes, "proofs")),
            finish_reason=cast(FinishReason, reason),
        )


def _token(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 2**32:
        raise MalformedError("a token id is an integer in [0, 2**32)")
    return value


@dataclass(frozen=True, slots=True)
class RolloutSubmission:
    """Signed by the worker: its ``counter``-th request's samples for policy ``policy_version``."""

    KIND: ClassVar[str] = "rollout-submission"
    MAX_BYTES: ClassVar[int] = 8 * 1024 * 1024

    run_id: str
    policy_version: int
    counter: int
    prompt_ids: tuple[str, ...]
    samples: tuple[Sample, ...]
    created_at: int
    dtype: str = ""
    """The precision the worker generated in (``float32`` or ``bfloat16``; empty in submissions
    made before issue 24): the validator's sampling tolerance follows it and its own."""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "policy_version": self.policy_version,
            "counter": self.counter,
            "prompt_ids": list(self.prompt_ids),
            "samples": [s.to_wire() for s in self.samples],
            "created_at": self.created_at,
        }
        if self.dtype:  # written only when set, so an older submission encodes as before
            out["dtype"] = self.dtype
        return out

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            run_id=f.text("run_id"),
            policy_version=f.integer("policy_version", minimum=0),
            counter=f.integer("counter", minimum=0),
            prompt_ids=f.seq("prompt_ids", typed(str, "prompt_ids")),
            samples=f.items("samples", Sample.from_wire),
            created_at=f.integer("created_at", minimum=0),
            dtype=_dtype(f.text("dtype", "")),
        )


DTYPES = ("float32", "bfloat16")


def _dtype(value: str) -> str:
    if value and value not in DTYPES:
        raise MalformedError(f"dtype {value[:16]!r} is not one of {', '.join(DTYPES)}")
    return value


@dataclass(frozen=True, slots=True)
class Verdict:
    """Signed by a genesis validator. ``metrics`` holds the numbers that decided it (as text)."""

    KIND: ClassVar[str] = "verdict"
    MAX_BYTES: ClassVar[int] = 256 * 1024

    run_id: str
    submission_id: bytes
    worker: str
    accepted: bool
    severity: Severity
    reasons: tuple[str, ...]
    rewards: tuple[int, ...]
    created_at: int
    metrics: Mapping[str, int | str] = field(default_factory=dict)
    policy_version: int = -1
    """The judged submission's policy version and request counter (-1 in verdicts made before
    these fields existed): what the ledger's one-credit-per-assignment rule and the reward curve
    per version read without the submission at hand."""
    counter: int = -1

    def to_wire(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "submission_id": self.submission_id,
            "worker": self.worker,
            "accepted": self.accepted,
            "severity": self.severity,
            "reasons": list(self.reasons),
            "rewards": list(self.rewards),
            "created_at": self.created_at,
            "metrics": dict(self.metrics),
            "policy_version": self.policy_version,
            "counter": self.counter,
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        severity = f.text("severity")
        if severity not in ("none", "soft", "hard"):
            raise MalformedError(f"severity {severity[:16]!r} is not none, soft or hard")
        metrics = f.plain_map("metrics", {})
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise MalformedError(f"verdict metric {key[:32]!r} must be an int or a string")
        return cls(
            run_id=f.text("run_id"),
            submission_id=f.blob("submission_id", length=32),
            worker=f.text("worker"),
            accepted=f.flag("accepted"),
            severity=cast(Severity, severity),
            reasons=f.seq("reasons", typed(str, "reasons")),
            rewards=f.seq("rewards", typed(int, "rewards")),
            created_at=f.integer("created_at", minimum=0),
            metrics=metrics,
            policy_version=f.integer("policy_version", -1, minimum=-1),
            counter=f.integer("counter", -1, minimum=-1),
        )

"""What makes the trainer checkable: its signed record of each step, its signed receipt of each
sample it was handed, and a validator's signed dispute of a step.

- ``TrainingRecord``: signed by the publishing trainer for each version it trains. It cites the
  verdicts of the samples the step trained on, in the order it trained them, every number that
  decides the step, and sha256 commitments to its training state (float32 masters and AdamW
  moments, ``node.compute.train_state``) before and after, and to the served weights of the
  version. Replaying the step from the state before and the cited samples must give the state
  after, bit for bit on the same kind of machine (``node.roles.training_audit``).
- ``SampleReceipt``: the trainer's answer to a hand-off (``/samples/1``), kept by the validator.
  It says where the sample stands in the trainer's queue (``seq``): samples are trained oldest
  first inside the async window, so a record that cites a later sample while an earlier one of
  the window is left out shows, with the trainer's own signature, that the trainer skipped it.
- ``TrainingDispute``: signed by a genesis validator whose training audit disagrees with a
  record (or found a version with no record); gossiped on the ledger topic and shown by
  ``status``, ``ledger show``, the dashboard and ``audit``.

The training audit's share (``RunParams.train_audit_share``) is drawn per version by the one
validator due for it (``train_auditor``, rendezvous hashing) from its own signature over the
record's id (``audit_draw``): Ed25519 signatures are deterministic, so the draw is fixed by the
record, yet the trainer, without the validator's key, cannot tell which versions will be
replayed; it has to keep the state of every version within its retention window.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from swarm.errors import MalformedError
from swarm.messages._base import Fields, typed

MAX_RECORD_SAMPLES = 1024
"""Verdicts one record may cite (one per submission the step trained on)."""
MAX_MEMBERS = 16
"""Members whose gradient commitments one record carries."""
MAX_MEMBER_SAMPLES = 256
"""Verdicts one member's gradient commitment may cite."""
DISPUTE_REASONS = (
    "no-record",  # a version announced without a training record
    "unknown-verdict",  # a cited verdict that no validator holds
    "not-accepted",  # a cited verdict that rejects, or judges another run or submission
    "outside-window",  # a cited sample made by a version outside the step's async window
    "wrong-params",  # the record's numbers are not the genesis's
    "state-mismatch",  # the served state does not match the record's commitment
    "replay-mismatch",  # the replayed step does not give the record's state after
    "weights-mismatch",  # the published weights are not the state after, served
    "skipped-sample",  # a receipted sample of the window left out while later ones trained
    "member-mismatch",  # several trainers: a member's gradient does not replay
)


def train_seed(run_id: str, version: int) -> int:
    """The seed of the step that produces ``version`` (dropout and anything random in a step):
    fixed by the run and the version, so a replay draws the same numbers."""
    digest = hashlib.sha256(f"swarm-node/train-seed/{run_id}/{version}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


def train_auditor(run_id: str, version: int, validators: Sequence[str]) -> str:
    """The genesis validator due to consider ``version`` for a training audit."""
    if not validators:
        raise MalformedError("a run without validators has no training auditor")
    return min(
        validators,
        key=lambda v: hashlib.sha256(
            f"swarm-node/train-audit/{run_id}/{version}/{v}".encode()
        ).digest(),
    )


AUDIT_DRAW_KIND = "train-audit-draw"
"""The domain of the due validator's signature over a record id that draws the audit."""


def audit_draw(signature: bytes) -> float:
    """A number in [0, 1) from the due validator's signature over the record's id; the version
    is audited when it falls below ``train_audit_share``."""
    return int.from_bytes(hashlib.sha256(signature).digest()[:8], "big") / 2**64


def _id32(what: str) -> Any:
    def read(value: Any) -> bytes:
        if type(value) is not bytes or len(value) != 32:
            raise MalformedError(f"{what} holds ids of 32 bytes")
        return value

    return read


def gradient_file(version: int, gradient: bytes) -> str:
    """The file a group member keeps the gradient it committed for the round to ``version``
    under, one per commitment: a member whose round failed on its side and ran again keeps
    both, since the others may have finished the first and recorded its commitment."""
    return f"g{version}-{gradient.hex()[:16]}.safetensors"


@dataclass(frozen=True, slots=True)
class GradientCommitment:
    """Several trainers: signed by one member of the round that produced ``version``, in its
    training child, before the averaging: the samples it trained on (cited verdicts in training
    order, each with its sample version), the sample count that weighs its gradient in the
    group's mean, the seed and thread count of its step, and sha256 commitments to its own
    training state before the step and to its own gradient (float32, per parameter name, before
    averaging; ``node.compute.train_state.digest``). The publisher's ``TrainingRecord`` carries
    every member's commitment, so an audit can replay one member's gradient from its samples and
    the averaging from the committed gradients (``node.roles.training_audit``)."""

    KIND: ClassVar[str] = "gradient-commitment"
    MAX_BYTES: ClassVar[int] = 24 * 1024

    run_id: str
    version: int
    samples: int
    verdicts: tuple[bytes, ...]
    sample_versions: tuple[int, ...]
    seed: int
    threads: int
    state_before: bytes
    gradient: bytes
    created_at: int

    def __post_init__(self) -> None:
        if len(self.verdicts) > MAX_MEMBER_SAMPLES:
            raise MalformedError(
                f"a gradient commitment cites at most {MAX_MEMBER_SAMPLES} verdicts"
            )
        if len(self.sample_versions) != len(self.verdicts):
            raise MalformedError("a gradient commitment gives one sample version per verdict")

    def to_wire(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "version": self.version,
            "samples": self.samples,
            "verdicts": list(self.verdicts),
            "sample_versions": list(self.sample_versions),
            "seed": self.seed,
            "threads": self.threads,
            "state_before": self.state_before,
            "gradient": self.gradient,
            "created_at": self.created_at,
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            run_id=f.text("run_id"),
            version=f.integer("version", minimum=1),
            samples=f.integer("samples", minimum=0),
            verdicts=f.seq("verdicts", _id32("verdicts")),
            sample_versions=f.seq("sample_versions", typed(int, "sample_versions")),
            seed=f.integer("seed", minimum=0),
            threads=f.integer("threads", minimum=0),
            state_before=f.blob("state_before"),
            gradient=f.blob("gradient"),
            created_at=f.integer("created_at", minimum=0),
        )


@dataclass(frozen=True, slots=True)
class TrainingRecord:
    """Signed by the trainer that published ``version`` (see the module docstring).

    ``config`` is the canonical JSON text of the step's numbers (the GRPO hyperparameters, the
    serving dtype, the thread count and the deterministic flag); ``sample_versions`` gives, for
    each cited verdict, the policy version that made its sample (its async offset is
    ``parent - sample_version``); ``min_version`` is the window's floor. ``state_before`` and
    ``state_after`` commit to the training state (empty: a sharded trainer, not committed);
    ``weights`` to the served tensors of ``version``. A round of several trainers carries each
    member's signed ``GradientCommitment`` (envelope bytes) in ``members``; its ``verdicts`` are
    then the members' citations, member after member, and its states are the publisher's."""

    KIND: ClassVar[str] = "training-record"
    MAX_BYTES: ClassVar[int] = 128 * 1024

    run_id: str
    version: int
    parent: int
    min_version: int
    verdicts: tuple[bytes, ...]
    sample_versions: tuple[int, ...]
    config: str
    seed: int
    state_before: bytes
    state_after: bytes
    weights: bytes
    created_at: int
    members: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if self.version != self.parent + 1:
            raise MalformedError("a training record's version follows its parent")
        if len(self.verdicts) > MAX_RECORD_SAMPLES:
            raise MalformedError(f"a training record cites at most {MAX_RECORD_SAMPLES} verdicts")
        if len(self.sample_versions) != len(self.verdicts):
            raise MalformedError("a training record gives one sample version per verdict")
        if len(set(self.verdicts)) != len(self.verdicts):
            raise MalformedError("a training record cites a verdict twice")
        if len(self.members) > MAX_MEMBERS:
            raise MalformedError(f"a training record names at most {MAX_MEMBERS} members")

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "run_id": self.run_id,
            "version": self.version,
            "parent": self.parent,
            "min_version": self.min_version,
            "verdicts": list(self.verdicts),
            "sample_versions": list(self.sample_versions),
            "config": self.config,
            "seed": self.seed,
            "state_before": self.state_before,
            "state_after": self.state_after,
            "weights": self.weights,
            "created_at": self.created_at,
        }
        if self.members:
            wire["members"] = list(self.members)
        return wire

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            run_id=f.text("run_id"),
            version=f.integer("version", minimum=1),
            parent=f.integer("parent", minimum=0),
            min_version=f.integer("min_version", minimum=0),
            verdicts=f.seq("verdicts", _id32("verdicts")),
            sample_versions=f.seq("sample_versions", typed(int, "sample_versions")),
            config=f.text("config"),
            seed=f.integer("seed", minimum=0),
            state_before=f.blob("state_before"),
            state_after=f.blob("state_after"),
            weights=f.blob("weights"),
            created_at=f.integer("created_at", minimum=0),
            members=f.seq("members", typed(bytes, "members"), []),
        )


@dataclass(frozen=True, slots=True)
class SampleReceipt:
    """Signed by a trainer for each sample handed to it: ``queued`` with its place ``seq`` in
    the queue (a re-delivered sample gets its first receipt's ``seq``), or not (too old:
    ``trainer_version`` minus the run's async level is above ``sample_version``)."""

    KIND: ClassVar[str] = "sample-receipt"
    MAX_BYTES: ClassVar[int] = 1024

    run_id: str
    submission_id: bytes
    verdict_id: bytes
    worker: str
    sample_version: int
    trainer_version: int
    queued: bool
    seq: int
    created_at: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "submission_id": self.submission_id,
            "verdict_id": self.verdict_id,
            "worker": self.worker,
            "sample_version": self.sample_version,
            "trainer_version": self.trainer_version,
            "queued": self.queued,
            "seq": self.seq,
            "created_at": self.created_at,
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            run_id=f.text("run_id"),
            submission_id=f.blob("submission_id", length=32),
            verdict_id=f.blob("verdict_id", length=32),
            worker=f.text("worker"),
            sample_version=f.integer("sample_version", minimum=0),
            trainer_version=f.integer("trainer_version", minimum=0),
            queued=f.flag("queued"),
            seq=f.integer("seq", minimum=0),
            created_at=f.integer("created_at", minimum=0),
        )


@dataclass(frozen=True, slots=True)
class TrainingDispute:
    """Signed by a genesis validator: its training audit of ``version`` disagrees (``reason``,
    one of ``DISPUTE_REASONS``; ``detail`` says what it found). ``record`` is the disputed
    record's id (empty for ``no-record``); ``related`` the ids the finding rests on (a verdict,
    a receipt)."""

    KIND: ClassVar[str] = "training-dispute"
    MAX_BYTES: ClassVar[int] = 8 * 1024

    run_id: str
    version: int
    trainer: str
    record: bytes
    reason: str
    detail: str
    created_at: int
    related: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if self.reason not in DISPUTE_REASONS:
            raise MalformedError(f"training dispute reason {self.reason[:32]!r} is not known")
        if len(self.detail) > 1024:
            raise MalformedError("a training dispute's detail holds at most 1024 characters")
        if len(self.related) > 8:
            raise MalformedError("a training dispute cites at most 8 ids")

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "run_id": self.run_id,
            "version": self.version,
            "trainer": self.trainer,
            "record": self.record,
            "reason": self.reason,
            "detail": self.detail,
            "created_at": self.created_at,
        }
        if self.related:
            wire["related"] = list(self.related)
        return wire

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            run_id=f.text("run_id"),
            version=f.integer("version", minimum=0),
            trainer=f.text("trainer"),
            record=f.blob("record"),
            reason=f.text("reason"),
            detail=f.text("detail"),
            created_at=f.integer("created_at", minimum=0),
            related=f.seq("related", _id32("related"), []),
        )

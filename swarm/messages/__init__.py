"""Signed message types, each a frozen dataclass with ``to_wire``/``from_wire``.

``decode(data, Cls)`` verifies and decodes one kind; ``decode_any(data)`` any known kind.
"""

from __future__ import annotations

from typing import Any, Final

from swarm.messages._base import Fields, Message, Signed, decode, decode_as, sign
from swarm.messages.evaluation import Evaluation, eval_due, eval_seed, eval_validator
from swarm.messages.ledger import LedgerEvent
from swarm.messages.membership import ROLES, PolicyAnnouncement, Role, RoleAdvert, parse_role
from swarm.messages.rollouts import REWARD_SCALE, RolloutSubmission, Sample, Verdict
from swarm.messages.run import (
    LEGACY_PARAMS,
    FileRef,
    ModelSpec,
    RunGenesis,
    RunParams,
    run_id_of,
)
from swarm.messages.shards import ShardFile, ShardManifest
from swarm.messages.training import (
    GradientCommitment,
    SampleReceipt,
    TrainingDispute,
    TrainingRecord,
    gradient_file,
    train_auditor,
    train_seed,
)
from swarm.wire import open_envelope

MESSAGE_TYPES: Final[tuple[type[Any], ...]] = (
    RunGenesis,
    RoleAdvert,
    PolicyAnnouncement,
    ShardManifest,
    RolloutSubmission,
    Verdict,
    LedgerEvent,
    Evaluation,
    TrainingRecord,
    SampleReceipt,
    TrainingDispute,
    GradientCommitment,
)
KINDS: Final[dict[str, type[Any]]] = {cls.KIND: cls for cls in MESSAGE_TYPES}
LIMITS: Final[dict[str, int]] = {cls.KIND: cls.MAX_BYTES for cls in MESSAGE_TYPES}


def decode_any(data: bytes) -> Signed[Any]:
    """Verify and decode envelope bytes of any known kind."""
    envelope = open_envelope(data, LIMITS)
    return decode_as(KINDS[envelope.kind], envelope)


__all__ = [
    "KINDS",
    "LEGACY_PARAMS",
    "LIMITS",
    "MESSAGE_TYPES",
    "REWARD_SCALE",
    "ROLES",
    "Evaluation",
    "Fields",
    "FileRef",
    "GradientCommitment",
    "LedgerEvent",
    "Message",
    "ModelSpec",
    "PolicyAnnouncement",
    "Role",
    "RoleAdvert",
    "RolloutSubmission",
    "RunGenesis",
    "RunParams",
    "Sample",
    "SampleReceipt",
    "ShardFile",
    "ShardManifest",
    "Signed",
    "TrainingDispute",
    "TrainingRecord",
    "Verdict",
    "decode",
    "decode_any",
    "eval_due",
    "eval_seed",
    "eval_validator",
    "gradient_file",
    "parse_role",
    "run_id_of",
    "sign",
    "train_auditor",
    "train_seed",
]

"""Every name the run uses on the network: gossip topics, DHT keys, stream protocols.

All of them are namespaced by the run id (32 lowercase hex characters), so two runs never see
each other's messages. ``docs/protocol.md`` is the written form of this module.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from swarm.errors import ConfigError, MalformedError
from swarm.messages import ROLES, Role

NAMESPACE: Final = "swarm-node"
"""The DHT record namespace (``/swarm-node/...``) whose records our validator checks."""

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_TOPIC = re.compile(r"^swarm-node/([0-9a-f]{32})/(policy|ledger)$")

# The request/response protocols of a run, one constant per protocol: every role that serves
# or asks one imports its name from here, never from another role's module.
MANIFEST: Final = "manifest"
"""SHARDCAST: a policy version's signed manifest (any holder)."""
SHARD: Final = "shard"
"""SHARDCAST: holdings, data channel offers and shard pieces (any holder)."""
POLICY: Final = "policy"
"""The newest PolicyAnnouncement a node holds (anti-entropy for lost gossip; every node)."""
SUBMIT: Final = "submit"
"""Worker -> validator: a signed RolloutSubmission; the answer is the signed Verdict."""
SAMPLES: Final = "samples"
"""Validator -> trainer: accepted work as the signed pair (submission, verdict)."""
SYNC: Final = "ledger-sync"
"""Ledger replicas reconcile their event sets (every node)."""
EVALUATIONS: Final = "evaluations"
"""The held-out evaluations a node holds that the asker lacks (every node;
``node.roles.evaluation_sync``)."""
TRAINING: Final = "training"
"""The training records a node holds that the asker lacks (every node, same wire as
``EVALUATIONS``)."""
TRAIN_RECEIPTS: Final = "train-receipts"
"""The sample receipts and training disputes a validator holds (``swarm-node audit
--training``'s coverage)."""
TRAIN_STATE: Final = "train-state"
"""Auditor -> trainer: a byte range of a version's training state file, or of a group member's
gradient (``node.roles.training_audit``)."""
EVIDENCE: Final = "evidence"
"""A signed envelope by its id (sha256 of its bytes): the evidence behind verdicts, served by
every holder (``node.roles.evidence``)."""
RUN_FILES: Final = "run-files"
"""The small files a genesis binds by sha256 (the model card's files, a task data set), served
by every holder (``node.run_files``)."""
STREAM_NAMES: Final = (
    MANIFEST,
    SHARD,
    POLICY,
    SUBMIT,
    SAMPLES,
    SYNC,
    EVALUATIONS,
    TRAINING,
    TRAIN_RECEIPTS,
    TRAIN_STATE,
    EVIDENCE,
    RUN_FILES,
)
"""Every request/response protocol of a run (``docs/protocol.md`` describes each)."""
_STREAM_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise MalformedError(f"{run_id[:40]!r} is not a run id (32 lowercase hex characters)")
    return run_id


def policy_topic(run_id: str) -> str:
    """The gossip topic of a run's PolicyAnnouncements (only from genesis trainers)."""
    return f"{NAMESPACE}/{check_run_id(run_id)}/policy"


def ledger_topic(run_id: str) -> str:
    """The gossip topic of a run's verdicts and ledger events (only from genesis validators)."""
    return f"{NAMESPACE}/{check_run_id(run_id)}/ledger"


def parse_topic(topic: str) -> tuple[str, str] | None:
    """``(run_id, "policy" | "ledger")`` for one of our topics, ``None`` for anything else."""
    match = _TOPIC.match(topic)
    return (match.group(1), match.group(2)) if match else None


def advert_key(run_id: str, peer_id: str) -> str:
    """The DHT value key of a peer's RoleAdvert in a run: ``/swarm-node/<run>/advert/<peer>``."""
    return f"/{NAMESPACE}/{check_run_id(run_id)}/advert/{peer_id}"


def parse_advert_key(key: str) -> tuple[str, str]:
    """``(run_id, peer_id)`` of an advert key; ``MalformedError`` for any other key."""
    parts = key.split("/")
    if len(parts) != 5 or parts[0] != "" or parts[1] != NAMESPACE or parts[3] != "advert":
        raise MalformedError(f"{key[:120]!r} is not a RoleAdvert key")
    return check_run_id(parts[2]), parts[4]


def role_provider_key(run_id: str, role: Role) -> str:
    """The DHT provider key (hex of a sha256 multihash digest) under which a role's nodes
    advertise themselves in a run. Hex keys are passed to py-libp2p's provider store as bytes."""
    if role not in ROLES:
        raise MalformedError(f"unknown role {role!r}")
    name = f"{NAMESPACE}/{check_run_id(run_id)}/role/{role}".encode()
    # A sha2-256 multihash (0x12, 0x20, digest), like a CIDv0 would carry.
    return (bytes([0x12, 0x20]) + hashlib.sha256(name).digest()).hex()


def stream_protocol(run_id: str, name: str, version: int = 1) -> str:
    """A request/response protocol id, e.g. ``/swarm-node/<run>/manifest/1``."""
    if not _STREAM_NAME.match(name):
        raise ConfigError(f"{name!r} is not a stream protocol name (lowercase, digits, '-')")
    return f"/{NAMESPACE}/{check_run_id(run_id)}/{name}/{version}"


DIALBACK_PROTOCOL: Final = f"/{NAMESPACE}/dialback/1"
"""Reachability by dial-back (``swarm.net.reach``): run-independent, served by bootstrap peers."""

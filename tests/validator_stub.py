"""A real ``Validator`` (claims, ledger and evidence in SQLite files) on a stand-in node holding
only what ``Validator.handle`` reads: for tests of admission and engine healing without a swarm.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from node.compute.engine import Engine
from node.roles.claims import ClaimBook
from node.roles.evidence import EvidenceService
from node.roles.validator import Validator
from node.run import create_genesis
from swarm.evidence import EvidenceStore
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import RunParams, run_id_of

OWNER = NodeKey.from_seed(hashlib.sha256(b"admission-owner").digest())
ME = NodeKey.from_seed(hashlib.sha256(b"admission-validator").digest())
PARAMS = RunParams(group_size=2, batch_prompts=2, max_tokens=8, async_level=2)
GENESIS = create_genesis(
    OWNER,
    name="admission",
    trainers=[OWNER.peer_id],
    validators=[ME.peer_id],
    params=PARAMS,
    created_at=1,
)
RUN = run_id_of(GENESIS)
VERSION = 3
MANIFESTS = {v: hashlib.sha256(b"manifest of v%d" % v).digest() for v in (VERSION - 1, VERSION)}
"""The manifest ids the stand-in feed knows: the newest two versions of the window (the oldest,
``VERSION - 2``, is in the window but its manifest is unknown here)."""


class Withdrawals:
    def __init__(self) -> None:
        self.withdrawn = False

    async def withdraw(self) -> None:
        self.withdrawn = True


class Gossip:
    """What the validator would gossip, kept in a list."""

    def __init__(self) -> None:
        self.published: list[Any] = []

    async def __call__(self, signed: Any) -> None:
        self.published.append(signed)


def stub_validator(tmp_path: Path, engine: Engine, weights: Path | None = None) -> Validator:
    """A validator whose newest policy is ``VERSION``, held at ``weights``."""
    newest = SimpleNamespace(message=SimpleNamespace(version=VERSION))
    node: Any = SimpleNamespace(
        peer_id=ME.peer_id,
        run_id=RUN,
        key=ME,
        config=SimpleNamespace(genesis=GENESIS),
        policy=SimpleNamespace(newest=newest, version=VERSION),
        membership=Withdrawals(),
        publish_ledger=Gossip(),
    )
    feed: Any = SimpleNamespace(
        path_of=lambda version: weights if version == VERSION else None,
        manifests=lambda versions: {v: MANIFESTS[v] for v in versions if v in MANIFESTS},
    )
    return Validator(
        node,
        feed=feed,
        engine=engine,
        ledger=LedgerStore(tmp_path / "ledger.db", GENESIS),
        evidence=EvidenceService(node, EvidenceStore(tmp_path / "evidence.db")),
        claims=ClaimBook(tmp_path / "claims.db"),
    )

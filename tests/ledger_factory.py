"""A ledger made of real signed verdicts and events, without running a swarm: what the
dashboard's API tests and ``bench/dashboard.py`` read.

Each judged piece of work is a real signed ``RolloutSubmission`` (kept in the evidence store next
to the ledger when ``evidence``, with its verdict, as a validator keeps them), a signed ``Verdict``
in the ``verdicts`` table and, for accepted work, a credit citing it; a rejected hard one gets a
slash citing it. Peer names are whatever the caller gives, so a
test can name a peer ``<img src=x onerror=alert(1)>`` (the ledger's rules check signers, not the
text of the peer an event is about).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from node.run import create_genesis
from swarm.evidence import EvidenceStore
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import (
    REWARD_SCALE,
    LedgerEvent,
    RolloutSubmission,
    RunGenesis,
    RunParams,
    Sample,
    Signed,
    Verdict,
    run_id_of,
    sign,
)

OWNER = NodeKey.from_seed(hashlib.sha256(b"dash-owner").digest())
VALIDATOR = NodeKey.from_seed(hashlib.sha256(b"dash-validator").digest())
TRAINER = NodeKey.from_seed(hashlib.sha256(b"dash-trainer").digest())
PARAMS = RunParams(initial_balance=100, ban_threshold=0, slash_amount=1000, credit_per_sample=1)


def genesis() -> Signed[RunGenesis]:
    return create_genesis(
        OWNER,
        name="dashboard test",
        trainers=[TRAINER.peer_id],
        validators=[VALIDATOR.peer_id],
        params=PARAMS,
        created_at=1,
    )


RUN_ID = run_id_of(genesis())


@dataclass(frozen=True)
class Work:
    """One judged submission: who, which version, accepted or slashed, its reward (0..1)."""

    worker: NodeKey
    version: int
    accepted: bool
    reward: float = 0.5
    reasons: tuple[str, ...] = ()
    peer_name: str | None = None
    """What the ledger names as the worker (default: the worker's peer ID)."""


def submission(
    worker: NodeKey, run_id: str, version: int, counter: int
) -> Signed[RolloutSubmission]:
    sample = Sample(f"p{counter}", (1, 2, 3), counter, (), "stop")
    return sign(
        RolloutSubmission(run_id, version, counter, (f"p{counter}",), (sample,), 1000 + counter),
        worker,
    )


def build(
    path: Path, work: Sequence[Work], *, evidence: bool = True, batch: int = 50_000
) -> LedgerStore:
    """Write ``work`` into a new ledger at ``path`` and return the open store."""
    g = genesis()
    run_id = run_id_of(g)
    store = LedgerStore(path, g)
    kept = EvidenceStore.beside(path) if evidence else None
    events: list[Signed[LedgerEvent]] = []
    verdicts: list[Signed[Verdict]] = []
    for counter, w in enumerate(work):
        if evidence:
            sub = submission(w.worker, run_id, w.version, counter)
            subject = sub.id
        else:  # ids only (a big ledger for the benchmark): no submission to sign
            subject = hashlib.sha256(b"submission %d" % counter).digest()
        peer = w.peer_name or w.worker.peer_id
        rewards = (round(w.reward * REWARD_SCALE),) if w.accepted else ()
        verdict = sign(
            Verdict(
                run_id,
                subject,
                peer,
                w.accepted,
                "none" if w.accepted else "hard",
                w.reasons,
                rewards,
                2000 + counter,
                {},
                w.version,
                counter,
            ),
            VALIDATOR,
        )
        verdicts.append(verdict)
        if kept is not None:
            kept.put(sub.raw, RolloutSubmission.KIND, pinned=True)
            kept.put(verdict.raw, Verdict.KIND, pinned=True)
        kind = "credit" if w.accepted else "slash"
        amount = PARAMS.credit_per_sample * len(rewards) if w.accepted else PARAMS.slash_amount
        events.append(
            sign(LedgerEvent(run_id, kind, peer, amount, verdict.id, 3000 + counter), VALIDATOR)  # type: ignore[arg-type]
        )
        if len(events) >= batch:
            store.add(events, verdicts)
            events, verdicts = [], []
    if events:
        store.add(events, verdicts)
    if kept is not None:
        kept.close()
    return store

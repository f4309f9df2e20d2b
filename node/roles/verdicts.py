"""Turning a judgement into signed records: the Verdict, the ledger events, and the evidence.

Each event cites the verdict by id (the contract in ``swarm.ledger``): a credit of
``credit_per_sample`` per accepted sample, a slash of ``slash_amount`` for a hard rejection (an
equivocation's slash names the other submission in ``related``), and, when the judgement
contradicts another validator's accepting verdict, a ``dispute`` of amount 0 naming it. The
fold counts one credit and one slash per assignment, so a validator that restarts mid-verdict
and signs again, or a second validator judging the same assignment, never pays twice.

Evidence goes to the content-addressed ``EvidenceStore``, the verdict first into the ledger (the
rules read it). What a slash or a dispute rests on is pinned, charged to the worker within the
store's per-peer and total budgets (``swarm.evidence``: a first slash is always kept in full;
``earned`` says whether the worker had accepted work, which decides who yields past the total);
accepted work and soft rejections are kept unpinned (the trainer hand-off, proof bundles).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from node.roles.judge import Judgement
from swarm.evidence import EvidenceStore
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import LedgerEvent, RolloutSubmission, RunParams, Signed, Verdict, sign


@dataclass(frozen=True)
class Recorded:
    verdict: Signed[Verdict]
    events: list[Signed[LedgerEvent]]


def record_judgement(
    store: LedgerStore,
    evidence: EvidenceStore,
    key: NodeKey,
    submission: Signed[RolloutSubmission],
    judgement: Judgement,
    params: RunParams,
    *,
    related: Sequence[Signed[RolloutSubmission]] = (),
    disputed: Signed[Verdict] | None = None,
    now_ms: int | None = None,
    earned: bool = True,
    hand_to: Sequence[str] = (),
) -> Recorded:
    """Sign the verdict and its ledger events, keep the evidence, store verdict and events;
    return them to gossip. ``related``: the other submission of an equivocation; ``disputed``:
    another validator's accepting verdict on this submission that this judgement rejects;
    ``hand_to``: the trainers accepted work goes to, queued in the outbox with the verdict."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    verdict = sign(judgement.verdict(submission, now), key)
    run_id = submission.message.run_id
    worker = submission.signer
    events: list[Signed[LedgerEvent]] = []
    if judgement.accepted:
        amount = params.credit_per_sample * len(submission.message.samples)
        events.append(sign(LedgerEvent(run_id, "credit", worker, amount, verdict.id, now), key))
    elif judgement.severity == "hard":
        slash = LedgerEvent(
            run_id,
            "slash",
            worker,
            params.slash_amount,
            verdict.id,
            now,
            related=tuple(r.id for r in related),
        )
        events.append(sign(slash, key))
    if disputed is not None and not judgement.accepted:
        dispute = LedgerEvent(
            run_id, "dispute", disputed.signer, 0, verdict.id, now, related=(disputed.id,)
        )
        events.append(sign(dispute, key))
    if judgement.accepted or judgement.severity != "none":
        pinned = judgement.severity == "hard" or disputed is not None
        kept: list[Signed[Any]] = [submission, verdict, *related]
        for signed in [*kept, disputed] if disputed is not None else kept:
            evidence.put(
                signed.raw, signed.envelope.kind, pinned=pinned, peer=worker, earned=earned
            )
    # The verdict first (the rules read it), with its hand-off in the same transaction.
    store.add(events, verdicts=[verdict], hand_to=hand_to if judgement.accepted else ())
    return Recorded(verdict, events)

"""Turning a judgement into signed records: the Verdict, the ledger events, and the evidence.

One credit per accepted submission (``credit_per_sample`` per sample) and one slash per hard
rejection, each with the submission id as evidence: the ledger's fold counts an (event, peer,
evidence) once, so a validator that restarts mid-verdict and signs again never pays twice.
Rejections keep the worker's signed submission and the verdict as evidence, with any earlier
submission it replays, so that anyone holding the policy version can replay the decision.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from node.roles.judge import Judgement
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import LedgerEvent, RolloutSubmission, RunParams, Signed, Verdict, sign


@dataclass(frozen=True)
class Recorded:
    verdict: Signed[Verdict]
    events: list[Signed[LedgerEvent]]


def record_judgement(
    store: LedgerStore,
    key: NodeKey,
    submission: Signed[RolloutSubmission],
    judgement: Judgement,
    params: RunParams,
    *,
    related: list[Signed[RolloutSubmission]] | None = None,
    now_ms: int | None = None,
) -> Recorded:
    """Sign the verdict and its ledger events, store evidence and events; return them to gossip."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    verdict = sign(judgement.verdict(submission, now), key)
    events: list[Signed[LedgerEvent]] = []
    run_id = submission.message.run_id
    if judgement.accepted:
        amount = params.credit_per_sample * len(submission.message.samples)
        events.append(
            sign(LedgerEvent(run_id, "credit", submission.signer, amount, submission.id, now), key)
        )
    elif judgement.severity == "hard":
        events.append(
            sign(
                LedgerEvent(
                    run_id, "slash", submission.signer, params.slash_amount, submission.id, now
                ),
                key,
            )
        )
    if judgement.accepted or judgement.severity != "none":
        # Accepted work is kept too, so that a bundle can be exported for any credit.
        store.add_evidence("submission", submission.id, submission.raw)
        store.add_evidence("verdict", submission.id, verdict.raw)
        for earlier in related or []:
            store.add_evidence("submission", submission.id, earlier.raw)
        store.add_verdict(verdict)
    store.add(events)
    return Recorded(verdict, events)

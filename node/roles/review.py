"""What a validator does with the other validators' decisions (their gossiped verdicts and
ledger events): validators check each other.

Decisions this module owns:
- Every verdict of another validator is a request claim (``ClaimBook.note``): a later copy of
  its assignment is refused here, not judged.
- Equivocation after the fact: when another validator's verdict names a submission of an
  assignment that this validator judged under a different submission (two copies judged at the
  same moment, before either verdict was gossiped), this validator holds one envelope, fetches
  the other by the evidence protocol and slashes the equivocation. The fold counts one slash
  per assignment, so two validators doing this at once cost the worker one slash.
- Evidence of every slash and dispute it learns of is fetched from the accuser (then any
  holder) and pinned (``EvidenceService.keep``), so each slash has at least two holders.
- Re-judging: each accepting verdict of another validator is drawn with probability
  ``rejudge_share`` (a genesis parameter); the submission is fetched by the evidence protocol
  (kept unpinned: this is the sample of credits every validator keeps) and judged again on its
  own policy version. A hard rejection becomes this validator's verdict, a slash of the worker
  and a ``dispute`` of the disputed verdict (``Validator.rejudge``). A soft disagreement (honest
  hardware near a threshold) is counted, not disputed.
- Work comes from the gossip handler through a bounded queue (``QUEUE_SIZE``): when the
  validator cannot keep up, draws are dropped and counted (a queue's retention policy), never
  allowed to hold up gossip or the validator's own submissions (it judges them first: both take
  the validator's one engine lock, and a re-judge waits its turn).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from node.roles.evidence import cited
from swarm.ledger import EQUIVOCATION
from swarm.messages import LedgerEvent, RolloutSubmission, Signed, Verdict

if TYPE_CHECKING:
    from node.roles.claims import ClaimBook
    from node.roles.evidence import EvidenceService
    from node.roles.judge import Judgement
    from node.runtime import Node
    from swarm.ledger import LedgerStore
    from swarm.messages import RunParams


class Validator(Protocol):
    """What peer review needs of its validator (``node.roles.validator.Validator``, which
    imports this module: the review depends on this shape, not on that class)."""

    @property
    def node(self) -> Node: ...
    @property
    def params(self) -> RunParams: ...
    @property
    def claims(self) -> ClaimBook: ...
    @property
    def evidence(self) -> EvidenceService: ...
    @property
    def ledger(self) -> LedgerStore: ...

    async def rejudge(
        self, submission: Signed[RolloutSubmission], disputed: Signed[Verdict]
    ) -> Judgement | None: ...

    async def slash_equivocation(self, other: Signed[RolloutSubmission]) -> bool: ...


log = logging.getLogger(__name__)

QUEUE_SIZE = 256


@dataclass
class ReviewStats:
    verdicts_seen: int = 0
    evidence_kept: int = 0
    rejudged: int = 0
    agreed: int = 0
    disputed: int = 0
    soft_disagreements: int = 0
    skipped: int = 0
    """Drawn but not re-judged: the queue was full, or the submission or its weights not held."""
    equivocations: int = 0


@dataclass(frozen=True)
class _Task:
    kind: str  # "keep" | "rejudge" | "equivocation"
    signed: Signed[Any]


class PeerReview:
    def __init__(self, validator: Validator, *, rng: random.Random | None = None) -> None:
        self.validator = validator
        self.node = validator.node
        self.share = validator.params.rejudge_share
        self.rng = rng or random.Random()
        self.stats = ReviewStats()
        self._send, self._receive = trio.open_memory_channel[_Task](QUEUE_SIZE)

    async def run(self) -> None:
        self.node.subscribe_ledger(self._on_gossip)
        async with self._receive:
            async for task in self._receive:
                try:
                    await self._do(task)
                except Exception:  # one bad item must not stop the review of the rest
                    log.exception("review of %s failed", task.signed.id.hex()[:16])

    def _on_gossip(self, signed: Signed[Any]) -> None:
        if signed.signer == self.node.peer_id:
            return
        message = signed.message
        if isinstance(message, Verdict):
            self.stats.verdicts_seen += 1
            self.validator.claims.note(signed)
            if self._equivocates(signed):
                self._queue("equivocation", signed)
            elif message.accepted and self.share > 0 and self.rng.random() < self.share:
                self._queue("rejudge", signed)
            elif message.severity == "hard":
                self._queue("keep", signed)
        elif isinstance(message, LedgerEvent) and message.event in ("slash", "dispute"):
            self._queue("keep", signed)

    def _queue(self, kind: str, signed: Signed[Any]) -> None:
        try:
            self._send.send_nowait(_Task(kind, signed))
        except trio.WouldBlock:
            self.stats.skipped += 1

    def _equivocates(self, verdict: Signed[Verdict]) -> bool:
        """True when ``verdict`` judges another submission of an assignment we judged."""
        v = verdict.message
        if EQUIVOCATION in v.reasons:
            return False  # an equivocation already slashed
        me = self.node.peer_id
        claims = self.validator.claims.of(v.worker, v.policy_version, v.counter)
        return any(c.validator == me and c.submission != v.submission_id for c in claims)

    def _accused(self, signed: Signed[Any]) -> tuple[str | None, bool]:
        """Whom a slash's or dispute's evidence is charged to (``swarm.evidence`` budgets), and
        whether that worker had accepted work before it: its balance back before one slash."""
        message = signed.message
        peer = message.worker if isinstance(message, Verdict) else getattr(message, "peer", None)
        if not isinstance(peer, str):
            return None, True
        p = self.validator.params
        return peer, self.validator.ledger.balance(peer) + p.slash_amount > p.initial_balance

    async def _do(self, task: _Task) -> None:
        evidence = self.validator.evidence
        signed = task.signed
        if task.kind == "keep":
            accused, earned = self._accused(signed)
            if isinstance(signed.message, Verdict):
                evidence.store.put(
                    signed.raw, signed.envelope.kind, pinned=True, peer=accused, earned=earned
                )
            held = await evidence.keep(
                cited(signed), [signed.signer], pinned=True, accused=accused, earned=earned
            )
            self.stats.evidence_kept += len(held)
            return
        verdict: Signed[Verdict] = signed
        got = await evidence.fetch(verdict.message.submission_id, [verdict.signer])
        if got is None or not isinstance(got.message, RolloutSubmission):
            self.stats.skipped += 1
            return
        submission: Signed[RolloutSubmission] = got
        if submission.id != verdict.message.submission_id:
            self.stats.skipped += 1
            return
        if task.kind == "equivocation":
            if await self.validator.slash_equivocation(submission):
                self.stats.equivocations += 1
            return
        evidence.store.put(submission.raw, submission.envelope.kind, pinned=False)
        evidence.store.put(verdict.raw, verdict.envelope.kind, pinned=False)
        judgement = await self.validator.rejudge(submission, verdict)
        if judgement is None:
            self.stats.skipped += 1
            return
        self.stats.rejudged += 1
        if judgement.accepted:
            self.stats.agreed += 1
        elif judgement.severity == "hard":
            self.stats.disputed += 1
            log.warning(
                "validator %s accepted work that replays to a hard rejection: disputed (%s)",
                verdict.signer[-8:],
                "; ".join(judgement.reasons)[:160],
            )
        else:
            self.stats.soft_disagreements += 1

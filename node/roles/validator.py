"""The validator role: judge submissions, sign verdicts and ledger events, gossip them, and hand
accepted samples to the trainers.

Submissions arrive on ``/swarm-node/<run>/submit/1``; the answer is the signed Verdict. A
submission passes each room once (``handle``): the precheck (no model), the assignment's claims
(``node.roles.claims``: shared with the other validators through their gossiped verdicts), then
the model, one at a time off the event loop on the engine holding the submission's policy
version (fetched through SHARDCAST when missing). The precheck derives the assignment from the
manifest id of the submission's version (``PolicyFeed.manifests``: the window's versions known
here); every announcement the node accepts is kept, pinned, in the evidence store (kind
``policy-announcement``), so an auditor of this ledger derives the same assignments. A
submission delivered twice gets its stored verdict again; a copy judged by another validator is
refused, not judged; a different signed submission of a claimed assignment is an equivocation,
slashed with both envelopes as evidence (the other one fetched by the evidence protocol when
only its verdict is known here). Accepted work goes to every trainer as the pair (submission,
verdict): both signed, so a trainer trusts neither this node nor the wire. What other validators
decide is read by ``node.roles.review``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import trio

from node.compute.engine import Engine
from node.compute.healing import EngineHealer
from node.policy_feed import PolicyFeed
from node.roles.admission import NewcomerShare, PeerRateLimit
from node.roles.cheats import Rogue
from node.roles.claims import Claim, ClaimBook
from node.roles.evidence import EvidenceService
from node.roles.judge import JudgeContext, Judgement, decide, equivocation
from node.roles.review import PeerReview
from node.roles.verdicts import Recorded, record_judgement
from node.run import TaskSource, suite_for
from node.runtime import Node
from swarm.errors import EngineError, NetworkError, RequestTimeout, SwarmError, ValidationError
from swarm.ledger import Balances, LedgerStore
from swarm.ledger.training import TrainingStore
from swarm.messages import (
    PolicyAnnouncement,
    RolloutSubmission,
    SampleReceipt,
    Signed,
    Verdict,
    decode,
)
from swarm.net.names import SAMPLES, SUBMIT
from swarm.net.protocols import SAMPLES_LIMITS, SUBMIT_LIMITS

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_FIRST_S = 1.0  # outbox retry after a failed hand-off, doubling up to RETRY_MAX_S
RETRY_MAX_S = 8.0
AWAY_S = 5.0
"""How long a trainer found with no stream (dead or restarting) is passed over in hand-offs."""
DEAD_AFTER_REFUSALS = 5
"""A trainer that refuses one hand-off this many times (reachable, answering, saying no) makes it
a dead letter: no longer tried, kept in the outbox and shown in ``status`` (``dead_letters``)."""
SUBMIT_RATE_PER_S = 2.0  # per peer; an honest worker submits once per generation (seconds)
SUBMIT_BURST = 8
PULL_EVERY_S = 1.0  # at most one policy pull prompted by submissions, per this interval


class _JudgedAlready(Exception):
    """The submission was judged here while it waited for the judge lock: its verdict."""

    def __init__(self, verdict: Signed[Verdict]) -> None:
        super().__init__("judged already")
        self.verdict = verdict


def trainer_order(submission_id: bytes, trainers: Collection[str]) -> list[str]:
    """Rendezvous hashing: the trainers in the order a submission is offered to them. Every
    validator computes the same order, and a trainer's death moves only its own share."""
    return sorted(trainers, key=lambda t: hashlib.sha256(submission_id + t.encode()).digest())


@dataclass
class ValidatorStats:
    judged: int = 0
    accepted: int = 0
    rejected_soft: int = 0
    rejected_hard: int = 0
    refused: int = 0
    """Not judged at all: another run, a banned worker, a copy judged elsewhere."""
    judge_seconds: float = 0.0
    newcomer_judge_seconds: float = 0.0
    """Of ``judge_seconds``, on work of newcomers (no accepted work yet): where a flood of fresh
    keys spends the validator's time (``bench/flood.py``)."""
    refusals: dict[str, int] = field(default_factory=dict)
    """Refusals before the judge by the check that decided (``Judgement.check``, or
    ``newcomer share``)."""

    def refuse(self, check: str) -> None:
        self.refusals[check] = self.refusals.get(check, 0) + 1
        self.refused += 1


class Validator:
    def __init__(
        self,
        node: Node,
        feed: PolicyFeed,
        engine: Engine,
        ledger: LedgerStore,
        evidence: EvidenceService,
        claims: ClaimBook,
        *,
        rogue: Rogue | None = None,
        suite: TaskSource | None = None,
    ) -> None:
        self.node = node
        self.feed = feed
        self.engine = engine
        self.ledger = ledger
        self.evidence = evidence
        self.claims = claims
        self.rogue = rogue
        self.params = node.config.genesis.message.params
        self.suite = suite or suite_for(node.config.genesis.message)
        self.stats = ValidatorStats()
        self._loaded: int | None = None
        self._lock = trio.Lock()
        self._newcomer_slot = trio.Lock()
        self._handoff = trio.Event()
        self._away: dict[str, float] = {}
        """Trainers found with no stream, and until when their share goes to the next one."""
        self._last_pull = -PULL_EVERY_S
        self.review = PeerReview(self)
        self.healer = EngineHealer(engine, on_give_up=self._withdraw)
        self.rate_limit = PeerRateLimit(SUBMIT_RATE_PER_S, SUBMIT_BURST)
        self.newcomers = NewcomerShare()
        self.refusals: dict[tuple[bytes, str], int] = {}
        """Refused hand-offs (verdict id, trainer) -> refusals so far, in memory."""
        self.dead_letters: dict[tuple[bytes, str], str] = {}
        self.training: TrainingStore | None = None
        """Where the trainers' receipts of this validator's hand-offs are kept (set by launch)."""
        """Hand-offs given up on -> the trainer's last answer (retried after a restart)."""

    async def run(self) -> None:
        """Serve submissions, and fetch every announced version ahead of the work it brings."""
        server = self.node.handle(SUBMIT, self._on_submit, SUBMIT_LIMITS)
        server.trusted = self.has_history  # reserved submit slots: earned, not given
        newest = self.node.policy.newest
        if newest is not None:
            self._keep_announcement(newest)
        self.node.policy.on_change(self._keep_announcement)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._deliver)
            nursery.start_soon(self.review.run)
            await self._follow_policy()

    def _keep_announcement(self, announcement: Signed[PolicyAnnouncement]) -> None:
        """Keep a trainer's announcement (version -> manifest id) for auditors: the assignment
        of a run with a quota mixes the manifest id. Charged to nobody, like a policy conflict:
        one small envelope per version, signed by a genesis trainer."""
        self.evidence.store.put(announcement.raw, PolicyAnnouncement.KIND, pinned=True)

    async def _follow_policy(self) -> None:
        wanted = 0
        while True:
            announcement = await self.node.policy.wait_for(wanted)
            try:
                await self.feed.fetch(announcement)
            except SwarmError as exc:
                log.warning("fetching policy v%d failed: %s", announcement.message.version, exc)
                await trio.sleep(1.0)  # back off, then try the newest announcement again
                continue
            wanted = announcement.message.version + 1
            # Retention: claims matter only while their version can still be submitted.
            self.claims.prune(announcement.message.version - self.params.async_level)

    async def _on_submit(self, peer: str, body: bytes) -> bytes:
        self.rate_limit.check(peer)  # before anything else, even the signature check
        submission = decode(body, RolloutSubmission)
        if submission.signer != peer:
            raise ValidationError("a submission must come from the worker that signed it")
        known = self.node.policy.version
        now = time.monotonic()
        ahead = known is None or submission.message.policy_version > known
        if (
            ahead
            and now - self._last_pull >= PULL_EVERY_S
            and submission.message.run_id == self.node.run_id
            and not self.ledger.balances().banned(peer)
        ):
            # Work of a version we have not heard of: gossip lost its announcement here. The
            # worker holds it (it generated on it), so ask it, then the trainers; without this
            # every submission is refused as outside the window and no new version ever comes.
            # At most once a second: anyone can sign a submission naming version 10**9.
            self._last_pull = now
            trainers = self.node.peers_by_role().get("trainer", [])
            await self.feed.pull([peer, *trainers])
        return (await self.handle(submission)).raw

    def _context(self, newest_version: int | None = None) -> JudgeContext:
        newest = self.node.policy.newest
        if newest_version is None:
            newest_version = -1 if newest is None else newest.message.version
        window = range(max(0, newest_version - self.params.async_level), newest_version + 1)
        return JudgeContext(
            self.node.run_id,
            self.params,
            self.suite,
            newest_version,
            self.ledger.balances(),
            self.feed.manifests(window) if self.params.quota else {},
        )

    async def handle(self, submission: Signed[RolloutSubmission]) -> Signed[Verdict]:
        """Ask the judge (``decide``: the precheck, the claims, the model, in that order), then
        record: sign, store, gossip. What the judge refuses is refused (``ValidationError``,
        counted by check) with nothing claimed, stored or prefilled; a submission delivered
        again gets its verdict again."""
        again = self._verdict_again(submission)
        if again is not None:  # delivered again: the same verdict, no second credit
            return again
        ctx = self._context()
        try:
            async with _Desk(self, submission) as desk:
                judgement = await decide(submission, ctx, desk)
                if judgement.refused:
                    self.stats.refuse(judgement.check)
                    raise ValidationError(
                        f"refused ({judgement.check}): {'; '.join(judgement.reasons)}"
                    )
                if self.rogue is not None and judgement.check == "model":
                    judgement = self.rogue(submission, judgement, ctx)
                # Accepted work enters the outbox in the verdict's own transaction: a kill at
                # any point loses neither. The outbox holds the verdict's id; the verdict names
                # the submission, which goes to one trainer (the first of its rendezvous order;
                # ``_deliver`` moves on). Recorded under the judge lock: a second copy meets
                # this verdict, never a second judgement.
                trainers = trainer_order(submission.id, self.node.config.genesis.message.trainers)
                recorded = self._record(submission, judgement, hand_to=trainers[:1])
        except _JudgedAlready as judged:
            return judged.verdict
        self._count(judgement)
        await self.publish(recorded)
        if judgement.accepted:
            self._handoff.set()
        return recorded.verdict

    def has_history(self, peer: str) -> bool:
        """A worker with accepted work to its name (its balance above a newcomer's)."""
        return self.ledger.balance(peer) > self.params.initial_balance

    def judge_queue(self) -> int:
        """Submissions past the precheck waiting for the judge lock."""
        return int(self._lock.statistics().tasks_waiting)

    def _verdict_again(self, submission: Signed[RolloutSubmission]) -> Signed[Verdict] | None:
        """This validator's verdict on ``submission`` when it judged it already."""
        s = submission.message
        for claim in self.claims.of(submission.signer, s.policy_version, s.counter):
            if claim.submission == submission.id and claim.validator == self.node.peer_id:
                if claim.verdict is None:
                    continue
                raw = self.evidence.store.get(claim.verdict) or self.ledger.verdict_raw(
                    claim.verdict
                )
                if raw is not None:
                    return decode(raw, Verdict)
        return None

    async def rejudge(
        self, submission: Signed[RolloutSubmission], disputed: Signed[Verdict]
    ) -> Judgement | None:
        """Judge again work that another validator accepted (``disputed``), as of its own
        policy version and with a ledger where nobody is banned (a worker slashed since must
        still be judged on this work). A hard rejection is signed and gossiped with a slash and
        a dispute; returns the judgement, or None when the weights are not held here."""
        s = submission.message
        p = self.params
        if self.feed.path_of(s.policy_version) is None:
            return None
        ctx = JudgeContext(
            self.node.run_id,
            p,
            self.suite,
            s.policy_version,
            Balances(p.initial_balance, p.ban_threshold),
            self.feed.manifests(range(s.policy_version, s.policy_version + 1)),
        )
        async with _Desk(self, submission, review=True) as desk:
            judgement = await decide(submission, ctx, desk, claims=False)
            if judgement.accepted or judgement.severity != "hard":
                return judgement
            recorded = self._record(submission, judgement, disputed=disputed)
        await self.publish(recorded)
        return judgement

    async def slash_equivocation(self, other: Signed[RolloutSubmission]) -> bool:
        """``other`` was judged elsewhere for an assignment this validator judged under another
        submission: slash the equivocation with both envelopes. False when nothing is to be
        done (the assignment's slash is known, or our envelope is gone)."""
        me = self.node.peer_id
        s = other.message
        async with self._lock:
            claims = self.claims.of(other.signer, s.policy_version, s.counter)
            for claim in claims:
                facts = None if claim.verdict is None else self.ledger.verdict_facts(claim.verdict)
                if facts is not None and facts.equivocation:
                    return False
            mine = next((c for c in claims if c.validator == me and c.submission != other.id), None)
            raw = None if mine is None else self.evidence.store.get(mine.submission)
            if raw is None:
                return False
            judgement = equivocation(other, decode(raw, RolloutSubmission))
            if judgement is None:
                return False
            recorded = self._record(other, judgement)
        self._count(judgement)
        await self.publish(recorded)
        return True

    def _record(
        self,
        submission: Signed[RolloutSubmission],
        judgement: Judgement,
        *,
        disputed: Signed[Verdict] | None = None,
        hand_to: Sequence[str] = (),
    ) -> Recorded:
        """Sign and store the verdict, its events and evidence; the verdict is our claim."""
        earned = self.has_history(submission.signer)  # before its slash lowers the balance
        recorded = record_judgement(
            self.ledger,
            self.evidence.store,
            self.node.key,
            submission,
            judgement,
            self.params,
            related=list(judgement.related),
            disputed=disputed,
            earned=earned,
            hand_to=hand_to,
        )
        self.claims.note(recorded.verdict)
        return recorded

    async def _on_engine(
        self, submission: Signed[RolloutSubmission], work: Callable[[Engine], Judgement]
    ) -> Judgement | None:
        """The model's part of the judgement (``Desk.on_engine``; the caller holds the judge
        lock). A dead engine child is restarted (``EngineHealer``) and the submission answered
        with an error: its claim holds no verdict, so the worker's resend is judged."""
        try:
            if not await self._load(submission.message.policy_version):
                return None
            return await trio.to_thread.run_sync(work, self.engine)
        except EngineError as exc:
            if await self.healer.recover(exc):
                raise EngineError(
                    "the validator's engine died while judging and was restarted; send again"
                ) from exc
            raise EngineError(f"this validator no longer judges: {self.healer.failed}") from exc

    async def _withdraw(self, why: str) -> None:
        """The engine cannot be brought back: stop advertising the validator role."""
        await self.node.membership.withdraw()

    async def _load(self, version: int) -> bool:
        """Put ``version`` on the engine (caller holds the judge lock); False when not held
        here (the newest announced version is fetched)."""
        if version != self._loaded:
            path = self.feed.path_of(version)
            newest = self.node.policy.newest
            if path is None and newest is not None and newest.message.version == version:
                path = await self.feed.fetch(newest)
            if path is None:
                return False
            await trio.to_thread.run_sync(self.engine.load_weights, str(path))
            self._loaded = version
        return True

    async def on_version(self, version: int, work: Callable[[Engine], T]) -> T | None:
        """Run ``work(engine)`` in a thread with ``version`` loaded, under the judge lock, so
        it never interleaves with judging (the held-out evaluation, ``node.roles.evaluator``);
        None when the version's weights are not held here."""
        async with self._lock:
            if not await self._load(version):
                return None
            return await trio.to_thread.run_sync(work, self.engine)

    def _count(self, judgement: Judgement) -> None:
        self.stats.judged += 1
        if judgement.accepted:
            self.stats.accepted += 1
        elif judgement.severity == "hard":
            self.stats.rejected_hard += 1
        elif judgement.severity == "soft":
            self.stats.rejected_soft += 1
        else:
            self.stats.refused += 1

    async def publish(self, recorded: Recorded) -> None:
        """Gossip the verdict, then its events (a replica adds an event once its verdict is
        held); best effort: ledger sync repairs what gossip loses."""
        batch: list[Signed[Any]] = [recorded.verdict, *recorded.events]
        for signed in batch:
            try:
                await self.node.publish_ledger(signed)
            except SwarmError as exc:
                log.warning("could not gossip %s: %s", signed.envelope.kind, exc)

    async def _deliver(self) -> None:
        """Hand accepted work to the trainers from the durable outbox, retrying until each
        trainer has taken it: a trainer that was down when the verdict was made gets it later."""
        backoff = RETRY_FIRST_S
        while True:
            # Dead letters stay in the outbox: read past them, so they never hold up the rest.
            pending = [
                p
                for p in self.ledger.pending_handoffs(64 + len(self.dead_letters))
                if p not in self.dead_letters
            ]
            # Trainers with no stream (dead, or restarting) for AWAY_S: the next of each
            # submission's order takes their share meanwhile, without waiting on a backoff.
            now = trio.current_time()
            self._away = {t: until for t, until in self._away.items() if until > now}
            away = set(self._away)
            slow: set[str] = set()  # trainers that timed out: asked again next round only
            failed = False  # work is left that no trainer took: retry after a backoff
            newly_away = False
            for verdict_id, row_trainer in pending:
                held = self._handoff_pair(verdict_id)
                if held is None:
                    log.warning("accepted work %s is no longer held; not handed off", verdict_id)
                    self.ledger.mark_handed(verdict_id, row_trainer)
                    continue
                submission_id, pair = held
                # Each submission goes to one trainer (each sample trains once): the first of
                # its rendezvous order that is not found down this round.
                order = trainer_order(submission_id, self.node.config.genesis.message.trainers)
                trainer = next((t for t in order if t not in away), None)
                if trainer is None or trainer in slow:
                    failed = True
                    continue
                body = msgpack.packb(pair, use_bin_type=True)
                try:
                    answer = await self.node.request(trainer, SAMPLES, body, SAMPLES_LIMITS)
                except SwarmError as exc:
                    if type(exc) is NetworkError:
                        # No stream at all: the work was not handed, so the next trainer in
                        # its order may take it (the outbox is read again at once, without
                        # this one). After a timeout the trainer may hold it: that one is
                        # asked again, never a second trainer.
                        away.add(trainer)
                        self._away[trainer] = trio.current_time() + AWAY_S
                        newly_away = True
                        log.warning(
                            "trainer %s did not take accepted work (its share goes to the next"
                            " trainer for %.0f s): %s",
                            trainer[-8:],
                            AWAY_S,
                            exc,
                        )
                        await self.node.forget_peer(trainer)
                        continue
                    failed = True
                    log.warning(
                        "trainer %s did not take accepted work (%d waiting; retry in %.0f s): %s",
                        trainer[-8:],
                        len(pending),
                        backoff,
                        exc,
                    )
                    if isinstance(exc, RequestTimeout):
                        # One attempt (and one log line) per trainer per round, not one per
                        # waiting submission.
                        slow.add(trainer)
                    else:  # a refusal of one item does not hold up the rest
                        self._refused_handoff((verdict_id, row_trainer), exc)
                    continue
                self._keep_receipt(answer, trainer, verdict_id)
                self.ledger.mark_handed(verdict_id, row_trainer)
                self.refusals.pop((verdict_id, row_trainer), None)
            if failed:
                await trio.sleep(backoff)  # retry later: the outbox keeps the work
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            if newly_away:
                continue  # what was offered to it goes to the next trainer now
            backoff = RETRY_FIRST_S
            if len(pending) < 64:
                await self._handoff.wait()
                self._handoff = trio.Event()

    def _keep_receipt(self, answer: bytes, trainer: str, verdict_id: bytes) -> None:
        """Keep the trainer's signed receipt of a hand-off (the training audit's coverage
        check rests on it); a trainer from before receipts answers ``ok``."""
        if self.training is None or answer in (b"ok", b"too old"):
            return
        try:
            receipt = decode(answer, SampleReceipt)
            r = receipt.message
            if receipt.signer != trainer or r.run_id != self.node.run_id:
                raise ValidationError(f"a receipt signed by {receipt.signer[-8:]} for {r.run_id}")
            if r.verdict_id != verdict_id:
                raise ValidationError("a receipt for another verdict")
        except SwarmError as exc:
            log.warning(
                "trainer %s answered a hand-off with no valid receipt: %s", trainer[-8:], exc
            )
            return
        self.training.add_receipt(receipt)

    def _refused_handoff(self, item: tuple[bytes, str], exc: SwarmError) -> None:
        """Count a trainer's refusal of one hand-off; past ``DEAD_AFTER_REFUSALS`` it is dead."""
        self.refusals[item] = self.refusals.get(item, 0) + 1
        if self.refusals[item] >= DEAD_AFTER_REFUSALS:
            del self.refusals[item]
            self.dead_letters[item] = str(exc)
            log.error(
                "trainer %s refused accepted work %s %d times (%s); no longer tried, kept in"
                " the outbox (status: dead_letters)",
                item[1][-8:],
                item[0].hex()[:16],
                DEAD_AFTER_REFUSALS,
                exc,
            )

    def dead_letter_status(self) -> list[dict[str, str]]:
        return [
            {"verdict": v.hex(), "trainer": t, "last_answer": why}
            for (v, t), why in self.dead_letters.items()
        ]

    def _handoff_pair(self, verdict_id: bytes) -> tuple[bytes, list[bytes]] | None:
        """The submission's id and the [submission, verdict] envelopes of accepted work, from
        the evidence store."""
        verdict = self.evidence.store.get(verdict_id)
        if verdict is None:
            return None
        submission_id = decode(verdict, Verdict).message.submission_id
        submission = self.evidence.store.get(submission_id)
        return None if submission is None else (submission_id, [submission, verdict])


class _Desk:
    """One submission's way through the judge (``node.roles.judge.Desk``): the validator's
    I/O, and the locks the judgement holds until the validator has recorded it."""

    def __init__(
        self, validator: Validator, submission: Signed[RolloutSubmission], *, review: bool = False
    ) -> None:
        self.validator = validator
        self.submission = submission
        self.review = review
        """Re-judging work another validator credited: no newcomer's share, no claim."""
        self.newcomer = False
        self._held = AsyncExitStack()

    @property
    def me(self) -> str:
        return self.validator.node.peer_id

    async def __aenter__(self) -> _Desk:
        await self._held.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        return await self._held.__aexit__(*exc)  # type: ignore[arg-type]

    async def admit(self) -> None:
        v = self.validator
        if self.review:
            await self._held.enter_async_context(v._lock)
            return
        if v.healer.failed is not None:
            raise EngineError(f"this validator no longer judges: {v.healer.failed}")
        # Newcomers (no accepted work yet) queue for the judge one at a time, behind a slot of
        # their own, within their share of judge time (``NewcomerShare``): a flood of fresh
        # keys competes with itself, and a worker with a history waits behind at most one
        # newcomer's judgement, and not often.
        self.newcomer = not v.has_history(self.submission.signer)
        if self.newcomer:
            await self._held.enter_async_context(v._newcomer_slot)
            try:
                v.newcomers.check()
            except ValidationError:
                v.stats.refuse("newcomer share")
                raise
        else:
            v.newcomers.trusted_seen()
        await self._held.enter_async_context(v._lock)
        again = v._verdict_again(self.submission)
        if again is not None:
            raise _JudgedAlready(again)

    def claims(self, submission: Signed[RolloutSubmission]) -> list[Claim]:
        s = submission.message
        return self.validator.claims.of(submission.signer, s.policy_version, s.counter)

    def claim(self, submission: Signed[RolloutSubmission]) -> None:
        s = submission.message
        self.validator.claims.claim(
            submission.signer, s.policy_version, s.counter, submission.id, self.me
        )

    async def fetch(self, claim: Claim) -> Signed[Any] | None:
        return await self.validator.evidence.fetch(claim.submission, [claim.validator])

    async def on_engine(
        self, submission: Signed[RolloutSubmission], work: Callable[[Engine], Judgement]
    ) -> Judgement | None:
        v = self.validator
        started = time.perf_counter()
        try:
            return await v._on_engine(submission, work)
        finally:
            if not self.review:
                took = time.perf_counter() - started
                v.stats.judge_seconds += took
                if self.newcomer:
                    v.stats.newcomer_judge_seconds += took
                    v.newcomers.spend(took)

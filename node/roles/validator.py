"""The validator role: judge submissions, sign verdicts and ledger events, gossip them, and hand
accepted samples to the trainers.

Submissions arrive on ``/swarm-node/<run>/submit/1``; the answer is the signed Verdict. Judging
runs one at a time off the event loop on the engine holding the submission's policy version
(fetched through SHARDCAST when missing). A submission delivered twice gets its stored verdict
again, never a second credit. Accepted work goes to every trainer as the pair (submission,
verdict): both signed, so a trainer trusts neither this node nor the wire.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from node.compute.engine import Engine
from node.policy_feed import PolicyFeed
from node.roles.judge import JudgeContext, Judgement, judge, precheck
from node.roles.verdicts import record_judgement
from node.roles.worker import SUBMIT, SUBMIT_LIMITS
from node.run import suite_for
from node.runtime import Node
from swarm.errors import NetworkError, RequestTimeout, SwarmError, ValidationError
from swarm.ledger import LedgerStore
from swarm.messages import LedgerEvent, RolloutSubmission, Signed, Verdict, decode
from swarm.net import StreamLimits

log = logging.getLogger(__name__)

SAMPLES = "samples"
RETRY_FIRST_S = 1.0  # outbox retry after a failed hand-off, doubling up to RETRY_MAX_S
RETRY_MAX_S = 8.0
PULL_EVERY_S = 1.0  # at most one policy pull prompted by submissions, per this interval
SAMPLES_LIMITS = StreamLimits(
    max_request=RolloutSubmission.MAX_BYTES + Verdict.MAX_BYTES + 4096,
    max_response=1024,
    timeout=30.0,
)


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
    """Not judged at all: another run, or a banned worker."""
    judge_seconds: float = 0.0


class Validator:
    def __init__(self, node: Node, feed: PolicyFeed, engine: Engine, ledger: LedgerStore) -> None:
        self.node = node
        self.feed = feed
        self.engine = engine
        self.ledger = ledger
        self.params = node.config.genesis.message.params
        self.suite = suite_for(node.config.genesis.message)
        self.stats = ValidatorStats()
        self._loaded: int | None = None
        self._lock = trio.Lock()
        self._handoff = trio.Event()
        self._last_pull = -PULL_EVERY_S

    async def run(self) -> None:
        """Serve submissions, and fetch every announced version ahead of the work it brings."""
        self.node.handle(SUBMIT, self._on_submit, SUBMIT_LIMITS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._deliver)
            await self._follow_policy()

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

    async def _on_submit(self, peer: str, body: bytes) -> bytes:
        submission = decode(body, RolloutSubmission)
        if submission.signer != peer:
            raise ValidationError("a submission must come from the worker that signed it")
        known = self.node.policy.version
        now = time.monotonic()
        if (known is None or submission.message.policy_version > known) and (
            now - self._last_pull >= PULL_EVERY_S
        ):
            # Work of a version we have not heard of: gossip lost its announcement here. The
            # worker holds it (it generated on it), so ask it, then the trainers; without this
            # every submission is refused as outside the window and no new version ever comes.
            # At most once a second: anyone can sign a submission naming version 10**9.
            self._last_pull = now
            trainers = self.node.peers_by_role().get("trainer", [])
            await self.feed.pull([peer, *trainers])
        return (await self.handle(submission)).raw

    async def handle(self, submission: Signed[RolloutSubmission]) -> Signed[Verdict]:
        async with self._lock:
            stored = self.ledger.evidence(submission.id, "verdict")
            if stored:
                return decode(stored[0], Verdict)
            s = submission.message
            first = self.ledger.claim_request(
                submission.signer, s.policy_version, s.counter, submission.id
            )
            related = (
                []
                if first is None
                else [
                    decode(raw, RolloutSubmission)
                    for raw in self.ledger.evidence(first, "submission")[:1]
                ]
            )
            newest = self.node.policy.newest
            ctx = JudgeContext(
                self.node.run_id,
                self.params,
                self.suite,
                -1 if newest is None else newest.message.version,
                self.ledger.balances(),
            )
            started = time.perf_counter()
            judgement = await self._judge(submission, ctx, counter_seen=first is not None)
            self.stats.judge_seconds += time.perf_counter() - started
            recorded = record_judgement(
                self.ledger, self.node.key, submission, judgement, self.params, related=related
            )
            if judgement.accepted:
                # In the outbox before any await: a kill after this point loses nothing.
                trainers = trainer_order(submission.id, self.node.config.genesis.message.trainers)
                self.ledger.queue_handoff(submission.id, trainers[:1])
        self._count(judgement)
        await self._publish(recorded.verdict, recorded.events)
        if judgement.accepted:
            self._handoff.set()
        return recorded.verdict

    async def _judge(
        self, submission: Signed[RolloutSubmission], ctx: JudgeContext, *, counter_seen: bool
    ) -> Judgement:
        early = precheck(submission, ctx, counter_seen=counter_seen)
        if early is not None:
            return early
        version = submission.message.policy_version
        if version != self._loaded:
            path = self.feed.path_of(version)
            newest = self.node.policy.newest
            if path is None and newest is not None and newest.message.version == version:
                path = await self.feed.fetch(newest)
            if path is None:
                return Judgement(False, "soft", [f"policy v{version} is not held here"])
            await trio.to_thread.run_sync(self.engine.load_weights, str(path))
            self._loaded = version
        return await trio.to_thread.run_sync(
            lambda: judge(submission, ctx, self.engine, counter_seen=counter_seen)
        )

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

    async def _publish(self, verdict: Signed[Verdict], events: list[Signed[LedgerEvent]]) -> None:
        batch: list[Signed[Any]] = [verdict, *events]
        for signed in batch:
            try:
                await self.node.publish_ledger(signed)
            except SwarmError as exc:  # gossip is best effort; ledger sync repairs it
                log.warning("could not gossip %s: %s", signed.envelope.kind, exc)

    async def _deliver(self) -> None:
        """Hand accepted work to the trainers from the durable outbox, retrying until each
        trainer has taken it: a trainer that was down when the verdict was made gets it later."""
        backoff = RETRY_FIRST_S
        while True:
            pending = self.ledger.pending_handoffs()
            away: set[str] = set()  # trainers with no stream this round: the next one takes
            slow: set[str] = set()  # trainers that timed out: asked again next round only
            failed = False
            for submission_id, row_trainer in pending:
                # Each submission goes to one trainer (each sample trains once): the first of
                # its rendezvous order that is not found down this round.
                order = trainer_order(submission_id, self.node.config.genesis.message.trainers)
                trainer = next((t for t in order if t not in away), None)
                if trainer is None or trainer in slow:
                    continue
                raws = self.ledger.evidence(submission_id, "submission")
                verdicts = self.ledger.evidence(submission_id, "verdict")
                body = msgpack.packb([raws[0], verdicts[0]], use_bin_type=True)
                try:
                    await self.node.request(trainer, SAMPLES, body, SAMPLES_LIMITS)
                except SwarmError as exc:
                    failed = True
                    unreachable = type(exc) is NetworkError or isinstance(exc, RequestTimeout)
                    if type(exc) is NetworkError:
                        # No stream at all: the work was not handed, so the next trainer in
                        # its order may take it. (After a timeout the trainer may hold it:
                        # that one is asked again, never a second trainer.)
                        away.add(trainer)
                    elif unreachable:
                        # One attempt (and one log line) per trainer per round, not one per
                        # waiting submission; a refusal of one item does not hold up the rest.
                        slow.add(trainer)
                    log.warning(
                        "trainer %s did not take accepted work (%d waiting; retry in %.0f s): %s",
                        trainer[-8:],
                        len(pending),
                        backoff,
                        exc,
                    )
                    if type(exc) is NetworkError:  # no stream at all, not a refusal or timeout
                        await self.node.forget_peer(trainer)
                    continue
                self.ledger.mark_handed(submission_id, row_trainer)
            if failed:
                await trio.sleep(backoff)  # retry later: the outbox keeps the work
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            backoff = RETRY_FIRST_S
            if len(pending) < 64:
                await self._handoff.wait()
                self._handoff = trio.Event()

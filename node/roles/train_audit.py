"""A validator's training audits: replay a seeded share of the trainer's steps, check every
record against this validator's receipts, and sign a ``training-dispute`` for what disagrees.

Decisions this module owns:

- **Who audits what.** Each version has one due validator (``train_auditor``); it replays the
  version when its draw (``audit_draw`` of its own signature over the record's id) falls below
  ``train_audit_share``, so the trainer cannot tell in advance which steps are replayed, and the
  swarm replays about that share of all steps once. Every validator checks every record against
  its own receipts (``skipped``): that costs no replay.
- **When.** A record is audited once the version's announcement is accepted (the record is
  gossiped just before it) and after the records before it arrived (``RECORD_WAIT_S`` at most),
  one at a time, in the background: judging never waits for it.
- **No record.** The due validator of an announced version whose record has not arrived
  ``RECORD_WAIT_S`` after the announcement (the record sync runs meanwhile) disputes it as
  ``no-record``.
- **Again, later.** A replay stopped by what may pass (the trainer gave no answer, the weights
  were not fetched yet, a holder of cited work was silent: ``StepAudit.again``) is tried
  ``AUDIT_AGAIN`` more times, ``AGAIN_S`` apart, before ``not-replayed`` is kept; the audits
  of other versions go on meanwhile. A busy swarm otherwise loses coverage to one slow answer.
- **Outcomes** are kept per version in ``training.db`` (``status``: ``training``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import trio

from node.roles.training_audit import Finding, StepAudit, StepAuditor, skipped
from node.runtime import Node
from swarm.errors import SwarmError
from swarm.ledger.training import TrainingStore
from swarm.messages import (
    PolicyAnnouncement,
    Signed,
    TrainingDispute,
    TrainingRecord,
    sign,
    train_auditor,
)
from swarm.messages.training import AUDIT_DRAW_KIND, audit_draw
from swarm.net.records import wall_clock_ms

log = logging.getLogger(__name__)

RECORD_WAIT_S = 60.0
QUEUE = 256
AUDIT_AGAIN = 3
AGAIN_S = 30.0


@dataclass(frozen=True)
class _Again:
    """A record whose replay is tried again (``tries`` made so far)."""

    record: Signed[TrainingRecord]
    tries: int


class TrainingAudits:
    def __init__(self, node: Node, store: TrainingStore, auditor: StepAuditor) -> None:
        self.node = node
        self.store = store
        self.auditor = auditor
        g = node.config.genesis.message
        self.validators = g.validators
        self.share = g.params.train_audit_share
        self.replayed = 0
        self.disputes = 0
        self.last: dict[str, Any] | None = None
        self._send, self._receive = trio.open_memory_channel[Signed[Any] | _Again](QUEUE)

    # -- what arrives ----------------------------------------------------------------------------

    def on_gossip(self, signed: Signed[Any]) -> None:
        if isinstance(signed.message, TrainingRecord):
            try:
                self._send.send_nowait(signed)
            except trio.WouldBlock:
                log.warning("training audit queue full; v%d not audited", signed.message.version)

    def on_policy(self, announcement: Signed[PolicyAnnouncement]) -> None:
        version = announcement.message.version
        if version > 0 and self.share > 0 and self.due(version):
            with contextlib.suppress(trio.WouldBlock):  # a full queue: the record is checked
                self._send.send_nowait(announcement)

    def due(self, version: int) -> bool:
        """Whether this validator is the one due for ``version``."""
        return train_auditor(self.node.run_id, version, self.validators) == self.node.peer_id

    def drawn(self, record: Signed[TrainingRecord]) -> bool:
        """Whether this (due) validator replays ``record``: its own signature draws it."""
        signature = self.node.key.signature(AUDIT_DRAW_KIND, record.id)
        return audit_draw(signature) < self.share

    # -- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        self.node.subscribe_ledger(self.on_gossip)
        self.node.policy.on_change(self.on_policy)
        async with self._receive, trio.open_nursery() as self._later:
            async for item in self._receive:
                version = (item.record if isinstance(item, _Again) else item).message.version
                try:
                    if isinstance(item, _Again):
                        await self._replay(item.record, item.tries)
                    elif isinstance(item.message, TrainingRecord):
                        await self._on_record(item)
                    else:
                        await self._check_recorded(version)
                except SwarmError as exc:
                    log.warning("training audit of v%d failed: %s", version, exc)
                except Exception:  # one bad item must not stop the audits of the rest
                    log.exception("training audit of v%d failed", version)

    async def _on_record(self, record: Signed[TrainingRecord]) -> None:
        r = record.message
        held = self.store.record(r.version)
        if held is not None and held.id == record.id and self.store.audited(r.version):
            return  # audited before a restart (the store keeps what the gate passed)
        with trio.move_on_after(RECORD_WAIT_S):  # the records before it, for the skip check
            while any(
                self.store.record(v) is None for v in range(max(1, r.min_version), r.version)
            ):
                await trio.sleep(1.0)
        await self._check_skips(record)
        if self.due(r.version) and self.drawn(record):
            await self._replay(record, 0)

    async def _replay(self, record: Signed[TrainingRecord], tries: int) -> None:
        r = record.message
        with trio.move_on_after(RECORD_WAIT_S):
            await self.node.policy.wait_for(r.version)
        # Of several trainers' round, one member's gradient is replayed: the draw picks it.
        pick = audit_draw(self.node.key.signature(AUDIT_DRAW_KIND, record.id) + b"member")
        result = await self.auditor.audit(record, pick)
        if result.again and tries < AUDIT_AGAIN:
            log.info(
                "training audit of v%d not replayed (%s); again in %g s",
                r.version,
                result.detail,
                AGAIN_S,
            )
            self._later.start_soon(self._again, _Again(record, tries + 1))
            return
        self.replayed += result.outcome != "not-replayed"
        await self._settle(record, result)

    async def _again(self, item: _Again) -> None:
        await trio.sleep(AGAIN_S)
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            log.warning("training audit queue full; v%d not audited", item.record.message.version)

    async def _check_skips(self, record: Signed[TrainingRecord]) -> None:
        r = record.message
        trained = {
            v
            for rec in self.store.records()
            if rec.message.version <= r.version
            for v in rec.message.verdicts
        }
        receipts = self.store.receipts(r.min_version, r.parent)
        passed = skipped(record, receipts, trained)
        if passed:
            workers = sorted({x.message.worker[-8:] for x in passed})
            await self.dispute(
                record,
                Finding(
                    "skipped-sample",
                    f"v{r.version} trained later work and left out {len(passed)} receipted"
                    f" sample(s) of its window, of worker(s) {', '.join(workers)}",
                    tuple(x.id for x in passed[:8]),
                ),
            )

    async def _check_recorded(self, version: int) -> None:
        with trio.move_on_after(RECORD_WAIT_S):
            while self.store.record(version) is None:
                await trio.sleep(1.0)
        if self.store.record(version) is not None:
            return
        announced = self.node.policy.accepted.get(version)
        trainer = announced.signer if announced is not None else ""
        await self._dispute(
            version,
            trainer,
            b"",
            Finding("no-record", f"v{version} was announced without a training record"),
        )

    async def _settle(self, record: Signed[TrainingRecord], result: StepAudit) -> None:
        r = record.message
        self.last = result.to_json()
        if result.outcome == "disputed":
            for finding in result.findings:
                await self.dispute(record, finding)
        detail = result.detail or "; ".join(f.detail for f in result.findings)
        self.store.note_audit(
            r.version,
            result.outcome if result.findings == [] else result.findings[0].reason,
            detail,
        )
        log.info("training audit of v%d: %s %s", r.version, result.outcome, detail)

    async def dispute(self, record: Signed[TrainingRecord], finding: Finding) -> None:
        await self._dispute(record.message.version, record.signer, record.id, finding)

    async def _dispute(self, version: int, trainer: str, record_id: bytes, f: Finding) -> None:
        signed = sign(
            TrainingDispute(
                run_id=self.node.run_id,
                version=version,
                trainer=trainer,
                record=record_id,
                reason=f.reason,
                detail=f.detail[:1024],
                created_at=wall_clock_ms(),
                related=f.related[:8],
            ),
            self.node.key,
        )
        self.store.add_dispute(signed)
        self.disputes += 1
        log.error("training dispute of v%d (%s): %s", version, f.reason, f.detail)
        try:
            await self.node.publish_ledger(signed)
        except SwarmError as exc:
            log.warning("training dispute not gossiped: %s", exc)

    def status(self) -> dict[str, Any]:
        return {
            **self.store.summary(),
            "replayed": self.replayed,
            "disputes_signed": self.disputes,
            "last_audit": self.last,
        }

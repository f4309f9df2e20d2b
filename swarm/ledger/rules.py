"""The run's ledger rules: who may sign which event, for how much, citing what.

Decisions this module owns:
- Every credit, slash and dispute cites the signer's own Verdict by id (``evidence``); the rules
  read that verdict's facts (``VerdictFacts``, decoded once when the verdict was stored), never
  its signature again. An event whose verdict is not held raises ``EvidenceMissingError``: the
  store keeps such an event pending until the verdict arrives (``swarm.ledger.store``).
- Amounts are part of the rules: a credit is ``credit_per_sample`` x the accepted samples of its
  verdict, a slash is ``slash_amount``, a dispute is 0; the event's signer is its verdict's
  signer and its ``peer`` the verdict's worker. A grant (run owner only) may carry any amount.
- Each checked event becomes an ``Entry``: the ``slot`` it competes for and its balance
  ``delta``. The fold counts one entry per slot (the smallest id), so:
  one credit per assignment (worker, policy version, request counter) whichever validator judged
  it; one slash per assignment (a judged cheat and an equivocation of the same assignment are one
  slash); one grant per (peer, evidence); every dispute is its own slot with delta 0.
- An equivocation slash cites a hard Verdict whose reasons include ``EQUIVOCATION`` and names
  the other submission of the same assignment in ``related``; any other slash has no ``related``.
- A dispute cites the disputer's own rejecting Verdict (``evidence``) and the disputed accepting
  Verdict of another validator for the same submission (``related[0]``); ``peer`` is the
  disputed validator. It changes no balance: the audit settles it by replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from swarm.errors import EvidenceMissingError, NotAuthorizedError, ValidationError
from swarm.messages import LedgerEvent, RunGenesis, Signed, Verdict, run_id_of

EQUIVOCATION = "equivocation"
"""The reason a validator writes in the Verdict of an equivocation (two different signed
submissions for one assignment); its slash names the other submission in ``related``."""


@dataclass(frozen=True, slots=True)
class VerdictFacts:
    """What the rules read of a stored verdict (the verdicts table's columns)."""

    id: bytes
    submission: bytes
    worker: str
    validator: str
    accepted: bool
    severity: str
    samples: int
    policy_version: int
    counter: int
    equivocation: bool

    @classmethod
    def of(cls, verdict: Signed[Verdict]) -> VerdictFacts:
        v = verdict.message
        return cls(
            id=verdict.id,
            submission=v.submission_id,
            worker=v.worker,
            validator=verdict.signer,
            accepted=v.accepted,
            severity=v.severity,
            samples=len(v.rewards) if v.accepted else 0,
            policy_version=v.policy_version,
            counter=v.counter,
            equivocation=EQUIVOCATION in v.reasons,
        )


@dataclass(frozen=True, slots=True)
class Entry:
    """A checked event as the fold sees it."""

    id: bytes
    event: str
    slot: str
    peer: str
    delta: int


VerdictLookup = Callable[[bytes], VerdictFacts | None]


def check_verdict(
    verdict: Signed[Verdict], genesis: Signed[RunGenesis], *, run_id: str | None = None
) -> None:
    """Raise unless ``verdict`` is of this run and signed by a genesis validator."""
    run_id = run_id_of(genesis) if run_id is None else run_id
    if verdict.message.run_id != run_id:
        raise ValidationError(f"verdict for run {verdict.message.run_id[:32]!r}, not {run_id}")
    if verdict.signer not in genesis.message.validators:
        raise NotAuthorizedError(f"verdict signed by {verdict.signer}, not a genesis validator")


def check_event(
    event: Signed[LedgerEvent],
    genesis: Signed[RunGenesis],
    verdicts: VerdictLookup,
    *,
    signer: str | None = None,
    run_id: str | None = None,
) -> Entry:
    """The ``Entry`` of ``event``, or raise ``ValidationError`` (``NotAuthorizedError`` for a
    wrong signer, ``EvidenceMissingError`` when a cited verdict is not held) saying why the run
    refuses it. ``signer`` and ``run_id`` save recomputing them when the caller has them."""
    e = event.message
    run_id = run_id_of(genesis) if run_id is None else run_id
    who = event.signer if signer is None else signer
    if e.run_id != run_id:
        raise ValidationError(f"ledger event for run {e.run_id[:32]!r}, not {run_id}")
    if e.event == "grant":
        if who != genesis.signer:
            raise NotAuthorizedError(f"grant signed by {who}, not the run owner")
        return Entry(event.id, "grant", f"grant:{e.peer}:{e.evidence.hex()}", e.peer, e.amount)
    if who not in genesis.message.validators:
        raise NotAuthorizedError(f"{e.event} signed by {who}, who is not a genesis validator")
    verdict = _held(verdicts, e.evidence, e.event)
    if verdict.validator != who:
        raise NotAuthorizedError(f"{e.event} signed by {who}, but its verdict by someone else")
    params = genesis.message.params
    if e.event == "dispute":
        return _dispute(
            event, verdict, _held(verdicts, e.related[0] if e.related else b"", e.event)
        )
    if verdict.policy_version < 0 or verdict.counter < 0:
        raise ValidationError(f"{e.event} cites a verdict without policy version and counter")
    if e.peer != verdict.worker:
        raise ValidationError(f"{e.event} of {e.peer} cites a verdict about {verdict.worker}")
    assignment = f"{verdict.worker}:{verdict.policy_version}:{verdict.counter}"
    if e.event == "credit":
        expected = params.credit_per_sample * verdict.samples
        if not verdict.accepted:
            raise ValidationError("credit cites a verdict that rejected the work")
        if e.amount != expected:
            raise ValidationError(
                f"credit of {e.amount} where the verdict's {verdict.samples} accepted samples "
                f"earn {expected}"
            )
        if e.related:
            raise ValidationError("a credit cites nothing besides its verdict")
        return Entry(event.id, "credit", f"credit:{assignment}", e.peer, e.amount)
    if verdict.accepted or verdict.severity != "hard":
        raise ValidationError("slash cites a verdict that is not a hard rejection")
    if e.amount != params.slash_amount:
        raise ValidationError(
            f"slash of {e.amount}, the run's slash_amount is {params.slash_amount}"
        )
    if verdict.equivocation:
        if len(e.related) != 1 or e.related[0] == verdict.submission:
            raise ValidationError("an equivocation slash names the other submission in related")
    elif e.related:
        raise ValidationError("a slash cites nothing besides its verdict unless an equivocation")
    return Entry(event.id, "slash", f"slash:{assignment}", e.peer, -e.amount)


def _held(verdicts: VerdictLookup, verdict_id: bytes, what: str) -> VerdictFacts:
    facts = verdicts(verdict_id)
    if facts is None:
        raise EvidenceMissingError(
            f"{what} cites verdict {verdict_id.hex()[:16]}, not held here", verdict_id
        )
    return facts


def _dispute(event: Signed[LedgerEvent], own: VerdictFacts, disputed: VerdictFacts) -> Entry:
    e = event.message
    if len(e.related) != 1 or e.amount != 0:
        raise ValidationError("a dispute has amount 0 and cites exactly one disputed verdict")
    if disputed.validator == own.validator:
        raise ValidationError("a validator cannot dispute its own verdict")
    if disputed.submission != own.submission:
        raise ValidationError("a dispute's two verdicts judge different submissions")
    if not disputed.accepted or own.accepted:
        raise ValidationError("a dispute rejects work that the disputed verdict accepted")
    if e.peer != disputed.validator:
        raise ValidationError("a dispute's peer is the validator that signed the disputed verdict")
    return Entry(event.id, "dispute", f"dispute:{event.id.hex()}", e.peer, 0)

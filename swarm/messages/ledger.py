"""LedgerEvent: one signed entry of the run's ledger (a grant, a credit, a slash or a dispute).

What each field means per event type (the rules in ``swarm.ledger.rules`` enforce it):

========  ==================  ==========================  ======  =============================
event     signer              evidence                    amount  related
========  ==================  ==========================  ======  =============================
grant     run owner           free (the owner's note)     any     ()
credit    genesis validator   id of its accepted Verdict  rule    ()
slash     genesis validator   id of its hard Verdict      rule    () or, for an equivocation,
                                                                  (the other submission's id,)
dispute   genesis validator   id of its own contrary      0       (the disputed verdict's id,)
                              Verdict
========  ==================  ==========================  ======  =============================

``peer`` is whose balance the event is about: the grantee, the worker of the cited verdict, or,
for a dispute, the validator that signed the disputed verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from swarm.errors import MalformedError
from swarm.messages._base import Fields, typed

EventType = Literal["grant", "credit", "slash", "dispute"]
EVENT_TYPES: tuple[EventType, ...] = ("grant", "credit", "slash", "dispute")
MAX_RELATED = 4


@dataclass(frozen=True, slots=True)
class LedgerEvent:
    """Grants come from the run owner; credits, slashes and disputes from genesis validators,
    each citing the signer's own Verdict by id in ``evidence`` (see the module docstring)."""

    KIND: ClassVar[str] = "ledger-event"
    MAX_BYTES: ClassVar[int] = 4 * 1024

    run_id: str
    event: EventType
    peer: str
    amount: int
    evidence: bytes
    created_at: int
    related: tuple[bytes, ...] = ()
    """Further object ids the event cites (32 bytes each): the other submission of an
    equivocation, the disputed verdict of a dispute. Absent on the wire when empty, so events
    signed before the field existed keep their ids."""

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "run_id": self.run_id,
            "event": self.event,
            "peer": self.peer,
            "amount": self.amount,
            "evidence": self.evidence,
            "created_at": self.created_at,
        }
        if self.related:
            wire["related"] = list(self.related)
        return wire

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        event = f.text("event")
        if event not in EVENT_TYPES:
            raise MalformedError(f"ledger event {event[:16]!r} is not one of {EVENT_TYPES}")
        related = f.seq("related", typed(bytes, "related"), [])
        if len(related) > MAX_RELATED or any(len(r) != 32 for r in related):
            raise MalformedError(f"related holds at most {MAX_RELATED} ids of 32 bytes")
        return cls(
            run_id=f.text("run_id"),
            event=event,
            peer=f.text("peer"),
            amount=f.integer("amount", minimum=0),
            evidence=f.blob("evidence"),
            created_at=f.integer("created_at", minimum=0),
            related=related,
        )

"""LedgerEvent: one signed change to a peer's balance (a grant, a credit or a slash)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self, cast

from swarm.errors import MalformedError
from swarm.messages._base import Fields

EventType = Literal["grant", "credit", "slash"]


@dataclass(frozen=True, slots=True)
class LedgerEvent:
    """Grants come from the run owner; credits and slashes from genesis validators, each with
    the id of its evidence (the verdict or submission that justifies it)."""

    KIND: ClassVar[str] = "ledger-event"
    MAX_BYTES: ClassVar[int] = 4 * 1024

    run_id: str
    event: EventType
    peer: str
    amount: int
    evidence: bytes
    created_at: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "event": self.event,
            "peer": self.peer,
            "amount": self.amount,
            "evidence": self.evidence,
            "created_at": self.created_at,
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        event = f.text("event")
        if event not in ("grant", "credit", "slash"):
            raise MalformedError(f"ledger event {event[:16]!r} is not grant, credit or slash")
        return cls(
            run_id=f.text("run_id"),
            event=cast(EventType, event),
            peer=f.text("peer"),
            amount=f.integer("amount", minimum=0),
            evidence=f.blob("evidence"),
            created_at=f.integer("created_at", minimum=0),
        )

"""Who may sign which ledger event: grants come from the run owner, credits and slashes from a
genesis validator, and every event belongs to the run."""

from __future__ import annotations

from swarm.errors import NotAuthorizedError, ValidationError
from swarm.messages import LedgerEvent, RunGenesis, Signed, Verdict, run_id_of


def check_event(event: Signed[LedgerEvent], genesis: Signed[RunGenesis]) -> None:
    """Raise ``NotAuthorizedError`` or ``ValidationError`` unless the run allows ``event``."""
    run_id = run_id_of(genesis)
    if event.message.run_id != run_id:
        raise ValidationError(f"ledger event for run {event.message.run_id[:32]!r}, not {run_id}")
    if event.message.event == "grant":
        if event.signer != genesis.signer:
            raise NotAuthorizedError(f"grant signed by {event.signer}, not the run owner")
    elif event.signer not in genesis.message.validators:
        raise NotAuthorizedError(
            f"{event.message.event} signed by {event.signer}, who is not a genesis validator"
        )


def check_verdict(verdict: Signed[Verdict], genesis: Signed[RunGenesis]) -> None:
    """Raise unless ``verdict`` is of this run and signed by a genesis validator."""
    run_id = run_id_of(genesis)
    if verdict.message.run_id != run_id:
        raise ValidationError(f"verdict for run {verdict.message.run_id[:32]!r}, not {run_id}")
    if verdict.signer not in genesis.message.validators:
        raise NotAuthorizedError(f"verdict signed by {verdict.signer}, not a genesis validator")

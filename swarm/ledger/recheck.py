"""Re-derive a stored ledger from its envelope bytes alone (what ``audit`` does).

Unlike the store, which trusts the columns it wrote on insert, this re-verifies every verdict's
and every event's signature, re-checks every event against the run's rules with verdict facts
decoded afresh (so an amount or a signer changed in the file is caught), folds the result and
compares it with the stored balances and ``counted`` marks. It reads the whole ledger: an audit
is the one place that may.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.errors import SwarmError
from swarm.ledger.fold import Balances, fold, winners
from swarm.ledger.rules import Entry, VerdictFacts, check_event, check_verdict
from swarm.ledger.store import LedgerStore
from swarm.messages import LedgerEvent, Signed, Verdict, decode


@dataclass
class Recheck:
    events: list[Signed[LedgerEvent]] = field(default_factory=list)
    """Events that verify and that the rules accept."""
    counted: set[bytes] = field(default_factory=set)
    """Ids of the events the fold counts."""
    refused: list[str] = field(default_factory=list)
    """Why each refused event or verdict is refused."""
    balance_errors: list[str] = field(default_factory=list)
    balances: Balances | None = None


def recheck(store: LedgerStore) -> Recheck:
    out = Recheck()
    verdicts: dict[bytes, VerdictFacts] = {}
    for raw in store.raw_verdicts():
        try:
            verdict = decode(raw, Verdict)
            check_verdict(verdict, store.genesis)
        except SwarmError as exc:
            out.refused.append(f"verdict: {exc}")
            continue
        verdicts[verdict.id] = VerdictFacts.of(verdict)
    entries: list[Entry] = []
    for raw in store.raw_events():
        try:
            event = decode(raw, LedgerEvent)
            entries.append(check_event(event, store.genesis, verdicts.get))
        except SwarmError as exc:
            out.refused.append(f"event: {exc}")
            continue
        out.events.append(event)
    params = store.genesis.message.params
    out.balances = fold(entries, params)
    out.counted = {e.id for e in winners(entries).values()}
    stored = store.stored_balances()
    expected = dict(out.balances.by_peer)
    for peer in sorted(set(stored) | set(expected)):
        if stored.get(peer) != expected.get(peer):
            out.balance_errors.append(
                f"{peer[-12:]}: stored {stored.get(peer)}, fold {expected.get(peer)}"
            )
    marked = {e.id for e in out.events if store.is_counted(e.id)}
    if marked != out.counted:
        out.balance_errors.append(
            f"{len(marked ^ out.counted)} event(s) marked counted where the fold disagrees"
        )
    return out

"""Balances as a deterministic fold over a set of checked events (``rules.Entry``).

Every peer starts at the run's ``initial_balance`` (joining needs nobody's permission). Each
entry competes for its ``slot`` (``swarm.ledger.rules``): one credit per assignment, one slash per
assignment, one grant per (peer, evidence), every dispute apart. Per slot the entry with the
smallest id counts, so every replica picks the same one whatever order and however many times it
saw them. A dispute's delta is 0: it changes no balance until the audit settles it.

``fold`` is the reference: the store keeps the same result incrementally (``LedgerStore``), and
``audit`` and the tests compare the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from swarm.ledger.rules import Entry
from swarm.messages import RunParams


@dataclass(frozen=True, slots=True)
class Balances:
    """Balances of the peers that have counted events; anyone else holds ``initial``.
    ``by_peer`` may be a live view of a store's table (``LedgerStore.balances``)."""

    initial: int
    ban_threshold: int
    by_peer: Mapping[str, int] = field(default_factory=dict)

    def of(self, peer: str) -> int:
        return self.by_peer.get(peer, self.initial)

    def banned(self, peer: str) -> bool:
        return self.of(peer) < self.ban_threshold


def winners(entries: Iterable[Entry]) -> dict[str, Entry]:
    """The counted entry of every slot: the one with the smallest id."""
    chosen: dict[str, Entry] = {}
    for entry in entries:
        held = chosen.get(entry.slot)
        if held is None or entry.id < held.id:
            chosen[entry.slot] = entry
    return chosen


def fold(entries: Iterable[Entry], params: RunParams) -> Balances:
    """Balances implied by ``entries`` (events already checked by ``rules.check_event``)."""
    by_peer: dict[str, int] = {}
    for entry in winners(entries).values():
        if entry.event != "dispute":
            by_peer[entry.peer] = by_peer.get(entry.peer, params.initial_balance) + entry.delta
    return Balances(params.initial_balance, params.ban_threshold, by_peer)

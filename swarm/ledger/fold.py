"""Balances as a deterministic fold over a set of events.

Every peer starts at the run's ``initial_balance`` (joining needs nobody's permission). Grants and
credits add, slashes subtract. An event counts once per (event type, peer, evidence): a validator
that signs the same credit twice (say, after a crash mid-verdict) or two validators crediting the
same evidence never pay twice. Among duplicates the one with the smallest id counts, so every
replica picks the same one whatever order it saw them in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from swarm.messages import LedgerEvent, RunParams, Signed


@dataclass(frozen=True, slots=True)
class Balances:
    initial: int
    ban_threshold: int
    by_peer: Mapping[str, int] = field(default_factory=dict)
    counted: frozenset[bytes] = frozenset()

    def of(self, peer: str) -> int:
        return self.by_peer.get(peer, self.initial)

    def banned(self, peer: str) -> bool:
        return self.of(peer) < self.ban_threshold


def fold(events: Iterable[Signed[LedgerEvent]], params: RunParams) -> Balances:
    """Balances implied by ``events`` (already checked with ``rules.check_event``)."""
    chosen: dict[tuple[str, str, bytes], Signed[LedgerEvent]] = {}
    for signed in events:
        e = signed.message
        key = (e.event, e.peer, e.evidence)
        if key not in chosen or signed.id < chosen[key].id:
            chosen[key] = signed
    by_peer: dict[str, int] = {}
    for signed in chosen.values():
        e = signed.message
        delta = -e.amount if e.event == "slash" else e.amount
        by_peer[e.peer] = by_peer.get(e.peer, params.initial_balance) + delta
    return Balances(
        initial=params.initial_balance,
        ban_threshold=params.ban_threshold,
        by_peer=by_peer,
        counted=frozenset(s.id for s in chosen.values()),
    )

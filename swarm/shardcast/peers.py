"""Choosing providers: measured throughput and success, weighted random choice, budgets.

Every peer has two exponential moving averages: throughput (bytes/s of its completed shards) and
success (1 for a verified shard, 0 for a failure). A peer is chosen with probability
proportional to ``throughput * success**2 / (1 + in_flight)**3`` (the cube spreads concurrent
pulls over idle peers first, so equal peers finish together instead of one holding the tail);
a peer never measured gets the best known throughput, so it is tried early, and with
probability ``explore`` the choice is uniform, so a slow peer is still probed now and then and
can earn its way back. The version's origins (its trainers) weigh 1/8 of their measure, so
shards that peers hold come from peers (docs/shardcast.md). A peer that
fails ``failure_budget`` times (or once with a corrupt shard) is dropped for the version; one
that failed only to connect rests and is tried again, up to ``UNREACHABLE_TRIES`` budgets.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

ORIGIN_WEIGHT = 0.125
"""An origin counts as 8x slower than it measures (three factors of two in ``_next``)."""
ORIGIN_REST = 1.0
"""Seconds an origin past its failure budget rests after each further failure (doubling); so
does a peer we could not reach, up to ``UNREACHABLE_TRIES`` budgets."""
UNREACHABLE_TRIES = 2
"""A peer that failed only to connect is dropped after this many failure budgets, resting
between tries past the first (``record_failure(unreachable=True)``)."""
DEFAULT_RATE = 50.0 * 1024 * 1024
"""Throughput assumed before anything is measured (bytes/s)."""


@dataclass(slots=True)
class PeerStats:
    peer: str
    rate: float | None = None  # EMA of bytes/s over completed shards
    success: float = 1.0  # EMA of 1 (verified) / 0 (failed)
    failures: int = 0
    shards: int = 0
    bytes: int = 0
    in_flight: int = 0
    dropped: bool = False
    last_error: str = ""
    busy_until: float = 0.0
    """Said all its upload slots were taken: not asked again before this time (no fault)."""
    busy: int = 0
    elsewhere: int = 0
    """Shards the origin refused to super-seed to us (``ShardElsewhere``)."""

    def view(self) -> dict[str, object]:
        return {
            "peer": self.peer,
            "rate_mib_s": round((self.rate or 0.0) / (1024 * 1024), 1),
            "success": round(self.success, 3),
            "shards": self.shards,
            "bytes": self.bytes,
            "failures": self.failures,
            "in_flight": self.in_flight,
            "dropped": self.dropped,
            "busy": self.busy,
            "elsewhere": self.elsewhere,
            "last_error": self.last_error,
        }


@dataclass
class PeerBoard:
    """The fetch's view of its providers for one version."""

    failure_budget: int = 3
    alpha: float = 0.3
    explore: float = 0.1
    rng: random.Random = field(default_factory=random.Random)
    stats: dict[str, PeerStats] = field(default_factory=dict)
    origins: frozenset[str] = frozenset()
    """The version's publishers (trainers): weighed at ``ORIGIN_WEIGHT``, so a shard that a
    peer holds comes from that peer, and the origin's upload goes to the shards nobody else
    has yet (each copy it serves is passed on)."""

    def add(self, peers: Iterable[str]) -> None:
        for peer in peers:
            self.stats.setdefault(peer, PeerStats(peer))

    def usable(self) -> list[str]:
        return [p for p, s in self.stats.items() if not s.dropped]

    def weight(self, peer: str) -> float:
        s = self.stats[peer]
        known = [x.rate for x in self.stats.values() if x.rate is not None and not x.dropped]
        rate = s.rate if s.rate is not None else max(known, default=DEFAULT_RATE)
        origin = ORIGIN_WEIGHT if peer in self.origins else 1.0
        return origin * max(rate, 1.0) * max(s.success, 0.01) ** 2 / (1 + s.in_flight) ** 3

    def choose(self, candidates: Iterable[str]) -> str | None:
        """A weighted random pick among usable ``candidates``; ``None`` if none is usable."""
        usable = [p for p in candidates if p in self.stats and not self.stats[p].dropped]
        if not usable:
            return None
        if len(usable) == 1:
            return usable[0]
        if self.rng.random() < self.explore:
            return self.rng.choice(usable)
        weights = [self.weight(p) for p in usable]
        return self.rng.choices(usable, weights=weights, k=1)[0]

    def started(self, peer: str) -> None:
        self.stats[peer].in_flight += 1

    def finished(self, peer: str) -> None:
        self.stats[peer].in_flight = max(0, self.stats[peer].in_flight - 1)

    def record_success(self, peer: str, nbytes: int, seconds: float) -> None:
        s = self.stats[peer]
        rate = nbytes / max(seconds, 1e-6)
        s.rate = rate if s.rate is None else (1 - self.alpha) * s.rate + self.alpha * rate
        s.success = (1 - self.alpha) * s.success + self.alpha
        s.shards += 1
        s.bytes += nbytes

    def record_busy(self, peer: str, until: float) -> None:
        """The peer refused for want of a free upload slot: rest it until ``until``."""
        s = self.stats[peer]
        s.busy += 1
        s.busy_until = until

    def record_failure(
        self,
        peer: str,
        reason: str,
        *,
        fatal: bool = False,
        unreachable: bool = False,
        now: float | None = None,
    ) -> bool:
        """Count a failure; returns ``True`` when the peer is now dropped for the version.

        ``fatal`` (a corrupt or truncated shard: the peer served wrong bytes) drops at once.
        An origin is dropped only for that: past its budget it rests instead (``now`` given:
        ``ORIGIN_REST`` s, doubling, at most 8x), since without the trainer nobody may hold
        what is missing. At N = 100 on one machine the trainer's loaded event loop timed out
        stream openings, every receiver dropped it after 3 of them, and 85 of 100 fetches
        failed (docs/BENCHMARKS.md, Scale).

        ``unreachable`` (no stream could be opened): past the budget the peer rests the same
        way until ``UNREACHABLE_TRIES`` budgets are spent. A connection cap (the newcomer's
        own, full of young connections it polls) refused dials to holders three times in as
        many seconds, which dropped them for the version: 1 or 2 of 5 holders in most runs of
        the 30-node test (tests/integration/test_connection_bounds.py, docs/RELIABILITY.md).
        """
        s = self.stats[peer]
        s.failures += 1
        s.success = (1 - self.alpha) * s.success
        s.last_error = reason[:200]
        if fatal:
            s.dropped = True
        elif s.failures >= self.failure_budget:
            rests = peer in self.origins or (
                unreachable and s.failures < UNREACHABLE_TRIES * self.failure_budget
            )
            if not rests:
                s.dropped = True
            elif now is not None:
                over = s.failures - self.failure_budget
                s.busy_until = max(s.busy_until, now + ORIGIN_REST * 2 ** min(over, 3))
        return s.dropped

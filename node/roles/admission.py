"""Per-peer rate limits at the validator's door (issue 15: fair admission).

``PeerRateLimit``: a token bucket per peer (``burst`` requests at once, refilled at ``rate`` per
second), checked before anything else is done with a submission (before decoding the rest of
the pipeline: the signature check, the precheck, the judge). A peer past its bucket is refused
with a one-line error naming the wait. Buckets of at most ``max_peers`` peers are kept, the
least recently seen dropped first (a dropped peer starts again with a full bucket, so a flood of
fresh keys gains nothing by evicting others: each key has its own bucket anyway). Time comes
from an injectable clock, so tests run instantly.

Hand-written rather than a library: the bucket is a few lines, and the libraries on the package
index that do this (``limits``, ``aiolimiter``) assume asyncio or a shared store.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from swarm.errors import ValidationError


class PeerRateLimit:
    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        max_peers: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.max_peers = max_peers
        self.clock = clock
        self.refused = 0
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def check(self, peer: str) -> None:
        """Take one token of ``peer``'s bucket; ``ValidationError`` when it is empty."""
        now = self.clock()
        tokens, last = self._buckets.pop(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._buckets[peer] = (tokens, now)
            self.refused += 1
            wait = (1.0 - tokens) / self.rate
            raise ValidationError(
                f"rate limited: at most {self.burst} submissions at once and {self.rate:g} per"
                f" second per peer; retry in {wait:.1f} s"
            )
        self._buckets[peer] = (tokens - 1.0, now)
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)

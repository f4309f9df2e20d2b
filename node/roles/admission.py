"""Per-peer rate limits and the newcomers' share of judge time at the validator's door (issue
15: fair admission).

``PeerRateLimit``: a token bucket per peer (``burst`` requests at once, refilled at ``rate`` per
second), checked before anything else is done with a submission (before decoding the rest of
the pipeline: the signature check, the precheck, the judge). A peer past its bucket is refused
with a one-line error naming the wait. Buckets of at most ``max_peers`` peers are kept, the
least recently seen dropped first (a dropped peer starts again with a full bucket, so a flood of
fresh keys gains nothing by evicting others: each key has its own bucket anyway). Time comes
from an injectable clock, so tests run instantly.

``NewcomerShare``: newcomers (keys with no accepted work) may spend at most ``share`` of the
validator's wall time on the judge (a bucket of judge-seconds refilled at ``share`` per second,
at most ``burst_s``), while workers with a history are active (one submitted within
``active_s``). A newcomer whose turn comes with the bucket empty is refused at once (nothing
claimed, stored or prefilled) with the wait to retry. So a flood of fresh keys, however large,
takes at most that share from the workers who earned priority; a swarm of newcomers only (a new
run) is not held back at all, since nobody with a history is waiting.

Hand-written rather than a library: the buckets are a few lines, and the libraries on the package
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


class NewcomerShare:
    def __init__(
        self,
        share: float = 0.1,
        burst_s: float = 3.0,
        *,
        active_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.share = share
        self.burst_s = burst_s
        self.active_s = active_s
        self.clock = clock
        self.refused = 0
        self._tokens = burst_s
        self._refilled = clock()
        self._trusted_at = -float("inf")

    def trusted_seen(self) -> None:
        """A worker with a history submitted: the share applies for ``active_s`` from now."""
        self._trusted_at = self.clock()

    def check(self) -> None:
        """A newcomer's turn at the judge: ``ValidationError`` when its share is used up."""
        now = self._refill()
        if self._tokens > 0 or now - self._trusted_at > self.active_s:
            return
        self.refused += 1
        wait = -self._tokens / self.share + 0.1
        raise ValidationError(
            f"busy: newcomers (no accepted work yet) may take {self.share:.0%} of this"
            f" validator's judge time while its established workers are active; retry in"
            f" {wait:.1f} s or send to another validator"
        )

    def spend(self, seconds: float) -> None:
        """A newcomer's judgement took ``seconds`` of judge time (not counted while nobody with
        a history is active: a new run's first workers do not use up the next one's share)."""
        now = self._refill()
        if now - self._trusted_at <= self.active_s:
            self._tokens -= seconds

    def _refill(self) -> float:
        now = self.clock()
        self._tokens = min(self.burst_s, self._tokens + (now - self._refilled) * self.share)
        self._refilled = now
        return now

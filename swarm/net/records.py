"""DHT records: the signed RoleAdvert stored under ``/swarm-node/<run>/advert/<peer>``.

The validator accepts a record only when it is a RoleAdvert envelope, signed by the very peer it
describes, stored under that peer's key of the same run, and not expired. Between two valid
records the newer ``issued_at`` wins. So mallory can neither overwrite bob's record (his signature
is not bob's) nor replay an older one of bob's over a newer one, also after bob has left.

py-libp2p calls ``validate`` (raise to refuse) and ``select`` (index of the best value) both for
values we put and for values other peers send us or answer us with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from libp2p.records.validator import Validator

from swarm.errors import MalformedError, SwarmError, ValidationError
from swarm.messages import RoleAdvert, Signed, decode
from swarm.net.names import advert_key, parse_advert_key

Clock = Callable[[], int]
"""Milliseconds since the epoch; injectable so that expiry tests run instantly."""


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


def check_advert(
    raw: bytes, *, key: str | None = None, now_ms: int | None = None
) -> Signed[RoleAdvert]:
    """Decode and check one RoleAdvert record; raise a ``SwarmError`` saying why it is refused.

    ``key`` (when given) must be the advert's own DHT key; ``now_ms`` (when given) must be before
    its expiry.
    """
    signed = decode(raw, RoleAdvert)
    advert = signed.message
    if signed.signer != advert.peer_id:
        raise ValidationError(
            f"RoleAdvert for {advert.peer_id[:16]}... is signed by {signed.signer[:16]}..."
        )
    if key is not None:
        run_id, peer_id = parse_advert_key(key)
        if (run_id, peer_id) != (advert.run_id, advert.peer_id):
            raise ValidationError(f"RoleAdvert stored under another key: {key[:120]!r}")
    if advert.expires_at <= advert.issued_at:
        raise MalformedError("RoleAdvert expires before it is issued")
    if now_ms is not None and advert.expires_at <= now_ms:
        raise ValidationError(f"RoleAdvert of {advert.peer_id[:16]}... has expired")
    return signed


class RoleAdvertValidator(Validator):
    """py-libp2p record validator for the ``swarm-node`` namespace."""

    def __init__(self, clock: Clock = wall_clock_ms) -> None:
        self._clock = clock
        self.rejected = 0

    def validate(self, key: str, value: bytes) -> None:
        try:
            check_advert(value, key=key, now_ms=self._clock())
        except SwarmError:
            self.rejected += 1
            raise

    def select(self, key: str, values: Sequence[bytes]) -> int:
        """The index of the valid record with the newest ``issued_at`` (the first on ties)."""
        best, best_issued = 0, -1
        now = self._clock()
        for i, value in enumerate(values):
            try:
                issued = check_advert(value, key=key, now_ms=now).message.issued_at
            except SwarmError:
                continue
            if issued > best_issued:
                best, best_issued = i, issued
        return best


__all__ = ["Clock", "RoleAdvertValidator", "advert_key", "check_advert", "wall_clock_ms"]

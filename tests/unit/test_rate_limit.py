"""The validator's per-peer token bucket (``node.roles.admission``), on a fake clock."""

from __future__ import annotations

import pytest

from node.roles.admission import PeerRateLimit
from swarm.errors import ValidationError


def test_a_peer_past_its_burst_is_refused_until_its_bucket_refills() -> None:
    now = [0.0]
    limit = PeerRateLimit(rate=2.0, burst=3, clock=lambda: now[0])
    for _ in range(3):
        limit.check("flooder")
    with pytest.raises(ValidationError, match=r"rate limited: .* retry in 0\.5 s"):
        limit.check("flooder")
    limit.check("honest")  # another peer's bucket is its own
    now[0] += 0.5
    limit.check("flooder")  # one token back
    with pytest.raises(ValidationError):
        limit.check("flooder")
    assert limit.refused == 2


def test_buckets_are_bounded_in_number() -> None:
    limit = PeerRateLimit(rate=1.0, burst=1, max_peers=100, clock=lambda: 0.0)
    for i in range(1000):
        limit.check(f"fresh-{i}")
    assert len(limit._buckets) == 100

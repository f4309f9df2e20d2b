"""The validator's per-peer token bucket and the newcomers' share of judge time
(``node.roles.admission``), on a fake clock."""

from __future__ import annotations

import pytest

from node.roles.admission import NewcomerShare, PeerRateLimit
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


def test_newcomers_take_at_most_their_share_of_judge_time_while_workers_are_active() -> None:
    now = [0.0]
    share = NewcomerShare(share=0.2, burst_s=2.0, active_s=60.0, clock=lambda: now[0])
    # Nobody with a history yet (a new run): newcomers are never held back, nor charged.
    for _ in range(10):
        share.check()
        share.spend(1.0)
    share.trusted_seen()
    share.check()
    share.spend(10.0)
    with pytest.raises(ValidationError, match=r"busy: newcomers .* 20% .* retry in"):
        share.check()
    now[0] += 40.0  # refilled at 0.2 s per s: from -8 s of judge time to 0, not yet above
    with pytest.raises(ValidationError):
        share.check()
    now[0] += 1.0  # -8 + 41 * 0.2 = 0.2 s of judge time left: one more newcomer judgement
    share.trusted_seen()
    share.check()
    share.spend(3.0)
    with pytest.raises(ValidationError):
        share.check()
    assert share.refused == 3
    now[0] += 1000.0  # the established workers went quiet: newcomers are not held back
    share.spend(100.0)
    share.check()

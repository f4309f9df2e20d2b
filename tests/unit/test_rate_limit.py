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
    # 10 s of judge time: -8 s in the bucket, and the next turn needs what the last took (the
    # burst's 2 s at most), so 50 s at 0.2 s per s.
    with pytest.raises(ValidationError, match=r"busy: newcomers .* 20% .* retry in 50\.1 s"):
        share.check()
    now[0] += 45.0  # -8 + 45 * 0.2 = 1 s: not the 2 s a turn needs
    with pytest.raises(ValidationError):
        share.check()
    now[0] += 5.0  # 2 s: one more newcomer judgement
    share.trusted_seen()
    share.check()
    share.spend(0.5)  # a short one: the next turn needs only 0.5 s (1.5 s left)
    share.check()
    share.spend(1.5)
    with pytest.raises(ValidationError):
        share.check()
    assert share.refused == 3
    now[0] += 1000.0  # the established workers went quiet: newcomers are not held back
    share.spend(100.0)
    share.check()

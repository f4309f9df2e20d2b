"""Provider choice: fast peers are preferred, slow ones still probed, failing ones dropped."""

from __future__ import annotations

import random
from collections import Counter

from swarm.shardcast import PeerBoard


def board(**kw: object) -> PeerBoard:
    b = PeerBoard(rng=random.Random(1), **kw)  # type: ignore[arg-type]
    b.add(["fast", "slow"])
    b.record_success("fast", 100_000_000, 1.0)
    b.record_success("slow", 1_000_000, 1.0)
    return b


def test_a_faster_peer_is_chosen_more_often_but_the_slow_one_is_still_probed() -> None:
    b = board(explore=0.1)
    picks = Counter(b.choose(["fast", "slow"]) for _ in range(2000))
    assert picks["fast"] > 1600
    assert picks["slow"] > 20


def test_an_unmeasured_peer_is_tried_like_the_best_known() -> None:
    b = board(explore=0.0)
    b.add(["new"])
    picks = Counter(b.choose(["fast", "new"]) for _ in range(2000))
    assert picks["new"] > 600


def test_a_peer_over_its_failure_budget_is_dropped() -> None:
    b = board(failure_budget=2)
    assert not b.record_failure("slow", "timeout")
    assert b.record_failure("slow", "timeout")
    assert b.usable() == ["fast"]
    assert all(b.choose(["fast", "slow"]) == "fast" for _ in range(100))


def test_a_corrupt_shard_drops_the_peer_at_once() -> None:
    b = board(failure_budget=5)
    assert b.record_failure("fast", "corrupt shard 3", fatal=True)
    assert b.choose(["fast"]) is None


def test_failures_lower_the_success_average() -> None:
    b = board()
    before = b.weight("fast")
    b.record_failure("fast", "reset")
    assert b.weight("fast") < before
    assert b.stats["fast"].view()["last_error"] == "reset"


def test_an_origin_over_its_failure_budget_rests_and_is_kept_unless_it_sends_wrong_bytes() -> None:
    b = PeerBoard(rng=random.Random(1), failure_budget=3, origins=frozenset({"trainer"}))
    b.add(["trainer", "peer"])
    for i in range(3):
        assert not b.record_failure("trainer", "failed to open a stream", now=100.0 + i)
        b.record_failure("peer", "failed to open a stream", now=100.0 + i)
    assert "trainer" in b.usable() and "peer" not in b.usable()
    assert b.stats["trainer"].busy_until == 102.0 + 1.0  # rests 1 s past its budget
    for _ in range(5):
        b.record_failure("trainer", "failed to open a stream", now=200.0)
    assert b.stats["trainer"].busy_until == 200.0 + 8.0  # doubling, at most 8 s
    assert b.record_failure("trainer", "corrupt shard 0", fatal=True)
    assert "trainer" not in b.usable()


def test_a_peer_we_could_not_reach_rests_past_its_budget_then_goes_after_twice_that() -> None:
    """A holder at its connection cap refuses newcomers for a few seconds: connection failures
    rest it (1 s, 2 s, ... as an origin) for a second failure budget; other failures drop it
    at the first."""
    b = PeerBoard(rng=random.Random(1), failure_budget=3)
    b.add(["holder", "liar"])
    for i in range(3):
        b.record_failure("liar", "said it holds shard 0, then refused it", now=100.0 + i)
        assert not b.record_failure("holder", "cannot open ...", unreachable=True, now=100.0 + i)
    assert "liar" not in b.usable() and "holder" in b.usable()
    assert b.stats["holder"].busy_until == 102.0 + 1.0
    assert not b.record_failure("holder", "cannot open ...", unreachable=True, now=110.0)
    assert b.stats["holder"].busy_until == 110.0 + 2.0
    assert not b.record_failure("holder", "cannot open ...", unreachable=True, now=120.0)
    assert b.record_failure("holder", "cannot open ...", unreachable=True, now=130.0)
    assert "holder" not in b.usable()

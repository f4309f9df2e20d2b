"""Discovery's pace (``swarm.net.membership.hurry``): what brings the base pace back."""

from __future__ import annotations

from swarm.net.membership import ENOUGH_PEERS, hurry


def test_a_new_trainer_or_validator_always_hurries_discovery() -> None:
    before = {"trainer": 0, "inference": ENOUGH_PEERS + 10, "validator": 1}
    assert hurry(before, {**before, "trainer": 1})
    assert hurry(before, {**before, "validator": 2})


def test_one_more_of_a_role_known_well_enough_does_not() -> None:
    before = {"trainer": 1, "inference": ENOUGH_PEERS, "validator": 1}
    assert not hurry(before, {**before, "inference": ENOUGH_PEERS + 1})
    assert not hurry(before, dict(before))  # nothing new
    assert not hurry(before, {**before, "inference": 3})  # adverts expired: nothing new


def test_a_node_that_knows_few_peers_keeps_looking_fast() -> None:
    before = {"trainer": 1, "inference": ENOUGH_PEERS - 1, "validator": 1}
    assert hurry(before, {**before, "inference": ENOUGH_PEERS})

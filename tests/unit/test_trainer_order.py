"""Validators hand each accepted submission to one trainer: rendezvous hashing over the genesis
trainers, the same order on every validator, and a dead trainer's share moves to the others."""

from __future__ import annotations

import hashlib

from node.roles.validator import trainer_order

TRAINERS = ["12D3KooWA", "12D3KooWB", "12D3KooWC"]


def test_every_validator_computes_the_same_order_whatever_the_genesis_order() -> None:
    sid = hashlib.sha256(b"submission").digest()
    assert trainer_order(sid, TRAINERS) == trainer_order(sid, list(reversed(TRAINERS)))
    assert sorted(trainer_order(sid, TRAINERS)) == sorted(TRAINERS)


def test_work_spreads_over_trainers_and_a_dead_ones_share_moves_to_the_rest() -> None:
    ids = [hashlib.sha256(bytes([i, j])).digest() for i in range(30) for j in range(10)]
    first = [trainer_order(s, TRAINERS)[0] for s in ids]
    assert all(first.count(t) > len(ids) / 5 for t in TRAINERS)
    alive = TRAINERS[1:]  # A is dead: its submissions go to their second choice
    for sid, chosen in zip(ids, first, strict=True):
        fallback = next(t for t in trainer_order(sid, TRAINERS) if t in alive)
        assert fallback == (chosen if chosen in alive else trainer_order(sid, TRAINERS)[1])

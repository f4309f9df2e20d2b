"""The validator's outbox (issue 15): a trainer that refuses one hand-off forever does not hold
up the rest; after ``DEAD_AFTER_REFUSALS`` refusals the item is a dead letter, kept in the
outbox and shown in ``status``, and no longer tried."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import trio

import node.roles.validator as validator_module
from node.roles.judge import Judgement
from node.roles.validator import trainer_order
from node.roles.verdicts import record_judgement
from swarm.errors import NetworkError, PeerError
from swarm.identity import NodeKey
from swarm.messages import RolloutSubmission, Sample, Signed, Verdict, sign
from tests.netfactory import wait_until
from tests.validator_stub import GENESIS, ME, PARAMS, RUN, VERSION, stub_validator

WORKER = NodeKey.from_seed(b"\x16" * 32)
TRAINER = GENESIS.message.trainers[0]


class UnusedEngine:
    pass


async def test_a_trainer_refusing_one_item_forever_does_not_hold_up_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validator_module, "RETRY_FIRST_S", 0.001)
    monkeypatch.setattr(validator_module, "RETRY_MAX_S", 0.001)
    validator = stub_validator(tmp_path, UnusedEngine())  # type: ignore[arg-type]

    def accepted(counter: int) -> Signed[Verdict]:
        sample = Sample("1", (1, 2), 0, (b"\x00",), "stop")
        sub = sign(RolloutSubmission(RUN, VERSION, counter, ("1",), (sample,), 1), WORKER)
        recorded = record_judgement(
            validator.ledger,
            validator.evidence.store,
            ME,
            sub,
            Judgement(True, "none", [], [1.0]),
            PARAMS,
            hand_to=[TRAINER],
        )
        return recorded.verdict

    verdicts = [accepted(counter) for counter in range(4)]
    poison = verdicts[1].id
    taken: list[bytes] = []
    tries = {"poison": 0}

    async def request(peer: str, name: str, body: bytes, limits: Any) -> bytes:
        assert peer == TRAINER
        verdict_raw = msgpack.unpackb(body)[1]
        if verdict_raw == verdicts[1].raw:
            tries["poison"] += 1
            raise PeerError("this trainer refuses that sample, always")
        taken.append(verdict_raw)
        return b""

    monkeypatch.setattr(validator.node, "request", request, raising=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(validator._deliver)
        await wait_until(lambda: validator.dead_letters, timeout=10)
        # A later hand-off is delivered while the dead letter stays where it is.
        late = accepted(4)
        validator._handoff.set()
        await wait_until(lambda: late.raw in taken, timeout=10)
        nursery.cancel_scope.cancel()
    assert sorted(taken) == sorted([*(v.raw for v in verdicts if v.id != poison), late.raw])
    assert tries["poison"] == validator_module.DEAD_AFTER_REFUSALS
    assert validator.ledger.pending_handoffs() == [(poison, TRAINER)]  # kept, visible
    (dead,) = validator.dead_letter_status()
    assert dead["verdict"] == poison.hex() and "refuses that sample" in dead["last_answer"]


async def test_a_dead_trainers_share_goes_to_the_next_at_once_and_back_when_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A backoff long enough to fail the test if the live trainer's share waited on it.
    monkeypatch.setattr(validator_module, "RETRY_FIRST_S", 60.0)
    monkeypatch.setattr(validator_module, "AWAY_S", 0.5)
    validator = stub_validator(tmp_path, UnusedEngine())  # type: ignore[arg-type]
    dead, live = NodeKey.from_seed(b"\x21" * 32).peer_id, NodeKey.from_seed(b"\x22" * 32).peer_id
    genesis = SimpleNamespace(message=SimpleNamespace(trainers=[dead, live]))
    monkeypatch.setattr(validator.node, "config", SimpleNamespace(genesis=genesis))

    def accepted(counter: int) -> Signed[Verdict]:
        sample = Sample("1", (1, 2), 0, (b"\x00",), "stop")
        sub = sign(RolloutSubmission(RUN, VERSION, counter, ("1",), (sample,), 1), WORKER)
        return record_judgement(
            validator.ledger,
            validator.evidence.store,
            ME,
            sub,
            Judgement(True, "none", [], [1.0]),
            PARAMS,
            hand_to=[TRAINER],
        ).verdict

    def first_choice(verdict: Signed[Verdict]) -> str:
        return trainer_order(verdict.message.submission_id, [dead, live])[0]

    verdicts = [accepted(counter) for counter in range(8)]
    assert {first_choice(v) for v in verdicts} == {dead, live}
    taken: dict[str, list[bytes]] = {dead: [], live: []}
    dials = {dead: 0}
    state = {"dead_is_back": False}

    async def request(peer: str, name: str, body: bytes, limits: Any) -> bytes:
        if peer == dead and not state["dead_is_back"]:
            dials[dead] += 1
            raise NetworkError(f"cannot open a stream to {peer}: connection refused")
        taken[peer].append(msgpack.unpackb(body)[1])
        return b""

    async def forget_peer(peer: str) -> None:
        pass

    monkeypatch.setattr(validator.node, "request", request, raising=False)
    monkeypatch.setattr(validator.node, "forget_peer", forget_peer, raising=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(validator._deliver)
        # Every item reaches the live trainer at once (no 60 s backoff), the dead one dialed
        # once for the whole outbox, not once per item of its share.
        await wait_until(lambda: len(taken[live]) == len(verdicts), timeout=10)
        assert dials[dead] == 1
        state["dead_is_back"] = True
        # Passed over for AWAY_S, then offered its share again.
        await wait_until(lambda: trio.current_time() >= validator._away[dead], timeout=10)
        later = []
        for counter in range(8, 40):  # until one whose first choice is the returned trainer
            later.append(accepted(counter))
            if first_choice(later[-1]) == dead:
                break

        def back_with_it() -> bool:
            validator._handoff.set()  # new work: the outbox is read again
            return later[-1].raw in taken[dead]

        await wait_until(back_with_it, timeout=10)
        nursery.cancel_scope.cancel()
    assert not validator.ledger.pending_handoffs()

"""The validator's outbox (issue 15): a trainer that refuses one hand-off forever does not hold
up the rest; after ``DEAD_AFTER_REFUSALS`` refusals the item is a dead letter, kept in the
outbox and shown in ``status``, and no longer tried."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

import node.roles.validator as validator_module
from node.roles.judge import Judgement
from node.roles.verdicts import record_judgement
from swarm.errors import PeerError
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

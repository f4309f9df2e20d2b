"""The trainer's intake of accepted work: work that already left the async window is taken and
dropped, never queued, so the queue only holds what a step can still train; either way the
answer is the trainer's signed receipt (queued with its place, or not)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import msgpack
import trio

from node.roles.sample_queue import SampleQueue
from node.roles.trainer import Trainer
from node.roles.trainer_records import TrainingLog
from node.roles.trainer_stats import TrainerStats
from swarm.identity import NodeKey
from swarm.messages import (
    REWARD_SCALE,
    RolloutSubmission,
    Sample,
    SampleReceipt,
    Verdict,
    decode,
    sign,
)
from tests.ledger_factory import PARAMS, RUN_ID, VALIDATOR, genesis

WORKER = NodeKey.from_seed(bytes(range(32)))
TRAINER = NodeKey.from_seed(b"\x71" * 32)


def _trainer(tmp_path: Path, version: int) -> Trainer:
    t = Trainer.__new__(Trainer)
    config = SimpleNamespace(genesis=genesis())
    t.node = SimpleNamespace(config=config, run_id=RUN_ID, key=TRAINER)  # type: ignore[assignment]
    t.params = replace(PARAMS, group_size=2, async_level=2)
    t.suite = SimpleNamespace(task=lambda pid: SimpleNamespace(prompt=f"prompt {pid}"))  # type: ignore[assignment]
    t.queue = SampleQueue(tmp_path / "samples.db")
    t.stats = TrainerStats()
    t.version = version
    t._arrived = trio.Event()
    t.log = TrainingLog(t.node, None, tmp_path / "states")  # type: ignore[arg-type]
    return t


def _work(version: int, counter: int) -> bytes:
    samples = tuple(Sample("7", (1, 2, i), counter, (), "stop") for i in range(2))
    sub = sign(RolloutSubmission(RUN_ID, version, counter, ("7",), samples, 5), WORKER)
    verdict = sign(
        Verdict(
            RUN_ID,
            sub.id,
            WORKER.peer_id,
            True,
            "none",
            (),
            (REWARD_SCALE // 2, 0),
            6,
            policy_version=version,
            counter=counter,
        ),
        VALIDATOR,
    )
    return msgpack.packb([sub.raw, verdict.raw], use_bin_type=True)  # type: ignore[no-any-return]


async def test_work_older_than_the_window_is_taken_and_not_queued(tmp_path: Path) -> None:
    t = _trainer(tmp_path, version=10)  # the window is v8..v10
    old = decode(await t._on_samples(VALIDATOR.peer_id, _work(7, 1)), SampleReceipt)
    assert old.signer == TRAINER.peer_id and not old.message.queued
    assert old.message.trainer_version == 10 and old.message.sample_version == 7
    new = decode(await t._on_samples(VALIDATOR.peer_id, _work(8, 2)), SampleReceipt)
    assert new.message.queued and new.message.seq == 1 and new.message.worker == WORKER.peer_id
    again = decode(await t._on_samples(VALIDATOR.peer_id, _work(8, 2)), SampleReceipt)
    assert again.message.seq == 1  # a re-delivery gets its first place
    assert t.queue.pending() == 1 and t.queue.pending(8) == 1
    assert t.stats.too_old == 1 and t.stats.queued == 1

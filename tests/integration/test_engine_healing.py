"""Self-healing (issue 15): kill -9 of the engine child in the middle of a judgement, and the
validator restarts it and judges the next honest submission; a child that keeps dying is given
up after the limit, said in ``status`` and the log, and the role is withdrawn."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from node.compute.child import ChildEngine
from node.compute.healing import EngineHealer
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.run import suite_for
from swarm.assignment import assign
from swarm.errors import EngineError
from swarm.identity import NodeKey
from swarm.messages import RolloutSubmission, Signed, sign
from tests.validator_stub import GENESIS, MANIFESTS, PARAMS, RUN, VERSION, stub_validator

WORKER = NodeKey.from_seed(b"\x15" * 32)


def honest(counter: int) -> Signed[RolloutSubmission]:
    engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="float32")
    suite = suite_for(GENESIS.message)
    a = assign(
        RUN,
        VERSION,
        WORKER.peer_id,
        counter,
        n_prompts=PARAMS.batch_prompts,
        suite_size=suite.size,
        excluded=suite.excluded,
        manifest_id=MANIFESTS[VERSION],
    )
    groups = generate_groups(engine, suite, a, PARAMS)
    return sign(build_submission(groups, run_id=RUN, version=VERSION, counter=counter), WORKER)


@pytest.fixture
def child() -> Iterator[ChildEngine]:
    eng = ChildEngine(DEFAULT_MODEL_DIR, threads=1)
    yield eng
    eng.close()


@pytest.mark.slow
async def test_a_child_killed_mid_judgement_is_restarted_and_the_next_work_judged(
    tmp_path: Path, child: ChildEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    validator = stub_validator(tmp_path, child, DEFAULT_MODEL_DIR / "model.safetensors")
    validator.healer.first_backoff_s = 0.0
    verify = child.verify
    first_pid = child.pid
    assert first_pid is not None

    def killed_mid_judgement(*args: Any) -> Any:
        monkeypatch.setattr(child, "verify", verify)  # once
        os.kill(first_pid, signal.SIGKILL)
        return verify(*args)

    monkeypatch.setattr(child, "verify", killed_mid_judgement)
    first = await trio.to_thread.run_sync(honest, 0)
    with pytest.raises(EngineError, match="restarted; send again"):
        await validator.handle(first)
    assert validator.healer.status() == {"restarts": 1, "failed": None}
    assert child.pid not in (None, first_pid)

    # The resend is judged (its claim held no verdict), and so is the next piece of work.
    assert (await validator.handle(first)).message.accepted
    second = await trio.to_thread.run_sync(honest, 1)
    assert (await validator.handle(second)).message.accepted
    assert validator.stats.accepted == 2


class DyingEngine:
    def __init__(self, restart_fails: bool = False) -> None:
        self.restarted = 0
        self.restart_fails = restart_fails

    def restart(self) -> None:
        if self.restart_fails:
            raise EngineError("the model does not load")
        self.restarted += 1


async def test_the_healer_backs_off_then_gives_up_after_its_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    given_up: list[str] = []

    async def withdraw(why: str) -> None:
        given_up.append(why)

    engine = DyingEngine()
    healer = EngineHealer(
        engine, max_restarts=2, first_backoff_s=0.01, max_backoff_s=0.02, on_give_up=withdraw
    )
    died = EngineError("engine child (pid 1) has exited; exit code -9")
    assert await healer.recover(died) and await healer.recover(died)
    assert engine.restarted == 2 and not given_up
    assert not await healer.recover(died)
    assert engine.restarted == 2 and healer.failed is not None
    assert "died 3 times" in healer.failed and given_up == [healer.failed]
    assert "giving up" in caplog.text
    assert not await healer.recover(died) and len(given_up) == 1  # said once


async def test_a_restart_that_fails_gives_up_at_once() -> None:
    healer = EngineHealer(DyingEngine(restart_fails=True), first_backoff_s=0.0)
    assert not await healer.recover(EngineError("gone"))
    assert healer.failed is not None and "does not load" in healer.failed


async def test_restarts_outside_the_window_do_not_count() -> None:
    now = [0.0]
    healer = EngineHealer(
        DyingEngine(), max_restarts=1, window_s=60, first_backoff_s=0.0, clock=lambda: now[0]
    )
    for _ in range(3):
        assert await healer.recover(EngineError("gone"))
        now[0] += 61
    assert healer.restarts == 3 and healer.failed is None

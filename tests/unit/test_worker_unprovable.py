"""A worker whose newest policy gives work no proof can commit to (its weights hold inf or
NaN: a broken step) leaves that version and goes on, on an older version still in the window
and then on the next one; it does not stop."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from node.roles.worker import Held, InferenceWorker
from swarm.errors import ProofError
from swarm.messages import RunParams


class _Engine:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_weights(self, path: str) -> None:
        self.loaded.append(path)


async def test_a_policy_that_gives_no_provable_work_is_left_and_the_worker_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    newest = SimpleNamespace(message=SimpleNamespace(version=2))
    node: Any = SimpleNamespace(
        config=SimpleNamespace(
            genesis=SimpleNamespace(
                message=SimpleNamespace(params=RunParams(async_level=2, quota=0))
            )
        ),
        policy=SimpleNamespace(newest=newest),
    )
    engine = _Engine()
    worker = InferenceWorker(node, None, engine, tmp_path, suite=SimpleNamespace())  # type: ignore[arg-type]
    worker._fetched = {1: Held(tmp_path / "v1", b"1"), 2: Held(tmp_path / "v2", b"2")}
    worked: list[int] = []

    async def work_once() -> None:
        if worker.loaded == 2:
            raise ProofError("hidden states hold inf or NaN; no proof can commit to them")
        worked.append(worker.loaded or -1)
        if len(worked) == 1:  # the next version arrives
            worker._fetched[3] = Held(tmp_path / "v3", b"3")
            newest.message.version = 3
        await trio.sleep(0)

    async def no_follow() -> None:
        await trio.sleep_forever()

    monkeypatch.setattr(worker, "work_once", work_once)
    monkeypatch.setattr(worker, "_follow", no_follow)
    with trio.move_on_after(10) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run)
            while 3 not in worked:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught, worked
    assert worker.stats.unprovable_versions == [2]
    assert worked[0] == 1 and 3 in worked  # v1 while in the window, then v3; v2 never again
    assert 2 not in worker._fetched
    assert engine.loaded[:3] == [str(tmp_path / p) for p in ("v2", "v1", "v3")]

"""py-libp2p's late spawn at shutdown is logged, never raised over a finished run; any other
error, or one raised while the run is still going, goes through."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from swarm.identity import NodeKey
from swarm.net.overlay import Overlay


def failing_at_exit(exc: BaseException) -> object:
    @asynccontextmanager
    async def run(self: Overlay) -> AsyncIterator[None]:
        yield
        raise ExceptionGroup("services", [ExceptionGroup("network", [exc])])  # type: ignore[list-item]

    return run


async def test_a_late_spawn_while_stopping_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        Overlay, "_run", failing_at_exit(RuntimeError("Nursery is closed to new arrivals"))
    )
    async with Overlay.start(NodeKey.generate()):
        pass
    assert "closed nursery while stopping" in caplog.text


async def test_any_other_error_at_exit_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Overlay, "_run", failing_at_exit(RuntimeError("something else")))
    with pytest.raises(ExceptionGroup) as caught:
        async with Overlay.start(NodeKey.generate()):
            pass
    assert caught.group_contains(RuntimeError, match="something else")


async def test_a_late_spawn_during_a_failed_run_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        Overlay, "_run", failing_at_exit(RuntimeError("Nursery is closed to new arrivals"))
    )
    with pytest.raises(ValueError):
        async with Overlay.start(NodeKey.generate()):
            raise ValueError("the run failed")


async def test_a_late_spawn_in_the_owners_own_teardown_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A node's tasks stop before its overlay: one of them may meet the closed nursery then."""

    @asynccontextmanager
    async def run(self: Overlay) -> AsyncIterator[None]:
        yield

    monkeypatch.setattr(Overlay, "_run", run)
    async with Overlay.start(NodeKey.generate()) as overlay:
        overlay.stopping = True  # as Node.start sets it once its run ended normally
        raise ExceptionGroup("node", [RuntimeError("Nursery is closed to new arrivals")])
    assert "closed nursery while stopping" in caplog.text

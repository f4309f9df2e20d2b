"""A provider record no peer took is placed again (``ShardcastService.advertise``): at a cap
of 12 a holder whose closest peers sat at theirs placed it nowhere, and no fetch outside its
connections could find it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from node.shardcast import ADVERTISE_RETRY_S, ShardcastService
from swarm.errors import NetworkError
from swarm.shardcast import ShardStore
from swarm.shardcast.serve import ShardServer
from tests.shardcast_util import genesis


class Records:
    """py-libp2p's answers in turn: whether any peer took the record, or an error."""

    def __init__(self, answers: list[bool | Exception]) -> None:
        self.answers = answers
        self.asked: list[float] = []

    async def provide(self, key: str) -> bool:
        self.asked.append(trio.current_time())
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def service(tmp_path: Path, records: Records) -> ShardcastService:
    store = ShardStore(tmp_path / "store")
    node = SimpleNamespace(overlay=SimpleNamespace(records=records))
    return ShardcastService(node, genesis(), store, ShardServer(store), None)


async def test_a_record_no_peer_took_is_placed_again_until_one_does(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    records = Records([False, NetworkError("no route"), True])
    start = trio.current_time()
    await service(tmp_path, records).advertise(2)
    pauses = [b - a for a, b in zip([start, *records.asked], records.asked, strict=False)]
    assert pauses == pytest.approx([0.0, *ADVERTISE_RETRY_S[:2]])
    assert records.answers == []


async def test_past_the_last_try_it_says_so_and_gives_up(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    records = Records([False] * (len(ADVERTISE_RETRY_S) + 1))
    await service(tmp_path, records).advertise(2)
    assert len(records.asked) == len(ADVERTISE_RETRY_S) + 1
    assert "could not advertise version 2: no peer took the record" in caplog.text


async def test_a_record_placed_at_once_is_placed_once(tmp_path: Path) -> None:
    records = Records([True])
    await service(tmp_path, records).advertise(2)
    assert len(records.asked) == 1

"""A receiver killed with SIGKILL resumes without refetching; a full disk marks nothing."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from swarm.errors import StorageError
from swarm.shardcast import FetchConfig, ShardSink, ShardStore, fetch_version
from swarm.shardcast.datachannel import DataChannelConfig, DataChannelServer, DataChannelSource
from swarm.shardcast.local import DirectControl
from swarm.shardcast.serve import ShardServer
from tests.shardcast_util import published

ROOT = Path(__file__).resolve().parents[2]


class CountingSource(DataChannelSource):
    def __init__(self, control: DirectControl) -> None:
        super().__init__(control.negotiate, control)
        self.pulled: list[int] = []

    async def pull(self, peer: str, version: int, index: int, sink: ShardSink) -> None:
        self.pulled.append(index)
        await super().pull(peer, version, index, sink)


def child(store: Path, manifest: Path, port: int, server: ShardServer, *extra: str) -> list[str]:
    tokens = ",".join(server.issue_token("child").hex() for _ in range(64))
    return [
        sys.executable,
        "-m",
        "tests.integration.shardcast_receiver",
        str(store),
        str(manifest),
        str(port),
        tokens,
        *extra,
    ]


async def test_a_receiver_killed_mid_fetch_resumes_without_fetching_a_verified_shard_again(
    tmp_path: Path,
) -> None:
    _, signed, trainer = published(tmp_path, size=1_500_000, shard_size=32_768)
    data = (trainer.directory(1) / "data").read_bytes()
    (tmp_path / "manifest").write_bytes(signed.raw)
    server = ShardServer(trainer)
    channel = DataChannelServer(server, DataChannelConfig(rate_limit=1.5e6))
    rx = tmp_path / "rx"
    async with trio.open_nursery() as nursery:
        port = await nursery.start(channel.run)
        proc = subprocess.Popen(
            child(rx, tmp_path / "manifest", port, server), cwd=ROOT, stderr=subprocess.PIPE
        )
        journal = rx / "v000000000001" / "verified"
        try:
            with trio.fail_after(20):
                while not journal.exists() or journal.read_bytes().count(1) < 5:
                    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                    await trio.sleep(0.01)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        before = {i for i, b in enumerate(journal.read_bytes()) if b == 1}
        assert 5 <= len(before) < len(signed.message.shard_hashes)

        control = DirectControl({"seeder": server}, {"seeder": port})
        source = CountingSource(control)
        result = await fetch_version(
            ShardStore(rx),
            signed,
            source,
            ["seeder"],
            config=FetchConfig(stall_timeout=5.0),
            rng=random.Random(0),
        )
        source.close()
        nursery.cancel_scope.cancel()
    refetched = before & set(source.pulled)
    assert len(refetched) == 0
    assert result.resumed_shards == len(before)
    assert result.path.read_bytes() == data


async def test_disk_full_during_a_fetch_is_a_clear_error_and_nothing_is_complete(
    tmp_path: Path,
) -> None:
    _, signed, trainer = published(tmp_path, size=400_000, shard_size=32_768)
    (tmp_path / "manifest").write_bytes(signed.raw)
    server = ShardServer(trainer)
    rx = tmp_path / "rx"
    async with trio.open_nursery() as nursery:
        port = await nursery.start(DataChannelServer(server).run)
        result = await trio.run_process(
            child(rx, tmp_path / "manifest", port, server, "100000"),
            cwd=ROOT,
            capture_stderr=True,
            check=False,
        )
        nursery.cancel_scope.cancel()
    assert result.returncode == 3, result.stderr
    assert b"disk full" in result.stderr
    assert not ShardStore(rx).is_complete(1)


async def test_disk_full_after_preallocation_stops_the_fetch_unmarked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, signed, trainer = published(tmp_path, size=400_000, shard_size=32_768)
    server = ShardServer(trainer)
    real = os.pwrite
    calls = {"n": 0}

    def pwrite_until_full(fd: int, data: bytes, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(DataChannelServer(server).run)
        control = DirectControl({"seeder": server}, {"seeder": port})
        source = DataChannelSource(control.negotiate, control)
        monkeypatch.setattr(os, "pwrite", pwrite_until_full)
        with pytest.raises(StorageError, match="disk full"):
            await fetch_version(
                ShardStore(tmp_path / "rx"), signed, source, ["seeder"], config=FetchConfig()
            )
        monkeypatch.undo()
        source.close()
        nursery.cancel_scope.cancel()
    assert not ShardStore(tmp_path / "rx").is_complete(1)

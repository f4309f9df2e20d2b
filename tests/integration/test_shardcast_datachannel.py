"""The data channel on real loopback sockets: fetches, faulty seeders, hostile requests."""

from __future__ import annotations

import dataclasses
import random
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from swarm.messages import ShardManifest, Signed
from swarm.shardcast import FetchConfig, FetchResult, ShardStore, fetch_version
from swarm.shardcast.datachannel import (
    MAGIC,
    DataChannelConfig,
    DataChannelServer,
    DataChannelSource,
)
from swarm.shardcast.local import DirectControl
from swarm.shardcast.serve import ShardServer
from swarm.shardcast.source import PeerBusy, ShardSink
from tests.shardcast_util import published, seeder_store

CONFIG = FetchConfig(concurrency=4, stall_timeout=2.0, have_refresh=0.05, durable=False)


@dataclass
class Swarm:
    signed: Signed[ShardManifest]
    data: bytes
    servers: dict[str, ShardServer]
    channels: dict[str, DataChannelServer]
    scopes: dict[str, trio.CancelScope]
    control: DirectControl

    def source(self) -> DataChannelSource:
        return DataChannelSource(self.control.negotiate, self.control)

    async def fetch(self, root: Path, config: FetchConfig = CONFIG, **kw: object) -> FetchResult:
        source = self.source()
        try:
            return await fetch_version(
                ShardStore(root),
                self.signed,
                source,
                list(self.servers),
                config=config,
                rng=random.Random(0),
                **kw,  # type: ignore[arg-type]
            )
        finally:
            source.close()


@asynccontextmanager
async def swarm(
    tmp_path: Path, faults: dict[str, str], rate: float | None = None, size: int = 400_000
) -> AsyncIterator[Swarm]:
    _, signed, store = published(tmp_path, size=size, shard_size=32_768)
    data = (store.directory(1) / "data").read_bytes()
    servers = {
        name: ShardServer(seeder_store(tmp_path / name, signed, data, fault=fault))
        for name, fault in faults.items()
    }
    async with trio.open_nursery() as nursery:
        channels: dict[str, DataChannelServer] = {}
        scopes: dict[str, trio.CancelScope] = {}
        for name, server in servers.items():
            channel = DataChannelServer(server, DataChannelConfig(rate_limit=rate))
            scope = trio.CancelScope()

            async def run(
                channel: DataChannelServer = channel,
                scope: trio.CancelScope = scope,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                with scope:
                    await channel.run(task_status=task_status)

            await nursery.start(run)
            channels[name], scopes[name] = channel, scope
        control = DirectControl(servers, {n: c.port for n, c in channels.items()})
        yield Swarm(signed, data, servers, channels, scopes, control)
        nursery.cancel_scope.cancel()


async def test_fetch_over_data_channels_from_two_seeders(tmp_path: Path) -> None:
    async with swarm(tmp_path, {"a": "ok", "b": "ok"}) as s:
        result = await s.fetch(tmp_path / "rx")
        assert result.path.read_bytes() == s.data
        assert s.servers["a"].served_shards > 0 and s.servers["b"].served_shards > 0


@pytest.mark.parametrize("fault", ["corrupt", "truncate"])
async def test_a_seeder_with_a_damaged_file_is_dropped_and_the_file_matches(
    tmp_path: Path, fault: str
) -> None:
    async with swarm(tmp_path, {"honest": "ok", "bad": fault}) as s:
        result = await s.fetch(tmp_path / "rx")
        assert result.path.read_bytes() == s.data
        assert result.progress.board is not None
        bad = result.progress.board.stats["bad"]
        assert bad.dropped
        assert bad.shards == 0 or fault == "truncate"  # the first half of its file is intact
        assert ("corrupt" if fault == "corrupt" else "truncated") in bad.last_error


async def test_a_seeder_dying_mid_transfer_is_replaced(tmp_path: Path) -> None:
    async with swarm(tmp_path, {"a": "ok", "dies": "ok"}, rate=2e6, size=600_000) as s:
        async with trio.open_nursery() as nursery:
            result: list[FetchResult] = []

            async def run() -> None:
                result.append(await s.fetch(tmp_path / "rx"))

            nursery.start_soon(run)
            with trio.fail_after(10):
                while s.servers["dies"].served_shards < 1:
                    await trio.sleep(0.01)
            s.scopes["dies"].cancel()  # the seeder process is gone, mid-shard
        assert result[0].path.read_bytes() == s.data
        assert result[0].progress.board is not None
        assert result[0].progress.board.stats["dies"].failures >= 1


async def test_a_stalling_seeder_is_timed_out(tmp_path: Path) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    stuck_port = listener.socket.getsockname()[1]
    held: list[trio.SocketStream] = []

    async def stall() -> None:
        while True:
            stream = await listener.accept()
            held.append(stream)
            await stream.receive_some(20)  # the hello
            await stream.send_all(b"\0")  # "ok", then never answer a request

    async with swarm(tmp_path, {"honest": "ok", "stuck": "ok"}) as s, trio.open_nursery() as n:
        n.start_soon(stall)
        s.control.ports = {**s.control.ports, "stuck": stuck_port}
        with trio.fail_after(20):
            result = await s.fetch(tmp_path / "rx", dataclasses.replace(CONFIG, endgame=False))
        assert result.path.read_bytes() == s.data
        assert result.progress.board is not None
        assert "stalled" in result.progress.board.stats["stuck"].last_error
        n.cancel_scope.cancel()


async def _client(port: int, token: bytes) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(MAGIC + token)
    return stream


async def _answer(stream: trio.SocketStream) -> tuple[int, bytes]:
    buf = b""
    while len(buf) < 1:
        buf += await stream.receive_some(1)
    status = buf[0]
    if status == 0:
        return 0, b""
    head = b""
    while len(head) < 2:
        head += await stream.receive_some(2 - len(head))
    (n,) = struct.unpack(">H", head)
    body = b""
    while len(body) < n:
        body += await stream.receive_some(n - len(body))
    return status, body


async def test_hostile_requests_get_clear_errors_and_the_server_keeps_serving(
    tmp_path: Path,
) -> None:
    async with swarm(tmp_path, {"a": "ok"}) as s:
        server, port = s.servers["a"], s.channels["a"].port
        stream = await _client(port, b"x" * 16)
        assert (await _answer(stream))[1].startswith(b"unknown or expired data channel token")
        await stream.aclose()

        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\n\r\n\0\0")
        assert b"not a SHARDCAST" in (await _answer(stream))[1]
        await stream.aclose()

        stream = await _client(port, server.issue_token("t"))
        assert await _answer(stream) == (0, b"")
        cases = [
            ((99, 0, 0, 10), 2, b"version 99 is not held"),
            ((1, 2**32 - 1, 0, 10), 1, b"shard index 4294967295 out of range"),
            ((1, 0, 2**63, 10), 1, b"outside shard 0"),
            ((1, 0, 0, 2**64 - 1), 1, b"outside shard 0"),
            ((1, 0, 32_000, 1_000), 1, b"outside shard 0"),
        ]
        for fields, status, reason in cases:
            await stream.send_all(struct.pack(">QIQQ", *fields))
            got = await _answer(stream)
            assert got[0] == status and reason in got[1], (fields, got)
        # the same connection still serves a valid request
        await stream.send_all(struct.pack(">QIQQ", 1, 1, 100, 50))
        assert (await _answer(stream))[0] == 0
        buf = b""
        while len(buf) < 8 + 50:
            buf += await stream.receive_some(8 + 50 - len(buf))
        assert struct.unpack(">Q", buf[:8])[0] == 50
        assert buf[8:] == s.data[32_768 + 100 : 32_768 + 150]
        await stream.aclose()

        stream = await _client(port, b"\0" * 16)  # a used or unknown token stays refused
        assert (await _answer(stream))[0] == 1
        await stream.aclose()
        result = await s.fetch(tmp_path / "rx")
        assert result.path.read_bytes() == s.data


async def test_a_seeder_with_every_upload_slot_taken_answers_busy_and_stays_usable(
    tmp_path: Path,
) -> None:
    async with swarm(tmp_path, {"full": "ok"}) as s:
        server = s.servers["full"]
        server.max_uploads = 1
        server.take_slot()  # another asker holds its only slot
        source = s.source()
        rx = ShardStore(tmp_path / "rx")
        try:
            with rx.open(s.signed) as vf:
                vf.preallocate()
                with pytest.raises(PeerBusy, match="upload slots"):
                    await source.pull("full", 1, 0, ShardSink(vf, 0))
                server.release_slot()
                sink = ShardSink(vf, 0)
                await source.pull("full", 1, 0, sink)  # same connection, now served
                assert sink.received == sink.length
        finally:
            source.close()
        assert server.busy_refusals == 1 and source.connects == 1


async def test_a_seeder_with_every_connection_taken_answers_busy_not_a_closed_socket(
    tmp_path: Path,
) -> None:
    async with swarm(tmp_path, {"full": "ok"}) as s:
        s.channels["full"].config.max_connections = 1
        first, second = s.source(), s.source()
        rx = ShardStore(tmp_path / "rx")
        try:
            with rx.open(s.signed) as vf:
                vf.preallocate()
                sink = ShardSink(vf, 0)
                await first.pull("full", 1, 0, sink)  # its connection stays open (pooled)
                with pytest.raises(PeerBusy, match="data channel connections are in use"):
                    await second.pull("full", 1, 1, ShardSink(vf, 1))
                first.close()  # the slot comes free
                sink = ShardSink(vf, 1)
                with trio.fail_after(5):
                    while True:
                        try:
                            await second.pull("full", 1, 1, sink)
                            break
                        except PeerBusy:
                            await trio.sleep(0.05)
                assert sink.received == sink.length
        finally:
            first.close()
            second.close()
        assert s.channels["full"].turned_away >= 1

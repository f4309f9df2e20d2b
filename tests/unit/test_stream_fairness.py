"""Per-peer stream slots (issue 15): one peer cannot hold every slot of a protocol, and the
reserved slots open only to trusted peers (a validator's workers with accepted work), so a flood
of fresh identities competes only with itself. Streams are stand-ins that hold their slot until
released; the server is the real ``StreamServer``."""

from __future__ import annotations

import struct
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from swarm.net.streams import StreamLimits, StreamServer


class HeldStream:
    """A request that arrives when ``release`` is set."""

    def __init__(self, peer: str, release: trio.Event) -> None:
        self.muxed_conn = SimpleNamespace(peer_id=peer)
        self.release = release
        self.was_reset = False
        self.answered = False
        self._body = struct.pack(">I", 2) + b"hi"

    async def read(self, n: int) -> bytes:
        await self.release.wait()
        out, self._body = self._body[:n], self._body[n:]
        return out

    async def write(self, data: bytes) -> None:
        self.answered = True

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        self.was_reset = True


async def echo(peer: str, body: bytes) -> bytes:
    return body


async def test_per_peer_cap_and_reserved_slots_for_trusted_peers() -> None:
    server = StreamServer("/t/1", echo, StreamLimits(concurrency=3, per_peer=2, reserved=1))
    server.trusted = lambda peer: peer == "earned"
    release = trio.Event()
    streams: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:

        async def open_(name: str, peer: str) -> None:
            streams[name] = HeldStream(peer, release)
            nursery.start_soon(server, streams[name])
            await trio.testing.wait_all_tasks_blocked()

        await open_("a1", "flooder")
        await open_("a2", "flooder")
        await open_("a3", "flooder")  # over its per-peer cap: shed at once
        assert streams["a3"].was_reset and server.shed == 1
        await open_("b1", "fresh")  # the last shared slot
        await open_("c1", "fresh-2")  # shared slots full, not trusted: shed
        assert streams["c1"].was_reset and server.shed == 2
        await open_("e1", "earned")  # shared slots full, trusted: the reserved slot
        assert not streams["e1"].was_reset
        await open_("e2", "earned")  # reserved slot taken too
        assert streams["e2"].was_reset and server.shed == 3
        release.set()
    served = [n for n, s in streams.items() if s.answered]
    assert sorted(served) == ["a1", "a2", "b1", "e1"] and server.served == 4
    # Slots are given back: the flooder may open streams again.
    again = HeldStream("flooder", release)
    await server(again)
    assert again.answered and not again.was_reset


class RecordingStream(HeldStream):
    def __init__(self, peer: str, release: trio.Event) -> None:
        super().__init__(peer, release)
        self.written = b""

    async def write(self, data: bytes) -> None:
        self.answered = True
        self.written += data


async def test_with_a_shed_answer_a_stream_past_the_slots_is_told_busy_not_reset() -> None:
    """SHARDCAST's protocols: an asker told "busy" rests without blaming the server; a reset
    was a fault, and at N = 100 receivers dropped the trainer for its full slots."""
    limits = StreamLimits(concurrency=1, shed_answer="busy: every slot is in use")
    server = StreamServer("/t/1", echo, limits)
    release = trio.Event()
    held, shed = RecordingStream("a", release), RecordingStream("b", release)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server, held)
        await trio.testing.wait_all_tasks_blocked()
        await server(shed)  # answered at once, its request unread
        assert not shed.was_reset and server.shed == 1
        assert shed.written == struct.pack(">I", 27) + b"\x01busy: every slot is in use"
        release.set()
    assert held.written.endswith(b"\x00hi")

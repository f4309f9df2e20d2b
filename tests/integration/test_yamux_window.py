"""Yamux window updates by go-yamux's rule (``swarm/net/yamux.py``): none for small requests,
a few for a stream longer than the window, and a reader taking small pieces still gets
everything (the writer is never left waiting for an update)."""

from __future__ import annotations

from typing import Any

import pytest
from libp2p.peer.id import ID
from libp2p.stream_muxer.yamux.yamux import YamuxStream

from swarm.net.yamux import install_go_yamux_window_updates
from tests.netfactory import NetFactory, key_named

WINDOW = 256 * 1024
"""py-libp2p's (and go-yamux's) initial receive window."""


@pytest.fixture
def updates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The increments of the window updates sent, in order."""
    sent: list[int] = []
    send = YamuxStream.send_window_update

    async def counted(self: Any, increment: int, skip_lock: bool = False) -> None:
        if increment > 0:
            sent.append(increment)
        await send(self, increment, skip_lock)

    monkeypatch.setattr(YamuxStream, "send_window_update", counted)
    return sent


def test_the_rule_is_installed_once() -> None:
    assert install_go_yamux_window_updates()
    installed = YamuxStream._auto_tune_and_send_window_update
    assert install_go_yamux_window_updates()
    assert YamuxStream._auto_tune_and_send_window_update is installed


@pytest.mark.parametrize("piece", [1_000, 1 << 20])
async def test_small_requests_send_no_update_and_a_long_stream_arrives_whole(
    updates: list[int], piece: int
) -> None:
    size = 8 * 1024 * 1024  # 32 windows: the writer waits for updates
    async with NetFactory() as net:
        alice = await net.node("inference", key_named("alice"), bootstrap=[])
        bob = await net.node("inference", key_named("bob"), bootstrap=[])
        assert await alice.overlay.connect(bob.peer_id, bob.overlay.addrs()) is None

        updates.clear()
        for _ in range(20):  # DHT requests on the connection: length prefixes read bytewise
            assert await alice.overlay.records.get_advert(alice.run_id, bob.peer_id)
        assert updates == []  # py-libp2p's own rule sent about 14 a request

        data = bytes(range(256)) * (size // 256)

        async def serve(stream: Any) -> None:
            for at in range(0, size, 1 << 20):
                await stream.write(data[at : at + (1 << 20)])
            await stream.close()

        bob.overlay.host.set_stream_handler("/test/bulk/1", serve)
        stream = await alice.overlay.host.new_stream(ID.from_base58(bob.peer_id), ["/test/bulk/1"])
        got = bytearray()
        while len(got) < size:
            chunk = await stream.read(piece)
            if not chunk:
                break
            got += chunk
        assert bytes(got) == data
        # One update per half window read at most (fewer once the window grows).
        assert 1 <= len(updates) <= size // (WINDOW // 2) + 2, updates

"""A request to a peer whose every address fails: ``PeerUnreachable``, saying what py-libp2p's
"unable to connect ... (with exceptions)" hides (the fetch rests such a peer instead of
dropping it at once: ``swarm.shardcast.peers.PeerBoard.record_failure``)."""

from __future__ import annotations

import socket

import multiaddr
import pytest
from libp2p.peer.id import ID

from swarm.errors import PeerUnreachable
from swarm.net.host import build_host
from swarm.net.streams import request
from tests.netfactory import key_named


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_peer_at_a_closed_port_is_unreachable_and_the_error_names_the_port() -> None:
    port = _closed_port()
    host = build_host(key_named("asker"), ["/ip4/127.0.0.1/tcp/0"])
    gone = key_named("gone").peer_id
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        host.get_peerstore().add_addrs(
            ID.from_base58(gone), [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")], 60
        )
        with pytest.raises(PeerUnreachable) as caught:
            await request(host, gone, "/swarm-node/test/1", b"hi")
    message = str(caught.value)
    assert message.startswith(f"cannot open /swarm-node/test/1 to {gone}: ")
    assert f"127.0.0.1:{port}" in message and "with exceptions" not in message

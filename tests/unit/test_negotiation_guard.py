"""A protocol handler removed while py-libp2p negotiates it (``Overlay._quiesce`` removes
GossipSub's while a node stops) is a failed negotiation, never a ``KeyError`` that ends the host
(``swarm.net.host._GuardedMultiselect``; a CI failure of the validators' swarm audit)."""

from __future__ import annotations

import pytest
from libp2p.custom_types import TProtocol
from libp2p.protocol_muxer.exceptions import MultiselectError
from libp2p.protocol_muxer.multiselect import Multiselect

from swarm.net.host import _GuardedMultiselect, build_host
from tests.netfactory import LOOPBACK, key_named

GOSSIP = TProtocol("/meshsub/1.1.0")


class Peer:
    """The remote side: asks for the protocol; the handler goes while we answer."""

    def __init__(self, muxer: Multiselect) -> None:
        self.muxer = muxer
        self.said = ["/multistream/1.0.0", str(GOSSIP)]

    async def read(self) -> str:
        return self.said.pop(0)

    async def write(self, msg: str) -> None:
        if msg == GOSSIP:
            self.muxer.remove_handler(GOSSIP)


async def handler(_stream: object) -> None:
    return None


async def test_py_libp2p_alone_raises_key_error() -> None:
    muxer = Multiselect({GOSSIP: handler})
    with pytest.raises(KeyError):  # what the guard is for: fixed upstream, this test says so
        await muxer.negotiate(Peer(muxer))  # type: ignore[arg-type]


async def test_the_guard_makes_it_a_failed_negotiation() -> None:
    muxer = _GuardedMultiselect({GOSSIP: handler})
    with pytest.raises(MultiselectError, match="removed during negotiation"):
        await muxer.negotiate(Peer(muxer))  # type: ignore[arg-type]


def test_every_host_negotiates_through_the_guard() -> None:
    host = build_host(key_named("guard"), LOOPBACK)
    assert isinstance(host.get_mux(), _GuardedMultiselect)

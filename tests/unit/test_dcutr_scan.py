"""``SwarmDCUtR``'s auto-drive scan: a hole punch is started toward a peer reached over a relay
circuit and not toward one reached directly, and each connection's addresses are read once,
not every 2 s (py-libp2p's own loop formatted every address of every connection each round)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from swarm.net.relay import SwarmDCUtR


@dataclass(eq=False)
class FakeConn:
    addrs: list[str]
    reads: int = 0

    def get_transport_addresses(self) -> list[str]:
        self.reads += 1
        return self.addrs


@dataclass
class FakeHost:
    connections: dict[str, Any] = field(default_factory=dict)

    def get_network(self) -> Any:
        return SimpleNamespace(connections=self.connections)

    def get_id(self) -> str:
        return "me"


def dcutr(host: FakeHost, punched: list[str]) -> SwarmDCUtR:
    proto = SwarmDCUtR.__new__(SwarmDCUtR)  # only what the loop reads: no libp2p host needed
    proto.host = host
    proto._in_progress = set()
    proto._direct_connections = set()
    proto._hole_punch_attempts = {}

    async def initiate_hole_punch(peer_id: str) -> bool:
        punched.append(peer_id)
        proto._hole_punch_attempts[peer_id] = proto._hole_punch_attempts.get(peer_id, 0) + 1
        return False

    proto.initiate_hole_punch = initiate_hole_punch  # type: ignore[method-assign]
    return proto


def test_only_relayed_peers_are_punched_and_each_connection_is_read_once() -> None:
    direct = FakeConn(["/ip4/10.0.0.2/tcp/4001"])
    circuit = FakeConn(["/ip4/10.0.0.9/tcp/4001/p2p/QmRelay/p2p-circuit"])
    host = FakeHost({"direct-peer": [direct], "relayed-peer": circuit, "me": [direct]})
    punched: list[str] = []
    proto = dcutr(host, punched)
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def rounds() -> None:
        with trio.move_on_after(21):  # 10 rounds of the 2 s loop
            await proto._auto_drive_loop()

    trio.run(rounds, clock=clock)
    assert punched == ["relayed-peer"] * 3  # py-libp2p's attempt budget, then left alone
    assert direct.reads == 1
    assert circuit.reads == 1


def test_a_connection_without_addresses_yet_is_looked_at_again() -> None:
    circuit = FakeConn([])  # set up, its addresses not known yet
    punched: list[str] = []
    proto = dcutr(FakeHost({"relayed-peer": [circuit]}), punched)

    async def rounds() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proto._auto_drive_loop)
            await trio.sleep(3)  # one round: no addresses, no punch
            assert punched == []
            circuit.addrs.append("/ip4/10.0.0.9/tcp/4001/p2p/QmRelay/p2p-circuit")
            await trio.sleep(2)  # the same loop reads them on its next round
            assert punched == ["relayed-peer"]
            nursery.cancel_scope.cancel()

    trio.run(rounds, clock=trio.testing.MockClock(autojump_threshold=0))

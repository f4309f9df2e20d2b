"""Our own dials at our connection cap (``swarm.net.host._CapDials``): py-libp2p refuses them
and would keep the healthy remote peer in its 60 s negative dial cache; here the trimmer makes
room first, and a dial refused at the cap leaves no block behind. A wanted dial (a request of
ours, ``wanted_dials``) holds its room until it is done. A connection arriving at the cap
makes room the same way before py-libp2p's check refuses it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio

from swarm.net.host import _CapDials, set_room_keeper, wanted_dials

MakeRoom = Callable[..., Awaitable[bool]]


class FakeNetwork:
    keeper: Keeper

    def __init__(self, held: int, cap_refuses: bool) -> None:
        self.held = [f"peer-{i}" for i in range(held)]
        self.cap_refuses = cap_refuses
        self.blocked: set[str] = set()

    def get_connections(self, peer: Any = None) -> list[str]:
        return self.held if peer is None else [p for p in self.held if p == peer]

    async def dial_peer(self, peer: str) -> list[str]:
        await trio.lowlevel.checkpoint()
        if self.cap_refuses and len(self.held) >= 3:
            self.blocked.add(peer)  # py-libp2p marks the remote peer failed
            raise RuntimeError("Maximum connections limit reached")
        self.held.append(peer)
        return [peer]

    def unblock_peer(self, peer: str) -> None:
        self.blocked.discard(peer)

    async def upgrade_inbound_raw_conn(self, raw: str, maddr: str) -> str:
        await trio.lowlevel.checkpoint()
        if len(self.held) >= 3:  # py-libp2p's fast check, before the handshake
            raise RuntimeError("Maximum connections limit reached")
        self.held.append(raw)
        return raw


class FakeHost:
    def __init__(self, network: FakeNetwork) -> None:
        self.network = network

    def get_network(self) -> FakeNetwork:
        return self.network


class Keeper:
    """A room keeper that asks ``make_room`` only at the cap (the trimmer's rule) and notes
    the rooms held (``room``)."""

    def __init__(self, network: FakeNetwork, make_room: MakeRoom) -> None:
        self.network = network
        self._make_room = make_room
        self.held: list[bool] = []

    async def make_room(self, *, wanted: bool = False) -> bool:
        if len(self.network.held) < 3:
            return True
        return await self._make_room(wanted=wanted)

    @contextlib.asynccontextmanager
    async def room(self, *, wanted: bool = False) -> AsyncIterator[bool]:
        made = await self.make_room(wanted=wanted)
        self.held.append(wanted)
        try:
            yield made
        finally:
            self.held.remove(wanted)


def capped(held: int, make_room: MakeRoom) -> FakeNetwork:
    """A fake network of ``held`` connections under a cap of 3, a keeper with ``make_room``
    installed (``network.keeper``)."""
    network = FakeNetwork(held=held, cap_refuses=True)
    _CapDials(network, cap=3).install()
    network.keeper = Keeper(network, make_room)
    set_room_keeper(FakeHost(network), network.keeper)
    return network


async def no_room(*, wanted: bool = False) -> bool:
    """Every connection protected or in its grace period."""
    return False


async def test_a_dial_at_the_cap_makes_room_first() -> None:
    rooms: list[int] = []

    async def make_room(*, wanted: bool = False) -> bool:
        rooms.append(len(network.held))
        network.held.pop(0)
        return True

    network = capped(3, make_room)
    assert await network.dial_peer("newcomer") == ["newcomer"]
    assert rooms == [3] and network.blocked == set()


async def test_a_wanted_dial_holds_its_room_until_it_is_done() -> None:
    wants: list[bool] = []

    async def make_room(*, wanted: bool = False) -> bool:
        wants.append(wanted)
        network.held.pop(0)
        return True

    network = capped(3, make_room)
    held_during: list[list[bool]] = []

    async def dial(peer: str) -> list[str]:  # py-libp2p's dial, under the guard
        held_during.append(list(network.keeper.held))
        return await FakeNetwork.dial_peer(network, peer)

    guard: Any = network.dial_peer.__self__  # type: ignore[attr-defined]
    guard._dial_peer = dial
    with wanted_dials():  # a request of ours
        assert await network.dial_peer("holder") == ["holder"]
    assert await network.dial_peer("dht-peer") == ["dht-peer"]  # a DHT query's: no room held
    assert wants == [True, False] and held_during == [[True], []]
    assert network.keeper.held == []


async def test_a_dial_refused_at_our_cap_leaves_the_peer_unblocked() -> None:
    network = capped(3, no_room)
    with pytest.raises(RuntimeError):  # the fake refuses at the cap
        await network.dial_peer("healthy")
    assert network.blocked == set()  # the refusal was ours: the peer stays dialable


async def test_a_dial_under_the_cap_is_left_alone() -> None:
    async def make_room(*, wanted: bool = False) -> bool:
        raise AssertionError("room made under the cap")

    network = capped(1, make_room)
    assert await network.dial_peer("other") == ["other"]


async def test_a_connection_arriving_at_the_cap_makes_room_first() -> None:
    async def make_room(*, wanted: bool = False) -> bool:
        assert wanted  # a connection of ours past the dial grace may go for it
        network.held.pop(0)  # the trimmer lets its least useful connection go
        return True

    network = capped(3, make_room)
    assert await network.upgrade_inbound_raw_conn("newcomer", "/ip4/127.0.0.1") == "newcomer"
    assert len(network.held) == 3 and "newcomer" in network.held


async def test_a_connection_arriving_with_no_room_is_refused_as_before() -> None:
    network = capped(3, no_room)
    with pytest.raises(RuntimeError, match="limit"):  # a full node with nothing to trim
        await network.upgrade_inbound_raw_conn("newcomer", "/ip4/127.0.0.1")
    assert network.held == ["peer-0", "peer-1", "peer-2"]


async def test_past_the_places_held_for_our_dials_others_are_refused_not_let_through() -> None:
    """One place under the cap, held for a wanted dial under way (the keeper finds no room):
    a DHT query's dial and an arriving connection are refused as at the cap. py-libp2p would
    let them through, and whichever landed first took the place: the wanted dial, to a
    holder of a version, was then refused at our own cap."""
    network = capped(2, no_room)
    network.keeper.make_room = no_room  # type: ignore[method-assign]
    with pytest.raises(Exception, match="held for a dial of ours"):
        await network.dial_peer("dht-peer")
    arriving = ClosingConn()
    with pytest.raises(Exception, match="held for a dial of ours"):
        await network.upgrade_inbound_raw_conn(arriving, "/ip4/127.0.0.1")
    assert arriving.closed
    assert network.held == ["peer-0", "peer-1"] and network.blocked == set()


class ClosingConn:
    closed = False

    async def close(self) -> None:
        self.closed = True

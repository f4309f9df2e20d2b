"""The connection trimmer's choices, on a host double: at the high water mark it closes the
least useful connections down to the low one, and never a protected peer, a peer mid-transfer
or a connection younger than the grace period."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio
from libp2p.peer.id import ID

from swarm.errors import ConfigError
from swarm.net.connections import ConnectionBounds, ConnectionTrimmer, RedialBackoff, bounds_for
from tests.netfactory import key_named

PEERS = [key_named(f"peer-{i}").peer_id for i in range(10)]


@dataclass
class FakeStream:
    protocol: str

    def get_protocol(self) -> str:
        return self.protocol


@dataclass
class FakeConn:
    streams: list[FakeStream]
    direction: str = "inbound"

    def get_streams(self) -> tuple[FakeStream, ...]:
        return tuple(self.streams)


@dataclass
class FakeNetwork:
    conns: dict[str, FakeConn]
    closed: list[str] = field(default_factory=list)
    twice: set[str] = field(default_factory=set)
    """Peers with two connections (both dialed at once)."""
    close_s: float = 0.0
    """How long a close takes (py-libp2p's yamux sleeps 0.1 s after its GO_AWAY)."""

    def get_connections(self, peer: ID | None = None) -> list[FakeConn]:
        if peer is None:
            return [c for p in self.conns for c in self.get_connections(ID.from_base58(p))]
        conn = self.conns.get(peer.to_base58())
        return ([conn, conn] if peer.to_base58() in self.twice else [conn]) if conn else []

    async def close_peer(self, peer: ID) -> None:
        self.closed.append(peer.to_base58())
        await trio.sleep(self.close_s)
        del self.conns[peer.to_base58()]


@dataclass
class FakeHost:
    network: FakeNetwork

    def get_network(self) -> FakeNetwork:
        return self.network

    def get_connected_peers(self) -> list[ID]:
        return [ID.from_base58(p) for p in self.network.conns]


def gossip_only() -> FakeConn:
    return FakeConn([FakeStream("/meshsub/1.1.0"), FakeStream("/ipfs/id/1.0.0")])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def trimmer(
    conns: dict[str, FakeConn],
    *,
    protected: set[str] = frozenset(),  # type: ignore[assignment]
    mesh: set[str] = frozenset(),  # type: ignore[assignment]
    low: int = 4,
    high: int = 6,
) -> tuple[ConnectionTrimmer, FakeNetwork, Clock]:
    network = FakeNetwork(dict(conns))
    clock = Clock()
    t = ConnectionTrimmer(
        FakeHost(network),
        ConnectionBounds(low=low, high=high, grace_s=10.0),
        lambda: protected,
        lambda: mesh,
        clock=clock,
    )
    return t, network, clock


async def settle(t: ConnectionTrimmer, clock: Clock) -> list[str]:
    """A first look (every connection is new: none may go), then one past the grace period;
    every peer trimmed."""
    first = await t.check()
    clock.now += 11.0
    return first + await t.check()


async def test_under_the_high_water_mark_nothing_is_trimmed() -> None:
    t, network, clock = trimmer({p: gossip_only() for p in PEERS[:5]})
    assert await settle(t, clock) == []
    assert network.closed == [] and t.status()["connections"] == 5


async def test_at_the_mark_which_is_also_the_cap_it_makes_room() -> None:
    t, network, clock = trimmer({p: gossip_only() for p in PEERS[:6]})
    assert len(await settle(t, clock)) == 2 and len(network.conns) == 4


async def test_over_it_the_trimmer_closes_down_to_the_low_mark_never_a_protected_peer() -> None:
    protected = set(PEERS[:3])
    t, network, clock = trimmer({p: gossip_only() for p in PEERS}, protected=protected)
    trimmed = await settle(t, clock)
    assert len(trimmed) == 10 - 4 and not set(trimmed) & protected
    assert set(network.conns) >= protected and len(network.conns) == 4
    status = t.status()
    assert status["trims"] == 6 and status["peak"] == 10 and status["connections"] == 4


async def test_a_peer_mid_transfer_and_a_new_connection_are_kept() -> None:
    conns = {p: gossip_only() for p in PEERS[:8]}
    conns[PEERS[0]] = FakeConn([FakeStream("/meshsub/1.1.0"), FakeStream("/swarm-node/r/shard/1")])
    t, network, clock = trimmer(conns, high=9)
    await t.check()
    clock.now += 11.0
    network.conns[PEERS[9]] = gossip_only()  # arrived just now: within its grace period
    trimmed = await t.check()
    assert PEERS[0] not in trimmed and PEERS[9] not in trimmed
    assert len(trimmed) == 9 - 4 and set(network.conns) >= {PEERS[0], PEERS[9]}


async def test_two_connections_to_one_peer_count_twice_as_the_host_cap_counts_them() -> None:
    """Two nodes that dialed each other at once hold two connections; py-libp2p's cap counts
    both. Counted by peer, 5 peers with 6 connections sat "under" a cap of 6 while the host
    refused every dial: the trimmer now counts connections, makes room, and trims down to
    the low mark in connections."""
    t, network, clock = trimmer({p: gossip_only() for p in PEERS[:5]}, low=3, high=6)
    network.twice = {PEERS[0]}
    assert t.count() == 6 and t.status()["connections"] == 6
    await t.check()
    clock.now += 11.0
    assert await t.make_room() is True and len(network.closed) == 1  # at the cap: room made
    network.conns[PEERS[5]] = gossip_only()
    network.conns[PEERS[6]] = gossip_only()
    network.twice = {PEERS[0], PEERS[5]}
    clock.now += 11.0
    await t.check()
    assert t.count() <= 3


async def test_a_connection_arriving_at_the_cap_may_push_out_a_young_idle_one() -> None:
    """A burst of DHT queries (our provider record placed, others' lookups) fills the cap with
    young connections; one arriving then may push out one past the dial grace that carried
    no transfer, ours first, then one a peer opened to us, never one in use; the periodic
    trim keeps the whole grace."""
    conns = {p: FakeConn([FakeStream("/swarm-node/r/shard/1")]) for p in PEERS[:3]}
    conns[PEERS[3]] = FakeConn([FakeStream("/ipfs/kad/1.0.0")], direction="inbound")
    conns[PEERS[4]] = FakeConn([FakeStream("/ipfs/kad/1.0.0")], direction="outbound")
    conns[PEERS[5]] = FakeConn([FakeStream("/ipfs/kad/1.0.0")], direction="inbound")
    t, network, clock = trimmer(conns, high=6)
    t._first_seen = {p: 0.0 for p in conns} | {PEERS[5]: 1.0}  # PEERS[5] a second later
    clock.now = 3.5  # past the dial grace (2 s), within the grace (10 s)
    assert t.candidates() == [] and await t.make_room() is False
    assert t.candidates(wanted=True) == [PEERS[4], PEERS[3], PEERS[5]]
    assert await t.make_room(wanted=True) is True
    network.conns[PEERS[6]] = gossip_only()  # at the cap again: one more arrived
    assert await t.make_room(wanted=True) is True
    assert network.closed == [PEERS[4], PEERS[3]]


async def test_a_peer_polled_for_nothing_may_go_for_a_connection_wanted_now() -> None:
    """A fetch polls every peer of ours (a long-poll on the shard protocol: in use), most
    holding nothing; at the cap, a request of ours to a holder may push out one of those
    (``expendable``), past the dial grace, never a protected one, and the periodic trim does
    not."""
    busy = [FakeStream("/meshsub/1.1.0"), FakeStream("/swarm-node/r/shard/1")]
    t, network, clock = trimmer({p: FakeConn(list(busy)) for p in PEERS[:6]}, high=6)
    t.expendable = lambda: {PEERS[2], PEERS[3]}
    t.protected = lambda: {PEERS[3]}
    t._ages(PEERS[:6])
    clock.now += 1.0  # within the dial grace (2 s): not yet
    assert t.candidates(wanted=True) == []
    clock.now += 2.0
    assert t.candidates() == [] and await t.check() == []
    assert t.candidates(wanted=True) == [PEERS[2]]
    assert await t.make_room(wanted=True) is True and network.closed == [PEERS[2]]


async def test_a_peer_polled_for_nothing_may_go_for_any_dial_of_ours_but_not_the_trim() -> None:
    """A DHT query's dial (not wanted) at the cap may push out a peer our fetch has no use
    for: a newcomer whose connections had all answered "not held" found no holder in the
    version's provider records for 60 s, every query's dial refused at its own cap. Nothing
    else in use may go for it, and the periodic trim keeps them all."""
    busy = [FakeStream("/meshsub/1.1.0"), FakeStream("/swarm-node/r/shard/1")]
    t, network, clock = trimmer({p: FakeConn(list(busy)) for p in PEERS[:6]}, high=6)
    t.expendable = lambda: {PEERS[4]}
    t._ages(PEERS[:6])
    clock.now += 3.0
    assert await t.check() == [] and network.closed == []
    assert await t.make_room() is True and network.closed == [PEERS[4]]
    t.expendable = frozenset
    network.conns[PEERS[6]] = FakeConn(list(busy))  # at the cap again
    assert await t.make_room() is False and network.closed == [PEERS[4]]


async def test_dials_at_the_cap_at_once_each_get_their_own_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two requests of a fetch dial two holders at the cap at once: each closes its own
    connection, and the room stays held until its dial is done. Before, both picked the
    connection that was still closing and one dial was refused at our own cap."""
    t, network, clock = trimmer({p: gossip_only() for p in PEERS[:6]}, high=6)
    network.close_s = 0.1
    t._ages(PEERS[:6])
    clock.now += 11.0
    landed: list[int] = []

    async def dial(peer: str) -> None:
        async with t.room(wanted=True) as made:
            assert made
            await trio.sleep(0.3)  # the handshake
            network.conns[peer] = gossip_only()
            landed.append(t.count())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(dial, PEERS[6])
        await trio.sleep(0.05)  # the first close is under way
        nursery.start_soon(dial, PEERS[7])
    assert len(set(network.closed)) == len(network.closed) == 2
    assert landed == [5, 6] and t._reserved == 0  # both under the cap


async def test_a_connection_arriving_while_a_dial_holds_its_room_makes_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Under the cap by one, a dial of ours takes the last place; a connection arriving
    during its handshake makes room for itself rather than take that place; once the dial
    is done, its place counts as the connection it became."""
    conns = {p: gossip_only() for p in PEERS[:5]}
    t, network, clock = trimmer(conns, high=6)
    t._ages(PEERS[:5])
    clock.now += 11.0
    async with t.room(wanted=True) as made:
        assert made and network.closed == []  # room without closing anything
        assert await t.make_room(wanted=True) is True and len(network.closed) == 1
        network.conns[PEERS[6]] = gossip_only()  # the arriving one
        network.conns[PEERS[5]] = gossip_only()  # our dial lands
    assert t.count() == 6 and t._reserved == 0
    assert await t.make_room() is True and len(network.closed) == 2


async def test_a_dial_with_no_room_holds_none() -> None:
    t, network, _ = trimmer({p: gossip_only() for p in PEERS[:6]}, high=6)
    await t.check()  # every connection new: nothing may go
    async with t.room() as made:
        assert not made and t._reserved == 0
    assert network.closed == []


async def test_peers_outside_the_gossip_mesh_go_first() -> None:
    mesh = set(PEERS[:5])
    t, _network, clock = trimmer({p: gossip_only() for p in PEERS[:8]}, mesh=mesh, high=8)
    trimmed = await settle(t, clock)
    assert set(trimmed) == set(PEERS[5:8]) | {trimmed[-1]} and trimmed[-1] in mesh
    assert len(trimmed) == 4


async def test_when_everything_is_protected_it_stays_over_and_says_so() -> None:
    t, _network, clock = trimmer({p: gossip_only() for p in PEERS}, protected=set(PEERS))
    assert await settle(t, clock) == []
    assert t.status()["connections"] == 10 > t.status()["high"] and t.status()["over_high"]


def test_bounds_are_checked() -> None:
    with pytest.raises(ConfigError, match="low <= high"):
        ConnectionBounds(low=10, high=5)
    with pytest.raises(ConfigError, match="--conn-low"):
        ConnectionBounds(low=0, high=5)


async def test_run_checks_again_and_again() -> None:
    t, network, _ = trimmer({p: gossip_only() for p in PEERS})
    t.bounds = ConnectionBounds(low=4, high=6, grace_s=0.0)
    with trio.move_on_after(1.0):
        await t.run(every_s=0.05)
    assert len(network.conns) == 4


async def test_a_peer_that_opened_a_stream_lately_is_in_use() -> None:
    t, network, clock = trimmer({p: gossip_only() for p in PEERS[:8]}, high=9)
    await t.check()
    clock.now += 11.0
    t.note_stream(PEERS[1], "/swarm-node/r/shard/1")  # a shard request just closed
    t.note_stream(PEERS[2], "/ipfs/kad/1.0.0")  # a DHT query: no use that keeps a peer
    t.note_stream(PEERS[3], "")  # a stream that never agreed on a protocol carried nothing
    assert t.in_use(PEERS[1]) and not t.in_use(PEERS[2]) and not t.in_use(PEERS[3])
    trimmed = await t.check()
    assert PEERS[1] not in trimmed and PEERS[1] in network.conns and PEERS[2] in trimmed
    clock.now += 31.0  # past in_use_s: an idle peer like the others
    network.conns.update({p: gossip_only() for p in PEERS[:8] if p not in network.conns})
    assert PEERS[1] in await t.check() or len(network.conns) == 4


async def test_before_dialing_a_protected_peer_at_the_cap_one_connection_goes() -> None:
    t, network, clock = trimmer({p: gossip_only() for p in PEERS[:6]}, protected={PEERS[0]})
    await t.check()  # every connection new: nothing may go yet
    assert await t.make_room() is False and len(network.conns) == 6
    clock.now += 11.0
    assert await t.make_room() is True and len(network.conns) == 5
    assert PEERS[0] in network.conns


def test_trimming_starts_below_the_cap_leaving_room_for_inbound_connections() -> None:
    assert ConnectionBounds(low=32, high=48).trim_at == 40
    assert ConnectionBounds(low=8, high=12).trim_at == 10
    assert ConnectionBounds(low=5, high=5).trim_at == 5  # no gap to keep


def test_dialing_stops_below_the_low_mark_by_the_gap_trimming_starts_above_it() -> None:
    assert ConnectionBounds(low=32, high=48).dial_below == 24
    assert ConnectionBounds(low=8, high=12).dial_below == 6
    assert ConnectionBounds(low=5, high=5).dial_below == 5
    assert ConnectionBounds(low=1, high=40).dial_below == 1


async def test_one_connection_past_the_trim_mark_wakes_the_trimmer_at_once() -> None:
    t, network, _clock = trimmer({p: gossip_only() for p in PEERS[:5]})  # trim mark 5
    t.bounds = ConnectionBounds(low=4, high=6, grace_s=0.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(t.run, 3600.0)  # never by the clock in this test
        await trio.testing.wait_all_tasks_blocked()
        assert len(network.conns) == 5
        network.conns[PEERS[5]] = gossip_only()
        t.note_connected()
        await trio.testing.wait_all_tasks_blocked()
        assert len(network.conns) == 4
        nursery.cancel_scope.cancel()


def test_a_lost_peer_waits_longer_each_time_and_is_forgiven_after_a_long_while() -> None:
    backoff = RedialBackoff(first_s=5.0, max_s=20.0, forget_s=100.0)
    assert backoff.may_dial("p", 0.0)
    assert backoff.lost("p", 0.0) == 5.0 and not backoff.may_dial("p", 4.9)
    assert backoff.may_dial("p", 5.0)
    assert [backoff.lost("p", t) for t in (6.0, 20.0, 50.0)] == [10.0, 20.0, 20.0]
    assert backoff.lost("p", 151.0) == 5.0  # 101 s after the last loss: a fresh start
    assert backoff.may_dial("q", 151.0)  # another peer is its own


def test_the_runs_servers_keep_more_and_one_mark_moves_the_other_only_as_needed() -> None:
    assert bounds_for("inference") == ConnectionBounds(low=32, high=48)
    assert bounds_for("validator") == ConnectionBounds(low=128, high=192)
    assert bounds_for("inference", high=12) == ConnectionBounds(low=12, high=12)
    assert bounds_for("inference", low=60) == ConnectionBounds(low=60, high=60)
    assert bounds_for("trainer", low=8, high=12) == ConnectionBounds(low=8, high=12)
    with pytest.raises(ConfigError, match="low 20, high 10"):
        bounds_for("inference", low=20, high=10)

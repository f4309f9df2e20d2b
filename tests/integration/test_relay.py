"""Reachability by dial-back and circuit relay v2 between real hosts on 127.0.0.1.

One bootstrap peer (relay hop + dial-back server) and plain overlays; everything on loopback is
reachable, so "private" is made by asking for a dial-back on a port where nothing listens, and
relay reservations are made explicitly (what a node behind a NAT does on its own).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
import trio

from bootstrap.service import BootstrapConfig, BootstrapPeer
from swarm.errors import NetworkError
from swarm.identity import NodeKey
from swarm.net import Overlay, OverlayConfig, request, serve
from swarm.net.reach import ask_dialback, verdict
from swarm.net.relay import RelayHop, RelayLimits
from swarm.net.streams import StreamLimits
from tests.netfactory import LOOPBACK, key_named

ECHO = "/swarm-node/test-echo/1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def boot() -> AsyncIterator[BootstrapPeer]:
    config = BootstrapConfig(key=key_named("relay-boot"), listen=LOOPBACK, heartbeat=0.2)
    async with BootstrapPeer.start(config) as peer:
        yield peer


async def _echo(_peer: str, body: bytes) -> bytes:
    return body


async def test_dialback_reports_a_listening_node_public_and_a_closed_port_private(
    boot: BootstrapPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("swarm.net.reach.MIN_INTERVAL_S", 1.0)  # the interval's own test is below
    async with Overlay.start(key_named("reach-a"), OverlayConfig(listen=LOOPBACK)) as a:
        await a.dial(boot.addrs())
        reach = await a.check_reachability([boot.peer_id])
        assert reach.status == "public", reach.reason
        assert "dialed back at /ip4/127.0.0.1/tcp/" in reach.reason
        assert a.dht_mode() == "server"
        await trio.sleep(1.1)  # the server answers one request per peer per interval
        closed = _free_port()
        result = await ask_dialback(a.host, boot.peer_id, [closed])
        assert result.observed_ip == "127.0.0.1"
        assert not result.reachable
        private = verdict([result], [])
        assert private.status == "private"
        assert f"/tcp/{closed}/" in private.reason and "refused" in private.reason


async def test_dialback_refuses_a_second_request_within_its_interval(boot: BootstrapPeer) -> None:
    async with Overlay.start(key_named("reach-b"), OverlayConfig(listen=LOOPBACK)) as a:
        await a.dial(boot.addrs())
        await a.check_reachability([boot.peer_id])
        again = await a.check_reachability([boot.peer_id])
        assert again.status == "unknown"
        assert "one dial-back per" in again.reason


async def test_a_reserved_node_is_reached_through_the_relay_and_moves_when_it_dies(
    boot: BootstrapPeer,
) -> None:
    # A second relay, so that the node has somewhere to move to.
    spare_key = NodeKey.generate()
    async with (
        Overlay.start(spare_key, OverlayConfig(listen=LOOPBACK)) as spare_overlay,
        RelayHop.start(spare_overlay.host),
        Overlay.start(key_named("behind-nat"), OverlayConfig(listen=LOOPBACK)) as natted,
        Overlay.start(key_named("dialer"), OverlayConfig(listen=LOOPBACK)) as dialer,
    ):
        serve(natted.host, ECHO, _echo, StreamLimits())
        relays = [boot.addrs()[0], spare_overlay.addrs()[0]]
        assert natted.relay is not None and dialer.relay is not None
        await natted.relay.check_once(relays[:1], want=1)
        circuits = natted.relay.circuit_addrs()
        assert len(circuits) == 1 and "/p2p-circuit/p2p/" in circuits[0]
        assert any("/p2p-circuit" in a for a in natted.addrs())
        assert natted.relay.relayed_budget() == 64 << 20

        why = await dialer.connect(natted.peer_id, circuits)
        assert why is None
        assert dialer.direct_path(natted.peer_id) is None  # the connection is relayed
        answer = await request(dialer.host, natted.peer_id, ECHO, b"through the relay")
        assert answer == b"through the relay"

        # The relay goes away: the node notices, reserves on the other one.
        await natted.forget_peer(boot.peer_id)
        await natted.relay.check_once(relays, want=1)
        assert natted.relay.moves == 1
        assert [r.relay for r in natted.relay.reservations.values()] == [spare_overlay.peer_id]


async def test_a_relay_that_refuses_reservations_is_named_and_skipped(
    boot: BootstrapPeer,
) -> None:
    async with (
        Overlay.start(NodeKey.generate(), OverlayConfig(listen=LOOPBACK)) as not_a_relay,
        Overlay.start(key_named("asker"), OverlayConfig(listen=LOOPBACK)) as asker,
    ):
        assert asker.relay is not None
        with pytest.raises(NetworkError, match=r"refused the hop protocol|refused our res"):
            await asker.relay.reserve(not_a_relay.addrs()[0])
        # The refusing one is remembered; the working relay is reserved.
        await asker.relay.check_once([not_a_relay.addrs()[0], boot.addrs()[0]], want=1)
        assert list(asker.relay.reservations) == [boot.peer_id]
        assert not_a_relay.addrs()[0] in asker.relay.status()["refused"]


async def test_an_unreachable_announce_address_is_logged_and_left_out_of_our_addresses(
    boot: BootstrapPeer, caplog: pytest.LogCaptureFixture
) -> None:
    closed = f"/ip4/127.0.0.1/tcp/{_free_port()}"
    config = OverlayConfig(listen=LOOPBACK, announce=(closed,))
    async with Overlay.start(key_named("announcer"), config) as a:
        assert a.addrs()[0].startswith(closed)  # announced first, until checked
        await a.dial(boot.addrs())
        reach = await a.check_reachability([boot.peer_id])
        assert reach.status == "public"  # its listen port works: the node keeps working
        assert not any(addr.startswith(closed) for addr in a.addrs())
        assert f"announce address {closed} is not reachable" in caplog.text, (
            len(caplog.records),
            caplog.text[-500:],
        )


async def test_a_dropped_reservation_is_a_clear_dial_error_and_comes_back_on_refresh(
    boot: BootstrapPeer,
) -> None:
    async with (
        Overlay.start(key_named("dropped"), OverlayConfig(listen=LOOPBACK)) as natted,
        Overlay.start(key_named("dialer-2"), OverlayConfig(listen=LOOPBACK)) as dialer,
    ):
        serve(natted.host, ECHO, _echo, StreamLimits())
        assert natted.relay is not None and dialer.relay is not None
        await natted.relay.check_once(boot.addrs()[:1], want=1)
        [circuit] = natted.relay.circuit_addrs()
        # The relay forgets it (a restart that kept the connection, an expiry on its clock).
        assert boot.overlay.relay_hop is not None
        boot.overlay.relay_hop.protocol.resource_manager._reservations.clear()
        with pytest.raises(NetworkError, match="holds no reservation for that peer"):
            await dialer.relay.dial_circuit(circuit)
        # Our periodic refresh reserves again; the circuit works.
        for held in natted.relay.reservations.values():
            held.reserved_at -= 3600
        await natted.relay.check_once(boot.addrs()[:1], want=1)
        assert await dialer.connect(natted.peer_id, [circuit]) is None
        assert await request(dialer.host, natted.peer_id, ECHO, b"back") == b"back"


async def test_doctors_probe_finds_a_fresh_host_on_loopback_public(boot: BootstrapPeer) -> None:
    from node.doctor import probe_reachability, reachability_advice

    reach = await probe_reachability(LOOPBACK, tuple(boot.addrs()), ())
    assert reach.status == "public", reach.reason
    observed = sorted({r.observed_ip for r in reach.results})
    assert reachability_advice(reach.status, reach.reason, observed, LOOPBACK).status == "ok"


async def test_a_full_relay_refuses_with_its_reason_and_the_next_one_is_used(
    boot: BootstrapPeer,
) -> None:
    full = RelayLimits(duration=60, data=1 << 20, max_circuit_conns=1, max_reservations=0)
    async with (
        Overlay.start(NodeKey.generate(), OverlayConfig(listen=LOOPBACK)) as small,
        RelayHop.start(small.host, full),
        Overlay.start(key_named("asker-full"), OverlayConfig(listen=LOOPBACK)) as asker,
    ):
        assert asker.relay is not None
        with pytest.raises(NetworkError, match="the relay is full"):
            await asker.relay.reserve(small.addrs()[0])
        await asker.relay.check_once([small.addrs()[0], boot.addrs()[0]], want=1)
        assert list(asker.relay.reservations) == [boot.peer_id]

"""Dial-back verdicts, doctor's advice on them, and SHARDCAST's byte cap over relays (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from node.doctor import reachability_advice
from swarm.net.dial import SLOW_HANDSHAKE
from swarm.net.reach import DialbackResult, tcp_ports, verdict
from swarm.shardcast.protocol import ShardRequest
from swarm.shardcast.streams import RelayBudgetSpent, StreamShardSource

LISTEN = ("/ip4/0.0.0.0/tcp/4001",)


def test_tcp_ports_skip_circuits_and_duplicates() -> None:
    addrs = [
        "/ip4/192.168.1.2/tcp/4001/p2p/x",
        "/ip4/10.0.0.1/tcp/4001/p2p/x",
        "/ip4/10.0.0.9/tcp/4001/p2p/r/p2p-circuit/p2p/x",
        "/ip4/10.0.0.1/tcp/5001",
    ]
    assert tcp_ports(addrs) == [4001, 5001]


def test_verdict_public_private_unknown_each_say_why() -> None:
    ok = DialbackResult("s", "203.0.113.7", {"/ip4/203.0.113.7/tcp/4001/p2p/x": ""})
    closed = DialbackResult(
        "s", "203.0.113.7", {"/ip4/203.0.113.7/tcp/4001/p2p/x": "connection refused"}
    )
    assert verdict([ok], []).status == "public"
    private = verdict([closed], [], announce=("/ip4/198.51.100.1/tcp/4001",))
    assert private.status == "private"
    assert "connection refused" in private.reason and "203.0.113.7" in private.reason
    assert "announce address /ip4/198.51.100.1/tcp/4001 is not the address" in private.reason
    unknown = verdict([], ["s: refused /swarm-node/dialback/1"])
    assert unknown.status == "unknown" and "no dial-back answer" in unknown.reason


def test_a_dial_back_that_connected_but_timed_out_in_the_handshake_is_not_private() -> None:
    """TCP reached us, so no NAT is in the way: a busy machine, not a private node (at
    N = 100 on 2 cores such nodes reserved relay slots and left the DHT's server mode)."""
    addr = "/ip4/203.0.113.7/tcp/4001/p2p/x"
    slow = DialbackResult("s", "203.0.113.7", {addr: f"timeout after 5 s {SLOW_HANDSHAKE}"})
    unknown = verdict([slow], [])
    assert unknown.status == "unknown" and "handshake timed out" in unknown.reason
    dropped = DialbackResult("s", "203.0.113.7", {addr: "timeout after 5 s"})  # a NAT's silence
    assert verdict([dropped], []).status == "private"


def test_doctor_says_forward_the_port_behind_a_nat() -> None:
    check = reachability_advice(
        "private", "nobody could dial us back", ["203.0.113.7"], LISTEN, local_ips={"10.0.0.2"}
    )
    assert check.status == "warn"
    assert "forward TCP port 4001" in check.hint
    assert 'announce = ["/ip4/203.0.113.7/tcp/4001"]' in check.hint
    assert "through a relay" in check.hint  # or do nothing, at a stated cost


def test_doctor_says_open_the_firewall_without_a_nat() -> None:
    check = reachability_advice(
        "private", "refused", ["203.0.113.7"], LISTEN, local_ips={"203.0.113.7"}
    )
    assert "open it in your firewall" in check.hint


def test_doctor_flags_an_announce_address_at_another_ip_and_passes_a_public_node() -> None:
    stray = reachability_advice(
        "public", "dialed back", ["203.0.113.7"], LISTEN, ("/ip4/198.51.100.1/tcp/4001",)
    )
    assert stray.status == "warn" and "198.51.100.1" in stray.hint
    assert reachability_advice("public", "dialed back", ["203.0.113.7"], LISTEN).status == "ok"
    assert reachability_advice("unknown", "no answer", [], LISTEN).status == "warn"


class _RelayedPeer:
    """A peer reached only through a relay, serving zeros, with ``cap`` bytes allowed."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.spent = 0
        self.requests = 0

    def handle(self, *_args: Any) -> Any:
        return None

    async def request(self, _peer: str, _name: str, body: bytes, _limits: Any) -> bytes:
        self.requests += 1
        return bytes(ShardRequest.from_bytes(body).length)

    def direct_path(self, _peer: str) -> None:
        return None

    def relayed_bytes_left(self, _peer: str) -> int:
        return self.cap - self.spent

    def spend_relayed(self, _peer: str, nbytes: int) -> None:
        self.spent += nbytes


class _Sink:
    def __init__(self, length: int) -> None:
        self.length = length
        self.received = 0

    def write(self, chunk: bytes) -> None:
        self.received += len(chunk)


async def test_shard_pulls_over_a_relay_stop_before_the_cap() -> None:
    peer = _RelayedPeer(cap=1000)
    source = StreamShardSource(peer)  # type: ignore[arg-type]
    first = _Sink(600)
    await source.pull("p", 1, 0, first)  # type: ignore[arg-type]
    assert first.received == 600 and peer.spent == 600
    asked = peer.requests
    with pytest.raises(RelayBudgetSpent, match="only through a relay"):
        await source.pull("p", 1, 1, _Sink(600))  # type: ignore[arg-type]
    assert peer.requests == asked  # refused before a byte was asked for
    assert source.relay_refusals == 1 and peer.spent == 600

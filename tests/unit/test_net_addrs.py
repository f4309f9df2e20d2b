"""Addresses a node advertises: never a wildcard that nobody can dial."""

from __future__ import annotations

from swarm.net.host import _concrete, parse_multiaddr


def test_a_wildcard_listen_address_is_advertised_as_interface_addresses() -> None:
    for wildcard in ("/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001"):
        out = [str(a) for a in _concrete(parse_multiaddr(wildcard))]
        assert out and all(a.endswith("/tcp/4001") for a in out)
        # Interface enumeration may find nothing (then the wildcard is kept, as py-libp2p does).
        assert out == [wildcard] or not any(a.startswith(wildcard[:9]) for a in out)


def test_a_concrete_listen_address_is_advertised_as_is() -> None:
    addr = parse_multiaddr("/ip4/127.0.0.1/tcp/4001")
    assert [str(a) for a in _concrete(addr)] == ["/ip4/127.0.0.1/tcp/4001"]

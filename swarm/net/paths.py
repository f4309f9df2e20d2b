"""Which IP addresses a peer's libp2p connection runs between.

SHARDCAST's data channel is a plain TCP socket next to libp2p: a client must connect only to the
IP address of the peer's current *direct* libp2p connection (never a host or port that the peer
alone names: that would let any peer aim our node at a third host), and a server must offer the
channel only on the address the asker actually reached it at. Both need the two ends of the
connection's TCP socket.

py-libp2p 0.8.1 exposes a connection's remote address (``get_remote_address``) but not the local
one, and on a relayed connection (circuit relay v2) it reports the relay's socket as if it were
the peer's. So ``direct_path`` checks the connection type first (relayed: no path) and then walks
the connection's layers (muxer -> secure session -> noise -> raw connection -> trio stream) to
the socket, a bounded number of steps; anything it cannot recognise gives ``None``, which callers
treat as "no direct path: use libp2p streams".
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from swarm.errors import SwarmError
from swarm.net.host import check_peer_id

_LAYERS = ("muxed_conn", "secured_conn", "conn", "stream", "_wrapped")
_MAX_DEPTH = 12


@dataclass(frozen=True, slots=True)
class DirectPath:
    """The two IP addresses of a direct TCP connection: ours and the peer's."""

    local_ip: str
    remote_ip: str


def _socket_of(conn: Any) -> Any:
    node = conn
    for _ in range(_MAX_DEPTH):
        sock = getattr(node, "socket", None)
        if sock is not None and hasattr(sock, "getsockname"):
            return sock
        node = next((getattr(node, a) for a in _LAYERS if hasattr(node, a)), None)
        if node is None:
            return None
    return None


def relayed(conn: Any) -> bool | None:
    """Whether a py-libp2p connection runs over a relay circuit (its type says so, or its
    addresses name ``/p2p-circuit``); ``None`` while that cannot be told yet (a connection
    still being set up has no addresses). Reads the addresses once."""
    kind = getattr(conn, "get_connection_type", None)
    if kind is not None and "RELAYED" in str(kind()):
        return True
    try:
        addrs = list(conn.get_transport_addresses())
    except Exception:
        return None
    return any("/p2p-circuit" in str(a) for a in addrs) if addrs else None


def path_of(conn: Any) -> DirectPath | None:
    """The direct path of one py-libp2p connection, ``None`` when relayed or unknown."""
    if relayed(conn):
        return None
    sock = _socket_of(conn)
    if sock is None:
        return None
    try:
        local, remote = sock.getsockname()[0], sock.getpeername()[0]
    except OSError:  # the socket closed under us
        return None
    return DirectPath(_plain_ip(local), _plain_ip(remote))


def _plain_ip(text: str) -> str:
    """``::ffff:10.0.0.1`` (an IPv4 peer on a dual-stack socket) as ``10.0.0.1``."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def direct_path(host: Any, peer_id: str) -> DirectPath | None:
    """The direct path of our newest live connection to ``peer_id``, if any."""
    try:
        peer = check_peer_id(peer_id)
        conns = list(host.get_network().connections.get(peer, []))
    except (SwarmError, AttributeError):
        return None
    for conn in reversed(conns):
        if getattr(conn, "is_closed", False):
            continue
        found = path_of(conn)
        if found is not None:
            return found
    return None


def same_ip(a: str, b: str) -> bool:
    """Equal addresses, whatever their spelling (``::ffff:`` mapping, zero-compression)."""
    try:
        return _plain_ip(a) == _plain_ip(b)
    except ValueError:
        return False


def relayed_connection(host: Any, peer_id: str) -> Any | None:
    """Our relayed connection to ``peer_id`` when we have no direct one (else ``None``)."""
    try:
        peer = check_peer_id(peer_id)
        conns = [
            c
            for c in host.get_network().connections.get(peer, [])
            if not getattr(c, "is_closed", False)
        ]
    except (SwarmError, AttributeError):
        return None
    if not conns or any(path_of(c) is not None for c in conns):
        return None
    return next((c for c in conns if relayed(c)), None)

"""Reachability by dial-back: can a stranger open a fresh connection to this node?

py-libp2p 0.8.1's AutoNAT answers over the connection the question came in on, so a closed port
and a host behind a NAT were both reported "public" (``shared/background/py-libp2p-relay.md``).
We ask instead: a node sends ``/swarm-node/dialback/1`` to a bootstrap peer with the TCP ports
it listens on, and the bootstrap peer dials back from a *separate host* with a throwaway key
(``DialbackServer.dialer``), so no existing connection can be reused, and checks the Noise
handshake names the asker's peer ID.

Decisions this module owns:
- the server dials only the IP address the request came from (``DirectPath.remote_ip`` of the
  asker's direct connection), with the asker's ports: a peer cannot aim a bootstrap peer at a
  third host. An asker reachable only through a relay is refused ("ask over a direct
  connection"). Announce addresses at another IP are reported untested, with the reason;
- at most ``MAX_PORTS`` ports per request, ``DIALBACK_TIMEOUT_S`` per dial, a few dial-backs at
  once (``StreamLimits.concurrency``) and one request per peer per ``MIN_INTERVAL_S``;
- ``Reachability``: "public" when any dial-back connected, "private" when every answering
  server failed to connect, "unknown" when nobody answered; ``reason`` says why in one line,
  for ``status`` and ``doctor``.

Cancellation: a dial-back in flight is abandoned and its connection on the dialer closed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack

from swarm.errors import MalformedError, PeerError, SwarmError
from swarm.identity import NodeKey
from swarm.net.dial import SLOW_HANDSHAKE, dial_once
from swarm.net.host import build_host, check_peer_id, listen_addrs
from swarm.net.names import DIALBACK_PROTOCOL
from swarm.net.paths import direct_path
from swarm.net.streams import StreamLimits, StreamServer, request, serve

log = logging.getLogger(__name__)

MAX_PORTS = 4
DIALBACK_TIMEOUT_S = 5.0
MIN_INTERVAL_S = 10.0
LIMITS = StreamLimits(max_request=1024, max_response=4096, timeout=4 * DIALBACK_TIMEOUT_S + 2)


@dataclass(frozen=True, slots=True)
class DialbackResult:
    """What one server saw: the IP we came from and, per address it dialled, why not (``""``
    when the dial-back connected)."""

    server: str
    observed_ip: str
    tried: dict[str, str]

    @property
    def reachable(self) -> bool:
        return any(why == "" for why in self.tried.values())


@dataclass
class Reachability:
    """Our verdict: ``status`` is "public", "private" or "unknown"; ``reason`` one line."""

    status: str = "unknown"
    reason: str = "not checked yet"
    results: list[DialbackResult] = field(default_factory=list)
    checked_at: float | None = None

    def failed_ports(self) -> set[int]:
        """Ports every dial-back to failed (an announce address on one is unreachable)."""
        tried: dict[int, bool] = {}
        for result in self.results:
            for addr, why in result.tried.items():
                ports = tcp_ports([addr])
                if ports:
                    tried[ports[0]] = tried.get(ports[0], False) or why == ""
        return {port for port, ok in tried.items() if not ok}

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "observed_ips": sorted({r.observed_ip for r in self.results}),
            "dialed": {a: why or "ok" for r in self.results for a, why in r.tried.items()},
        }


def tcp_ports(addrs: Sequence[str]) -> list[int]:
    """The TCP ports of our listen addresses (``/ip4/.../tcp/<port>/...``), deduplicated."""
    ports: list[int] = []
    for addr in addrs:
        parts = addr.split("/")
        if "p2p-circuit" in parts or "tcp" not in parts:
            continue
        i = parts.index("tcp")
        with contextlib.suppress(IndexError, ValueError):
            port = int(parts[i + 1])
            if 0 < port < 65536 and port not in ports:
                ports.append(port)
    return ports


def _ip_part(ip: str) -> str:
    return f"/ip6/{ip}" if ":" in ip else f"/ip4/{ip}"


class DialbackServer:
    """Answers ``/swarm-node/dialback/1`` on ``host``; dials from its own throwaway host."""

    def __init__(self, host: Any, dialer: Any) -> None:
        self.host = host
        self.dialer = dialer
        self._last: dict[str, float] = {}
        self.server: StreamServer | None = None

    @classmethod
    @asynccontextmanager
    async def start(cls, host: Any) -> AsyncIterator[DialbackServer]:
        dialer = build_host(NodeKey.generate(), ["/ip4/127.0.0.1/tcp/0"])
        async with dialer.run(listen_addrs(["/ip4/127.0.0.1/tcp/0"])):
            server = cls(host, dialer)
            server.server = serve(host, DIALBACK_PROTOCOL, server.handle, LIMITS)
            try:
                yield server
            finally:
                with contextlib.suppress(Exception):
                    host.remove_stream_handler(DIALBACK_PROTOCOL)

    async def handle(self, peer_id: str, body: bytes) -> bytes:
        ports = _parse_request(body)
        now = time.monotonic()
        if now - self._last.get(peer_id, -MIN_INTERVAL_S) < MIN_INTERVAL_S:
            raise PeerError(f"one dial-back per {MIN_INTERVAL_S:g} s; ask again later")
        self._last = {p: t for p, t in self._last.items() if now - t < MIN_INTERVAL_S}
        self._last[peer_id] = now
        path = direct_path(self.host, peer_id)
        if path is None:
            raise PeerError("ask over a direct connection (yours reaches us through a relay)")
        tried: dict[str, str] = {}
        for port in ports:
            addr = f"{_ip_part(path.remote_ip)}/tcp/{port}/p2p/{peer_id}"
            tried[addr] = await self._dial(addr, peer_id)
        log.debug("dial-back to %s: %s", peer_id[-8:], tried)
        return bytes(msgpack.packb({"observed_ip": path.remote_ip, "tried": tried}))

    async def _dial(self, addr: str, peer_id: str) -> str:
        try:
            why = await dial_once(self.dialer, addr, DIALBACK_TIMEOUT_S)
        except SwarmError as exc:
            why = str(exc)
        finally:
            with contextlib.suppress(Exception):
                await self.dialer.get_network().close_peer(check_peer_id(peer_id))
        return why or ""


def _parse_request(body: bytes) -> list[int]:
    try:
        data = msgpack.unpackb(body, max_array_len=MAX_PORTS, max_map_len=4, max_str_len=64)
        ports = [int(p) for p in data["ports"]]
    except Exception as exc:
        raise MalformedError(f"bad dial-back request: {str(exc)[:80]}") from exc
    if not ports or len(ports) > MAX_PORTS or not all(0 < p < 65536 for p in ports):
        raise MalformedError(f"a dial-back request names 1 to {MAX_PORTS} TCP ports")
    return ports


def _parse_answer(server: str, body: bytes) -> DialbackResult:
    try:
        data = msgpack.unpackb(body, max_map_len=2 * MAX_PORTS, max_str_len=512)
        tried = {str(a): str(w) for a, w in dict(data["tried"]).items()}
        return DialbackResult(server, str(data["observed_ip"]), tried)
    except Exception as exc:
        raise PeerError(f"{server} sent a bad dial-back answer: {str(exc)[:80]}") from exc


async def ask_dialback(host: Any, server: str, ports: Sequence[int]) -> DialbackResult:
    """Ask ``server`` (a connected peer ID) to dial us back on ``ports``; ``PeerError`` /
    ``NetworkError`` when it does not answer or refuses."""
    body = msgpack.packb({"ports": list(ports)[:MAX_PORTS]})
    answer = await request(host, server, DIALBACK_PROTOCOL, body, LIMITS)
    return _parse_answer(server, answer)


async def check_reachability(
    host: Any, servers: Sequence[str], addrs: Sequence[str], announce: Sequence[str] = ()
) -> Reachability:
    """Ask up to three ``servers`` (peer IDs we hold a direct connection to) to dial us back
    on the ports of ``addrs``; the verdict with its reason (see the module docstring)."""
    ports = tcp_ports([*announce, *addrs])
    if not ports:
        return Reachability("unknown", "we listen on no TCP port", checked_at=time.time())
    results: list[DialbackResult] = []
    errors: list[str] = []
    for server in list(servers)[:3]:
        try:
            results.append(await ask_dialback(host, server, ports))
        except SwarmError as exc:
            errors.append(f"{server[-8:]}: {str(exc)[:120]}")
            continue
        if results[-1].reachable:
            break
    return verdict(results, errors, announce)


def verdict(
    results: Sequence[DialbackResult], errors: Sequence[str], announce: Sequence[str] = ()
) -> Reachability:
    now = time.time()
    if not results:
        why = "; ".join(errors) or "no peer to ask"
        return Reachability("unknown", f"no dial-back answer ({why})", checked_at=now)
    ok = [a for r in results for a, why in r.tried.items() if why == ""]
    if ok:
        return Reachability("public", f"dialed back at {ok[0]}", list(results), now)
    slow = [a for r in results for a, why in r.tried.items() if why.endswith(SLOW_HANDSHAKE)]
    if slow:
        # The TCP connection reached us, so no NAT or firewall is in the way; our end (or the
        # server's) was too busy to finish the handshake in time. "private" would move us to
        # the DHT's client mode and reserve relay slots, more load again (bench/scale.py at
        # N = 100 on 2 cores); "unknown" checks again in 30 s.
        why = f"dial-back reached {slow[0]} but the libp2p handshake timed out (busy?)"
        return Reachability("unknown", why, list(results), now)
    observed = sorted({r.observed_ip for r in results})
    first = results[0]
    addr, why = next(iter(first.tried.items()))
    untested = [a for a in announce if not any(f"/{ip}/" in a for ip in observed) and "/ip" in a]
    extra = (
        f"; announce address {untested[0]} is not the address you connect from"
        f" ({', '.join(observed)}), so it was not tested"
        if untested
        else ""
    )
    reason = f"nobody could dial us back at {addr}: {why} (we connect from {', '.join(observed)})"
    return Reachability("private", reason + extra, list(results), now)


__all__ = [
    "DialbackResult",
    "DialbackServer",
    "Reachability",
    "ask_dialback",
    "check_reachability",
    "tcp_ports",
    "verdict",
]

"""Circuit relay v2 on py-libp2p 0.8.1: bootstrap peers relay, NATed nodes reserve and dial.

What py-libp2p does and what we add (``shared/background/py-libp2p-relay.md`` has the measured
facts):
- ``RelayHop`` runs py-libp2p's ``CircuitV2Protocol`` with ``allow_hop`` and ``RELAY_LIMITS``
  (reservations, circuits, bytes and seconds per circuit; all four enforced by py-libp2p).
  Its ``HopConfig`` (per-IP limits, rates) is never read by py-libp2p; we add no per-IP layer:
  a reservation costs the relay one table entry, and circuits are bounded by count, bytes and
  time.
- ``RelayClient`` runs the STOP side (accepting circuits) and DCUtR (hole punching) on every
  node, and reserves *explicitly*: py-libp2p's ``RelayDiscovery`` reserved nothing when started
  before the relay connection existed, and a reservation dies with the relay connection, which
  nothing in py-libp2p notices. ``maintain`` checks every ``CHECK_EVERY_S`` that each relay
  connection is alive and its reservation fresh, re-reserves, moves to another relay when one
  is gone, and calls ``on_change`` so the node republishes its advert with the new
  ``/p2p-circuit`` addresses.
- Reservations are renewed every ``REFRESH_EVERY_S``, so one the relay dropped while the
  connection stayed up comes back within a minute (dialers meanwhile get "no reservation").
- A relay that refuses a reservation (status 200-204) or never answers is skipped for
  ``REFUSED_BACKOFF_S`` with a warning naming its reason; the node keeps whatever other
  relays it holds.
- The swarm does not dial ``/p2p-circuit`` addresses; ``dial_circuit`` dials them through the
  transport (connecting to the relay first). Pure dialers use the STOP role only, so dialing
  never spends a reservation.
- ``relayed_budget``: the relay's per-circuit byte limit that the reservation answer states
  (``limit.data``), so bulk transfers over a relay stay below it.

Cancellation: leaving ``RelayClient.start``/``RelayHop.start`` stops the services; the relays
drop our reservations when our connections close.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service.context import background_trio_service

from swarm.errors import NetworkError, SwarmError
from swarm.net.dial import dial_once
from swarm.net.host import check_peer_id, parse_peer_addr
from swarm.net.paths import relayed

log = logging.getLogger(__name__)

RELAY_LIMITS = RelayLimits(
    duration=600,  # s per circuit
    data=64 << 20,  # bytes per circuit (both directions)
    max_circuit_conns=64,
    max_reservations=128,
    reservation_ttl=3600,
)
"""What a bootstrap peer relays: 128 reservations, 64 circuits of at most 10 min and 64 MiB."""

CHECK_EVERY_S = 2.0
REFRESH_EVERY_S = 60.0
"""Reserve again this often: a relay that dropped our reservation (a restart keeping the
connection, an expiry on its clock) takes us back within a minute."""
REFRESH_BEFORE_S = 300.0
REFUSED_BACKOFF_S = 30.0
RESERVE_TIMEOUT_S = 10.0
DIAL_TIMEOUT_S = 10.0
DEFAULT_WANT = 2

_STATUS_TEXT = {
    StatusCode.RESERVATION_REFUSED: "reservation refused",
    StatusCode.RESOURCE_LIMIT_EXCEEDED: "the relay is full (resource limit exceeded)",
    StatusCode.PERMISSION_DENIED: "permission denied",
    StatusCode.CONNECTION_FAILED: "the relay failed",
    StatusCode.NO_RESERVATION: "the relay keeps no reservations (not a relay)",
}


_CIRCUIT_TEXT = {
    StatusCode.NO_RESERVATION: "the relay holds no reservation for that peer (it left, or"
    " moved to another relay: look its advert up again)",
    StatusCode.RESOURCE_LIMIT_EXCEEDED: "the relay is at its circuit limit",
    StatusCode.CONNECTION_FAILED: "the relay could not reach that peer",
}


def _status_of(text: str) -> StatusCode | None:
    try:
        return StatusCode(int(text)) if text.isdigit() else StatusCode[text]
    except (KeyError, ValueError):
        return None


class _DropNoise(logging.Filter):
    """py-libp2p logs an ERROR after every served reservation (the client closing its hop
    stream) and for every failed hole-punch dial (a TCP error); neither is a fault, and our
    own dialers say why a dial failed. DCUtR's own messages (punch started, succeeded) pass."""

    NOISE = (
        "Error reading from hop stream",
        "Error handling stop stream",
        "failed to upgrade security",
        "Failed to open TCP stream",
        "Unexpected error opening TCP stream",
        "Unexpected error reading from stream",
        "Failed to fetch stored addresses",
        "stream is reset",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(n in text for n in self.NOISE)


def quiet_relay_loggers() -> None:
    for name in (
        "libp2p.relay.circuit_v2.protocol",
        "libp2p.relay.circuit_v2.transport",
        "libp2p.relay.circuit_v2.dcutr",
        "libp2p.network.swarm",
        "libp2p.transport.tcp.tcp",
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
    logging.getLogger("libp2p.relay.circuit_v2").setLevel(logging.WARNING)


class _CountingHop(CircuitV2Protocol):
    """py-libp2p's hop, counting the bytes it relays: it keeps no total of its own, and its
    ``_read_stream_with_retry`` is called for circuit data only (``_relay_data``), once per
    chunk read from either side (listed in ``swarm/internals.py``)."""

    relayed_bytes = 0

    async def _read_stream_with_retry(self, stream: Any, *args: Any, **kwargs: Any) -> Any:
        data = await super()._read_stream_with_retry(stream, *args, **kwargs)
        if data:
            self.relayed_bytes += len(data)
        return data


class RelayHop:
    """A circuit relay v2 hop with limits (bootstrap peers run one)."""

    def __init__(self, host: Any, limits: RelayLimits = RELAY_LIMITS) -> None:
        self.limits = limits
        self.protocol: Any = _CountingHop(host, limits=limits, allow_hop=True)

    @classmethod
    @asynccontextmanager
    async def start(cls, host: Any, limits: RelayLimits = RELAY_LIMITS) -> AsyncIterator[RelayHop]:
        quiet_relay_loggers()
        hop = cls(host, limits)
        async with background_trio_service(hop.protocol):
            await hop.protocol.event_started.wait()
            yield hop

    def status(self) -> dict[str, Any]:
        manager = self.protocol.resource_manager
        return {
            "reservations": len(getattr(manager, "_reservations", {}) or {}),
            "circuits": len(self.protocol._active_relays),
            "relayed_bytes": self.protocol.relayed_bytes,
            "limits": {
                "reservations": self.limits.max_reservations,
                "circuits": self.limits.max_circuit_conns,
                "circuit_bytes": self.limits.data,
                "circuit_seconds": self.limits.duration,
            },
        }


@dataclass
class Reservation:
    relay: str  # the relay's peer ID
    addr: str  # the relay's address we dialed, with /p2p/<relay>
    expires: float  # unix seconds
    data_limit: int  # bytes per circuit, as the relay stated (0: not stated)
    reserved_at: float = 0.0  # trio.current_time() of the last successful reservation


class SwarmDCUtR(DCUtRProtocol):
    """py-libp2p's DCUtR with a cheaper scan for relayed connections to punch through.

    Its own ``_auto_drive_loop`` formats every transport address of every connection as text,
    every 2 s, to look for ``/p2p-circuit``: at N = 100 (82 connections a node) that was 4,100
    multiaddr formattings a second on the box, ~5% of an idle 50-node swarm's CPU in
    ``bench/idle.py --profile``. A connection's addresses never change, so each connection is
    looked at once; the rest of the loop (who is skipped, how a punch starts) is py-libp2p's."""

    async def _auto_drive_loop(self) -> None:
        seen: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        while True:
            await trio.sleep(2.0)
            try:
                connections = getattr(self.host.get_network(), "connections", {}) or {}
                for peer_id, conns in list(connections.items()):
                    if (
                        peer_id == self.host.get_id()
                        or peer_id in self._in_progress
                        or peer_id in self._direct_connections
                        or self._hole_punch_attempts.get(peer_id, 0) >= MAX_HOLE_PUNCH_ATTEMPTS
                    ):
                        continue
                    if any(_relayed(conn, seen) for conn in _as_list(conns)):
                        await self.initiate_hole_punch(peer_id)
            except trio.Cancelled:
                raise
            except Exception as exc:  # as py-libp2p's loop: one bad round is not fatal
                log.debug("DCUtR auto-drive round failed: %s", exc)


def _as_list(conns: Any) -> list[Any]:
    return list(conns) if isinstance(conns, list) else [conns] if conns else []


def _relayed(conn: Any, seen: weakref.WeakKeyDictionary[Any, bool]) -> bool:
    """``paths.relayed``, remembered per connection once it can be told."""
    try:
        return seen[conn]
    except (KeyError, TypeError):
        pass
    answer = relayed(conn)
    if answer is not None:  # no addresses yet: ask again next round
        with contextlib.suppress(TypeError):  # an object that takes no weak reference
            seen[conn] = answer
    return bool(answer)


class RelayClient:
    """The STOP side, DCUtR and our reservations (use ``RelayClient.start``)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.protocol: Any = CircuitV2Protocol(host, allow_hop=False)
        # STOP only: with CLIENT, the transport would reserve a slot for every dial we make.
        self.transport: Any = CircuitV2Transport(
            host, self.protocol, RelayConfig(roles=RelayRole.STOP)
        )
        self.dcutr: Any = SwarmDCUtR(host)
        self.reservations: dict[str, Reservation] = {}
        self.refused: dict[str, tuple[float, str]] = {}
        """relay address -> (monotonic time, reason) of its last refusal or failure."""
        self.moves = 0

    @classmethod
    @asynccontextmanager
    async def start(cls, host: Any) -> AsyncIterator[RelayClient]:
        quiet_relay_loggers()
        client = cls(host)
        async with background_trio_service(client.protocol):
            await client.protocol.event_started.wait()
            async with background_trio_service(client.dcutr):
                await client.dcutr.event_started.wait()
                yield client

    # -- reservations ---------------------------------------------------------------------------

    async def reserve(self, relay_addr: str) -> Reservation:
        """Connect to the relay at ``relay_addr`` (``/.../p2p/<relay>``) and reserve a slot;
        ``NetworkError`` saying why not."""
        info = parse_peer_addr(relay_addr)
        relay = str(info.peer_id)
        if not self._connected(relay):
            why = await dial_once(self.host, relay_addr, DIAL_TIMEOUT_S)
            if why is not None:
                raise NetworkError(f"relay {relay_addr} not reached: {why}")
        try:
            with trio.fail_after(RESERVE_TIMEOUT_S):
                stream = await self.host.new_stream(info.peer_id, [HOP_PROTOCOL])
                try:
                    request = HopMessage(
                        type=HopMessage.RESERVE,
                        peer=CircuitPeerId(id=self.host.get_id().to_bytes()),
                    )
                    await write_delimited_msg(stream, request)
                    answer = await read_delimited_msg(stream, HopMessage)
                finally:
                    with contextlib.suppress(Exception):
                        await stream.close()
        except trio.TooSlowError as exc:
            raise NetworkError(f"relay {relay_addr} did not answer the reservation") from exc
        except SwarmError:
            raise
        except Exception as exc:
            raise NetworkError(f"relay {relay_addr} refused the hop protocol: {exc}") from exc
        code = StatusCode(answer.status) if answer.HasField("status") else StatusCode.OK
        if code != StatusCode.OK or not answer.HasField("reservation"):
            why = _STATUS_TEXT.get(code, f"status {int(code)}")
            raise NetworkError(f"relay {relay_addr} refused our reservation: {why}")
        limit = int(answer.limit.data) if answer.HasField("limit") else 0
        reservation = Reservation(
            relay, relay_addr, float(answer.reservation.expire), limit, trio.current_time()
        )
        self.reservations[relay] = reservation
        return reservation

    def _connected(self, peer_id: str) -> bool:
        with contextlib.suppress(Exception):
            return bool(self.host.get_network().connections.get(check_peer_id(peer_id)))
        return False

    async def maintain(
        self,
        relays: Callable[[], Sequence[str]],
        want: Callable[[], int],
        on_change: Callable[[], Awaitable[None]],
    ) -> None:
        """Hold ``want()`` reservations on the relays ``relays()`` names (addresses with
        ``/p2p/``), forever (see the module docstring)."""
        while True:
            before = set(self.reservations)
            await self.check_once(relays(), want())
            if set(self.reservations) != before:
                try:
                    await on_change()
                except SwarmError as exc:
                    log.warning("republishing our addresses failed: %s", exc)
            await trio.sleep(CHECK_EVERY_S)

    async def check_once(self, relays: Sequence[str], want: int) -> None:
        now = time.time()
        for relay, held in list(self.reservations.items()):
            if not self._connected(relay):
                log.warning(
                    "lost our relay %s (its connection closed); moving to another", held.addr
                )
                del self.reservations[relay]
                self.refused[held.addr] = (time.monotonic(), "connection lost")
                self.moves += 1
            elif (
                held.expires - now < REFRESH_BEFORE_S
                or trio.current_time() - held.reserved_at > REFRESH_EVERY_S
                or want <= 0
            ):
                if want <= 0:
                    del self.reservations[relay]
                    continue
                try:
                    await self.reserve(held.addr)
                except SwarmError as exc:
                    log.warning("%s; dropping that relay", exc)
                    del self.reservations[relay]
                    self.refused[held.addr] = (time.monotonic(), str(exc))
        for addr in relays:
            if len(self.reservations) >= want:
                return
            try:
                relay = str(parse_peer_addr(addr).peer_id)
            except SwarmError:
                continue
            last = self.refused.get(addr)
            if relay in self.reservations or (
                last is not None and time.monotonic() - last[0] < REFUSED_BACKOFF_S
            ):
                continue
            try:
                held = await self.reserve(addr)
            except SwarmError as exc:
                log.warning("%s; trying other relays", exc)
                self.refused[addr] = (time.monotonic(), str(exc))
                continue
            self.refused.pop(addr, None)
            log.info(
                "reserved a relay slot on %s (circuits of at most %s MiB); reachable at %s",
                addr,
                held.data_limit >> 20 if held.data_limit else "?",
                self.circuit_addr(held),
            )

    def circuit_addr(self, held: Reservation) -> str:
        return f"{held.addr}/p2p-circuit/p2p/{self.host.get_id().to_base58()}"

    def circuit_addrs(self) -> list[str]:
        """Our relayed addresses, one per reservation held."""
        return [self.circuit_addr(r) for r in self.reservations.values()]

    # -- dialing --------------------------------------------------------------------------------

    async def dial_circuit(self, addr: str, timeout: float = DIAL_TIMEOUT_S) -> None:
        """Connect to the peer at circuit address ``addr`` through its relay; ``NetworkError``
        saying why not."""
        relay_addr = addr.split("/p2p-circuit", 1)[0]
        try:
            relay = str(parse_peer_addr(relay_addr).peer_id)
        except SwarmError as exc:
            raise NetworkError(f"{addr[:120]} is not a circuit address: {exc}") from exc
        if not self._connected(relay):
            why = await dial_once(self.host, relay_addr, timeout)
            if why is not None:
                raise NetworkError(f"relay of {addr} not reached: {why}")
        try:
            with trio.fail_after(timeout):
                await self.transport.dial(multiaddr.Multiaddr(addr))
        except trio.TooSlowError as exc:
            raise NetworkError(f"circuit {addr} timed out after {timeout:g} s") from exc
        except Exception as exc:
            text = str(exc)
            code = re.search(r"status (?:StatusCode\.)?(\w+)", text)
            why = text[:160]
            if code is not None:
                status = _status_of(code.group(1))
                if status is not None:
                    why = _CIRCUIT_TEXT.get(status, _STATUS_TEXT.get(status, why))
            raise NetworkError(f"circuit {addr} failed: {why}") from exc

    def relayed_budget(self) -> int:
        """The smallest per-circuit byte limit our relays stated (0: unknown)."""
        limits = [r.data_limit for r in self.reservations.values() if r.data_limit]
        return min(limits, default=0)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "reservations": [
                {"relay": r.addr, "expires_in_s": int(r.expires - time.time())}
                for r in self.reservations.values()
            ],
            "relayed_addrs": self.circuit_addrs(),
            "relay_moves": self.moves,
            "refused": {a: why for a, (t, why) in self.refused.items() if now - t < 600},
        }


def is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr


__all__ = [
    "RELAY_LIMITS",
    "RelayClient",
    "RelayHop",
    "RelayLimits",
    "Reservation",
    "is_circuit",
    "quiet_relay_loggers",
]

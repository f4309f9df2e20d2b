"""SHARDCAST on libp2p streams: the handlers a node serves and the ``ShardSource`` it fetches
with.

Control (manifest, holdings, data channel offers) always goes over the run's authenticated
stream protocols ``/swarm-node/<run>/manifest/1`` and ``/swarm-node/<run>/shard/1``. Shard
bytes go over the peer's plain-TCP data channel when it offers one and it can be reached;
otherwise (relayed peers, NAT, a refused or failing channel) over the shard stream itself, in
pieces of at most ``MAX_PIECE`` so neither side holds more than a piece in memory. A peer whose
data channel fails is not asked for one again during this source's life.

Who may be connected to (the data channel is plain TCP outside libp2p, so this is where a peer
could aim us at a third host):
- the server offers its channel only over a *direct* libp2p connection, at the local address
  that connection arrived on, and only when the channel listens there (``offer_host``); over a
  relayed connection, or to an asker that reached an address the channel does not listen on,
  it refuses and the asker uses streams;
- the client connects only to the IP address of its current direct libp2p connection to the
  peer, at the offered port; an offer naming any other host is refused (``refused_offers``),
  logged, and the shard comes over streams.

Relays (circuit relay v2) cap the bytes of each circuit, and a circuit past its cap is reset.
Over a relayed-only connection, shard bytes go over streams only while the endpoint's
``relayed_bytes_left`` allows (the node keeps the count per relayed connection, below the
relay's limit); past that a pull fails at once with ``RelayBudgetSpent``, so the fetch takes the
shard from other holders (trainers and direct peers) and never runs a relay into its limit.

The node side is reached through ``StreamEndpoint`` (``handle``/``request``, what
``node.runtime.Node`` offers), so this module never imports the runtime.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from swarm.errors import MalformedError, NetworkError, PeerError, SwarmError
from swarm.messages import ShardManifest
from swarm.net.names import MANIFEST, SHARD
from swarm.net.paths import DirectPath, same_ip
from swarm.net.streams import StreamLimits
from swarm.shardcast.datachannel import DataChannelServer, DataChannelSource
from swarm.shardcast.protocol import (
    LATEST,
    MAX_PIECE,
    ChannelOffer,
    Holdings,
    ManifestRequest,
    ShardRequest,
)
from swarm.shardcast.serve import ShardServer
from swarm.shardcast.source import (
    BUSY,
    ELSEWHERE,
    PeerBusy,
    ShardElsewhere,
    ShardNotHeld,
    ShardSink,
)

_SHED = f"{BUSY}: every request slot of this protocol is in use; ask again shortly"
MANIFEST_LIMITS = StreamLimits(
    max_request=4096,
    max_response=ShardManifest.MAX_BYTES + 1024,
    timeout=10.0,
    concurrency=32,
    shed_answer=_SHED,
)
SHARD_LIMITS = StreamLimits(
    max_request=4096,
    max_response=MAX_PIECE + 1024,
    timeout=30.0,
    concurrency=64,
    per_peer=8,
    shed_answer=_SHED,
)
"""64 at once: up to ``MAX_WAITING`` of them are waiting ``have`` answers (one per asker that
fetches from us), the rest are ``get``/``channel`` requests; shard bytes are bounded by the
upload slots, not by this. With the default 16, 16 waiting answers would shed every other
request. Past them an asker is told ``busy`` (``PeerBusy``: rest, no fault), not reset."""
_NOT_HELD = "not held"
_WILDCARDS = ("0.0.0.0", "::", "")
T = TypeVar("T")
log = logging.getLogger(__name__)


class StreamEndpoint(Protocol):
    """What SHARDCAST needs from a running node (``node.runtime.Node`` has both)."""

    def handle(
        self,
        name: str,
        handler: Callable[[str, bytes], Awaitable[bytes]],
        limits: StreamLimits = ...,
    ) -> Any: ...

    async def request(
        self, peer_id: str, name: str, payload: bytes, limits: StreamLimits = ...
    ) -> bytes: ...

    def direct_path(self, peer_id: str) -> DirectPath | None: ...


def offer_host(bound: str, path: DirectPath | None, advertised: str | None = None) -> str | None:
    """The host to offer an asker whose connection to us is ``path``, for a channel bound to
    ``bound``; ``None`` when the asker cannot reach the channel directly.

    ``advertised`` (a public address that a NAT forwards to us) is offered only to an asker that
    came from a global address to one of our private ones, i.e. through that NAT."""
    if path is None:
        return None  # relayed or unknown: only libp2p streams reach us
    if bound not in _WILDCARDS and not same_ip(bound, path.local_ip):
        return None  # the channel listens elsewhere than where the asker reached us
    if advertised and _private(path.local_ip) and not _private(path.remote_ip):
        return advertised
    return path.local_ip


def _private(ip: str) -> bool:
    try:
        return not ipaddress.ip_address(ip).is_global
    except ValueError:
        return True


def serve_shardcast(
    endpoint: StreamEndpoint,
    server: ShardServer,
    channel: DataChannelServer | None = None,
    advertised_host: str | None = None,
) -> None:
    """Serve the manifest and shard protocols from ``server``; offer ``channel`` (when given)
    to askers that can reach it directly (``offer_host``; ``advertised_host`` is a public
    address a NAT forwards to the channel)."""

    async def on_manifest(peer: str, body: bytes) -> bytes:
        request = ManifestRequest.from_bytes(body)
        version = None if request.version == LATEST else request.version
        return _refuse_not_held(lambda: server.manifest(version))

    async def on_shard(peer: str, body: bytes) -> bytes:
        request = ShardRequest.from_bytes(body)
        if request.op == "have":
            try:
                bits = await server.wait_have(
                    request.version, request.known, request.wait_ms / 1000
                )
            except ShardNotHeld as exc:
                raise ShardNotHeld(f"{_NOT_HELD}: {exc}") from exc
            return Holdings(complete=bits is None, bits=bits or b"").to_bytes()
        if request.op == "channel":
            if channel is None or not channel.port:
                raise PeerError("this node offers no data channel; use the shard stream")
            host = offer_host(channel.config.host, endpoint.direct_path(peer), advertised_host)
            if host is None:
                raise PeerError("no data channel reachable over this connection; use the stream")
            return ChannelOffer(host, channel.port, server.issue_token(peer)).to_bytes()
        return _refuse_not_held(
            lambda: server.read(request.version, request.index, request.offset, request.length)
        )

    endpoint.handle(MANIFEST, on_manifest, MANIFEST_LIMITS)
    endpoint.handle(SHARD, on_shard, SHARD_LIMITS)


def _refuse_not_held(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except ShardNotHeld as exc:
        raise ShardNotHeld(f"{_NOT_HELD}: {exc}") from exc


def _translate(exc: PeerError) -> PeerError:
    """A refusal whose reason says "not held" is a ``ShardNotHeld``, not a fault."""
    text = str(exc)
    if "refused /swarm-node/" in text and f": {_NOT_HELD}: " in text:
        return ShardNotHeld(text)
    if "refused /swarm-node/" in text and f": {ELSEWHERE}: " in text:
        return ShardElsewhere(text)
    if "refused /swarm-node/" in text and f": {BUSY}: " in text:
        return PeerBusy(text)
    return exc


class RelayBudgetSpent(PeerError):
    """The peer is reached only through a relay, and this shard would pass our byte cap."""


class StreamShardSource:
    """A ``ShardSource`` over a node's libp2p streams, with data channels when offered."""

    def __init__(self, endpoint: StreamEndpoint, *, data_channel: bool = True) -> None:
        self.endpoint = endpoint
        self.data_channel = data_channel
        self._channel = DataChannelSource(self._negotiate, self)
        self._no_channel: set[str] = set()
        self.stream_pulls = 0
        self.channel_pulls = 0
        self.refused_offers = 0
        self.relay_refusals = 0

    async def _ask(self, peer: str, name: str, body: bytes, limits: StreamLimits) -> bytes:
        try:
            return await self.endpoint.request(peer, name, body, limits)
        except PeerError as exc:
            raise _translate(exc) from exc

    async def manifest(self, peer: str, version: int | None) -> bytes:
        body = ManifestRequest(LATEST if version is None else version).to_bytes()
        return await self._ask(peer, MANIFEST, body, MANIFEST_LIMITS)

    async def have(
        self, peer: str, version: int, known: int = -1, wait: float = 0.0
    ) -> bytes | None:
        request = ShardRequest("have", version, known=known, wait_ms=int(wait * 1000))
        answer = await self._ask(peer, SHARD, request.to_bytes(), SHARD_LIMITS)
        try:
            holdings = Holdings.from_bytes(answer)
        except SwarmError as exc:
            raise PeerError(f"{peer} answered have with nonsense: {exc}") from exc
        return None if holdings.complete else holdings.bits

    async def _negotiate(self, peer: str) -> tuple[str, int, bytes]:
        path = self.endpoint.direct_path(peer)
        if path is None:
            raise NetworkError(f"no direct connection to {peer}: shard bytes go over streams")
        answer = await self._ask(peer, SHARD, ShardRequest("channel", 0).to_bytes(), SHARD_LIMITS)
        try:
            offer = ChannelOffer.from_bytes(answer)
        except MalformedError as exc:
            raise PeerError(f"{peer} sent a bad data channel offer: {exc}") from exc
        if not same_ip(offer.host, path.remote_ip):
            self.refused_offers += 1
            behind_nat = _private(offer.host) and not _private(path.remote_ip)
            (log.info if behind_nat else log.warning)(
                "refused the data channel offer of %s: it names host %s, but our connection to"
                " it is with %s%s; fetching its shards over libp2p streams",
                peer[-8:],
                offer.host[:64],
                path.remote_ip,
                " (it is behind a NAT: a punched hole or a forwarded port)" if behind_nat else "",
            )
            raise PeerError(f"{peer} offered a data channel at another host ({offer.host[:64]})")
        return path.remote_ip, offer.port, offer.token

    async def pull(self, peer: str, version: int, index: int, sink: ShardSink) -> None:
        if self.data_channel and peer not in self._no_channel and sink.received == 0:
            try:
                await self._channel.pull(peer, version, index, sink)
                self.channel_pulls += 1
                return
            except (ShardNotHeld, PeerBusy):
                raise
            except NetworkError:
                if sink.received:  # bytes came, then the channel broke: a real failure
                    raise
                self._no_channel.add(peer)  # no channel to this peer: streams from now on
        left = self._relayed_bytes_left(peer)
        wanted = sink.length - sink.received
        if left is not None and wanted > left:
            self.relay_refusals += 1
            raise RelayBudgetSpent(
                f"{peer} is reached only through a relay and {left} bytes are left of our cap"
                f" on that circuit (this shard needs {wanted}); fetching it from other holders"
            )
        before = sink.received
        try:
            await self._pull_stream(peer, version, index, sink)
        finally:
            if left is not None:
                self.endpoint.spend_relayed(peer, sink.received - before)  # type: ignore[attr-defined]
        self.stream_pulls += 1

    def _relayed_bytes_left(self, peer: str) -> int | None:
        """``None``: no relay cap applies (a direct connection, or an endpoint without one)."""
        left = getattr(self.endpoint, "relayed_bytes_left", None)
        return None if left is None else left(peer)

    async def _pull_stream(self, peer: str, version: int, index: int, sink: ShardSink) -> None:
        while sink.received < sink.length:
            length = min(MAX_PIECE, sink.length - sink.received)
            request = ShardRequest("get", version, index, sink.received, length)
            piece = await self._ask(peer, SHARD, request.to_bytes(), SHARD_LIMITS)
            if not piece:
                return  # truncated: the scheduler sees a short shard
            sink.write(piece)
            if len(piece) < length:
                return

    def close(self) -> None:
        self._channel.close()

"""SHARDCAST on libp2p streams: the handlers a node serves and the ``ShardSource`` it fetches
with.

Control (manifest, holdings, data channel offers) always goes over the run's authenticated
stream protocols ``/swarm-node/<run>/manifest/1`` and ``/swarm-node/<run>/shard/1``. Shard
bytes go over the peer's plain-TCP data channel when it offers one and it can be reached;
otherwise (relayed peers, NAT, a refused or failing channel) over the shard stream itself, in
pieces of at most ``MAX_PIECE`` so neither side holds more than a piece in memory. A peer whose
data channel fails is not asked for one again during this source's life.

The node side is reached through ``StreamEndpoint`` (``handle``/``request``, what
``node.runtime.Node`` offers), so this module never imports the runtime.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from swarm.errors import MalformedError, NetworkError, PeerError, SwarmError
from swarm.messages import ShardManifest
from swarm.net.names import MANIFEST, SHARD
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
from swarm.shardcast.source import ShardNotHeld, ShardSink

MANIFEST_LIMITS = StreamLimits(
    max_request=4096, max_response=ShardManifest.MAX_BYTES + 1024, timeout=10.0
)
SHARD_LIMITS = StreamLimits(max_request=4096, max_response=MAX_PIECE + 1024, timeout=30.0)
_NOT_HELD = "not held"
T = TypeVar("T")


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


def serve_shardcast(
    endpoint: StreamEndpoint,
    server: ShardServer,
    channel: DataChannelServer | None = None,
    advertised_host: str | None = None,
) -> None:
    """Serve the manifest and shard protocols from ``server``; offer ``channel`` (when given)
    at ``advertised_host`` (default: the channel's bind address)."""

    async def on_manifest(peer: str, body: bytes) -> bytes:
        request = ManifestRequest.from_bytes(body)
        version = None if request.version == LATEST else request.version
        return _refuse_not_held(lambda: server.manifest(version))

    async def on_shard(peer: str, body: bytes) -> bytes:
        request = ShardRequest.from_bytes(body)
        if request.op == "have":
            bits = _refuse_not_held(lambda: server.have(request.version))
            return Holdings(complete=bits is None, bits=bits or b"").to_bytes()
        if request.op == "channel":
            if channel is None or not channel.port:
                raise PeerError("this node offers no data channel; use the shard stream")
            host = advertised_host or channel.config.host
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
    return exc


class StreamShardSource:
    """A ``ShardSource`` over a node's libp2p streams, with data channels when offered."""

    def __init__(self, endpoint: StreamEndpoint, *, data_channel: bool = True) -> None:
        self.endpoint = endpoint
        self.data_channel = data_channel
        self._channel = DataChannelSource(self._negotiate, self)
        self._no_channel: set[str] = set()
        self.stream_pulls = 0
        self.channel_pulls = 0

    async def _ask(self, peer: str, name: str, body: bytes, limits: StreamLimits) -> bytes:
        try:
            return await self.endpoint.request(peer, name, body, limits)
        except PeerError as exc:
            raise _translate(exc) from exc

    async def manifest(self, peer: str, version: int | None) -> bytes:
        body = ManifestRequest(LATEST if version is None else version).to_bytes()
        return await self._ask(peer, MANIFEST, body, MANIFEST_LIMITS)

    async def have(self, peer: str, version: int) -> bytes | None:
        answer = await self._ask(
            peer, SHARD, ShardRequest("have", version).to_bytes(), SHARD_LIMITS
        )
        try:
            holdings = Holdings.from_bytes(answer)
        except SwarmError as exc:
            raise PeerError(f"{peer} answered have with nonsense: {exc}") from exc
        return None if holdings.complete else holdings.bits

    async def _negotiate(self, peer: str) -> tuple[str, int, bytes]:
        answer = await self._ask(peer, SHARD, ShardRequest("channel", 0).to_bytes(), SHARD_LIMITS)
        try:
            offer = ChannelOffer.from_bytes(answer)
        except MalformedError as exc:
            raise PeerError(f"{peer} sent a bad data channel offer: {exc}") from exc
        return offer.host, offer.port, offer.token

    async def pull(self, peer: str, version: int, index: int, sink: ShardSink) -> None:
        if self.data_channel and peer not in self._no_channel and sink.received == 0:
            try:
                await self._channel.pull(peer, version, index, sink)
                self.channel_pulls += 1
                return
            except ShardNotHeld:
                raise
            except NetworkError:
                if sink.received:  # bytes came, then the channel broke: a real failure
                    raise
                self._no_channel.add(peer)  # no channel to this peer: streams from now on
        await self._pull_stream(peer, version, index, sink)
        self.stream_pulls += 1

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

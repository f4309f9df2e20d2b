"""The SHARDCAST request/response messages carried on libp2p streams.

``/swarm-node/<run>/manifest/1``: ``ManifestRequest`` -> the raw signed ShardManifest envelope.
``/swarm-node/<run>/shard/1``: ``ShardRequest`` with ``op``:

- ``have``    -> ``Holdings`` (complete, or one byte per shard); with ``known`` >= 0 (the
  shards the asker knows we hold) the answer waits until we hold more, at most ``wait_ms``;
- ``get``     -> the bytes of (part of) one shard: ``offset``/``length`` inside the shard,
  at most ``MAX_PIECE`` per request, so neither side holds more than a piece in memory;
- ``channel`` -> ``ChannelOffer`` (host, port, one-time token of the data channel).

Each message is a frozen dataclass with ``to_bytes``/``from_bytes`` (canonical msgpack maps,
bounded decoding, unknown fields ignored). Refusals travel as the stream helpers' refusal
status with a reason text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Self

from swarm.errors import MalformedError
from swarm.messages import Fields
from swarm.wire import canonical, decode_canonical

MAX_PIECE = 4 * 1024 * 1024
LATEST = -1
_SMALL = 4096

Op = Literal["have", "get", "channel"]


@dataclass(frozen=True, slots=True)
class ManifestRequest:
    version: int = LATEST  # LATEST: the newest version the peer holds

    def to_bytes(self) -> bytes:
        return canonical({"version": self.version})

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        f = Fields("manifest-request", decode_canonical(data, _SMALL))
        return cls(version=f.integer("version", minimum=LATEST))


@dataclass(frozen=True, slots=True)
class ShardRequest:
    op: Op
    version: int
    index: int = 0
    offset: int = 0
    length: int = 0
    known: int = -1
    """``have``: shards the asker knows we hold (-1: none known, answer at once)."""
    wait_ms: int = 0
    """``have``: how long the answer may wait for a new shard (``ShardServer.wait_have``)."""

    def to_bytes(self) -> bytes:
        fields: dict[str, object] = {
            "op": self.op,
            "version": self.version,
            "index": self.index,
            "offset": self.offset,
            "length": self.length,
        }
        if self.op == "have" and self.known >= 0:
            fields |= {"known": self.known, "wait_ms": self.wait_ms}
        return canonical(fields)

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        f = Fields("shard-request", decode_canonical(data, _SMALL))
        op = f.text("op")
        if op not in ("have", "get", "channel"):
            raise MalformedError(f"unknown shard request op {op[:20]!r}")
        length = f.integer("length", 0, minimum=0)
        if length > MAX_PIECE:
            raise MalformedError(f"piece of {length} bytes is over the limit of {MAX_PIECE}")
        return cls(
            op=op,  # type: ignore[arg-type]
            version=f.integer("version", minimum=0),
            index=f.integer("index", 0, minimum=0),
            offset=f.integer("offset", 0, minimum=0),
            length=length,
            known=f.integer("known", -1, minimum=-1),
            wait_ms=f.integer("wait_ms", 0, minimum=0),
        )


@dataclass(frozen=True, slots=True)
class Holdings:
    complete: bool
    bits: bytes = b""

    def to_bytes(self) -> bytes:
        return canonical({"complete": self.complete, "bits": self.bits})

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        f = Fields("holdings", decode_canonical(data, 1 << 20))
        return cls(complete=f.flag("complete"), bits=f.blob("bits", b""))


@dataclass(frozen=True, slots=True)
class ChannelOffer:
    host: str
    port: int
    token: bytes

    def to_bytes(self) -> bytes:
        return canonical({"host": self.host, "port": self.port, "token": self.token})

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        f = Fields("channel-offer", decode_canonical(data, _SMALL))
        port = f.integer("port", minimum=1)
        if port > 65535:
            raise MalformedError(f"port {port} out of range")
        return cls(host=f.text("host"), port=port, token=f.blob("token", length=16))

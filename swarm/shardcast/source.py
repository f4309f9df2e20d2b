"""What the fetch scheduler drives: a ``ShardSource`` (data channel, libp2p stream, or a test
double), the ``ShardSink`` it delivers one shard's bytes into, ``ShardNotHeld`` and
``PeerBusy`` (and its ``ShardElsewhere``)."""

from __future__ import annotations

import hashlib
from typing import Protocol

import trio

from swarm.errors import PeerError
from swarm.shardcast.store import VersionFile


class ShardNotHeld(PeerError):
    """The provider does not (yet) hold the shard or version asked for. Not a fault."""


BUSY = "busy"


class PeerBusy(PeerError):
    """Every upload slot of the provider is taken: ask another holder, or this one shortly.
    Not a fault (it costs the peer no failure budget)."""


ELSEWHERE = "elsewhere"


class ShardElsewhere(PeerBusy):
    """The origin super-seeds: it gave this shard to enough peers already, take it from them.
    Not a fault; the origin still serves other shards (``ShardServer.grant``)."""


class ShardSink:
    """Takes one shard's bytes in order, hashes them and writes them at their place.

    Writing past the shard's length raises ``PeerError``. Each write pushes the pull's stall
    deadline forward (when a cancel scope is attached). An ``in_memory`` sink (the endgame's
    second pull of a shard) keeps the bytes until ``commit`` writes them, so two pulls of one
    shard never write the same region at once.
    """

    def __init__(
        self,
        vf: VersionFile,
        index: int,
        stall_timeout: float | None = None,
        *,
        in_memory: bool = False,
    ) -> None:
        self.index = index
        self.offset, self.length = vf.manifest.shard_span(index)
        self.received = 0
        self._vf = vf
        self._hash = hashlib.sha256()
        self._stall = stall_timeout
        self._buffer: bytearray | None = bytearray() if in_memory else None
        self.scope: trio.CancelScope | None = None
        self.superseded = False

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        view = memoryview(chunk)
        if self.received + len(view) > self.length:
            raise PeerError(f"shard {self.index}: peer sent more than its {self.length} bytes")
        self._hash.update(view)
        if self._buffer is not None:
            self._buffer += view
        else:
            self._vf.write_at(self.offset + self.received, view)
        self.received += len(view)
        if self.scope is not None and self._stall is not None:
            self.scope.deadline = trio.current_time() + self._stall

    def digest(self) -> bytes:
        return self._hash.digest()

    def commit(self) -> None:
        """Write what an in-memory sink holds at the shard's offset (no-op for a file sink)."""
        if self._buffer is not None:
            self._vf.write_at(self.offset, self._buffer)
            self._buffer = None


class ShardSource(Protocol):
    """How the scheduler reaches providers. Every method raises only ``SwarmError``s:
    ``ShardNotHeld`` when the peer lacks what was asked, ``PeerError``/``NetworkError``/
    ``RequestTimeout`` for anything else that went wrong with that peer."""

    async def manifest(self, peer: str, version: int | None) -> bytes:
        """The raw signed manifest of ``version`` (``None``: the newest the peer holds)."""
        ...

    async def have(
        self, peer: str, version: int, known: int = -1, wait: float = 0.0
    ) -> bytes | None:
        """One byte per shard (1 = held), or ``None`` when the peer holds the whole version.

        ``known`` >= 0: the number of shards the asker knows the peer holds; the peer may hold
        its answer back up to ``wait`` seconds until it holds more (a source that cannot wait
        answers at once)."""
        ...

    async def pull(self, peer: str, version: int, index: int, sink: ShardSink) -> None:
        """Deliver shard ``index`` into ``sink`` (all ``sink.length`` bytes, in order)."""
        ...

"""The data channel: shard bytes over plain TCP with zero-copy ``sendfile``.

Shard content is verified by hash against the signed manifest, so these bytes need neither
encryption nor framing beyond a length. A connection is opened with a one-time token that the
asker got over an authenticated libp2p stream (``ShardServer.issue_token``); it then carries any
number of requests, one after another.

Wire format (all integers big-endian)::

    hello     b"SHC1" + token (16 bytes)              -> status
    request   version u64, index u32, offset u64, length u64 (28 bytes)
                                                       -> status, then for OK: length u64 + bytes
    status    u8: 0 OK; 1 REFUSED / 2 NOT_HELD / 3 BUSY (every upload slot taken) / 4 ELSEWHERE
              (the origin super-seeds: take this shard from a peer), each followed by u16 n +
              n bytes of UTF-8 reason

A refused request (unknown version, absurd index or span) leaves the connection usable; a bad
hello or a malformed request closes it. A connection past ``max_connections`` gets status
BUSY in place of the hello's answer, then is closed. The server bounds connections, idle time
and the time to send one answer, so a slow or stuck reader costs a connection slot, never the
server.
``TokenBucket`` caps a server's upload rate (used by the benchmark to model slow uplinks).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from swarm.errors import (
    NetworkError,
    PeerError,
    RequestTimeout,
    StorageError,
    SwarmError,
)
from swarm.shardcast.serve import TOKEN_BYTES, ShardServer
from swarm.shardcast.source import PeerBusy, ShardElsewhere, ShardNotHeld, ShardSink

MAGIC = b"SHC1"
_HELLO = struct.Struct(f">4s{TOKEN_BYTES}s")
_REQUEST = struct.Struct(">QIQQ")
_LENGTH = struct.Struct(">Q")
_REASON = struct.Struct(">H")
OK, REFUSED, NOT_HELD, BUSY, ELSEWHERE = 0, 1, 2, 3, 4
_SEND_CHUNK = 4 * 1024 * 1024
_RECV_CHUNK = 1024 * 1024


class TokenBucket:
    """At most ``rate`` bytes/s on average, bursts up to ``burst`` bytes."""

    def __init__(self, rate: float, burst: int | None = None) -> None:
        self.rate = float(rate)
        self.burst = burst if burst is not None else max(1, int(rate / 10))
        self._tokens = float(self.burst)
        self._at = trio.current_time()

    async def take(self, wanted: int) -> int:
        """Wait until some tokens are there; returns how many bytes may go now (<= wanted)."""
        while True:
            now = trio.current_time()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens >= 1:
                grant = int(min(wanted, self._tokens))
                self._tokens -= grant
                return grant
            await trio.sleep((1 - self._tokens) / self.rate + 0.001)


@dataclass
class DataChannelConfig:
    host: str = "127.0.0.1"
    port: int = 0
    max_connections: int = 64
    idle_timeout: float = 60.0
    send_timeout: float = 60.0
    rate_limit: float | None = None  # bytes/s for the whole server; None = unlimited
    chunk: int = _SEND_CHUNK


@dataclass
class DataChannelServer:
    """Serves a ``ShardServer`` on a TCP port (use ``await nursery.start(server.run)``)."""

    shards: ShardServer
    config: DataChannelConfig = field(default_factory=DataChannelConfig)
    port: int = 0
    connections: int = 0
    errors: int = 0
    turned_away: int = 0
    open: int = 0
    """Connections being served now (at most ``config.max_connections``)."""
    _bucket: TokenBucket | None = None

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.config.port, host=self.config.host)
        self.port = listeners[0].socket.getsockname()[1]
        if self.config.rate_limit:
            self._bucket = TokenBucket(self.config.rate_limit, burst=256 * 1024)
        async with trio.open_nursery() as nursery:
            task_status.started(self.port)
            try:
                while True:
                    stream = await listeners[0].accept()
                    if self.open >= self.config.max_connections:
                        nursery.start_soon(self._turn_away, stream)
                        continue
                    self.open += 1  # counted here, so a burst of accepts cannot overshoot
                    nursery.start_soon(self._connection, stream)
            finally:
                for listener in listeners:
                    await listener.aclose()

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        try:
            await self._session(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            self.errors += 1
        except SwarmError:
            self.errors += 1
        except OSError:
            self.errors += 1
        finally:
            self.open -= 1
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await stream.aclose()

    async def _turn_away(self, stream: trio.SocketStream) -> None:
        """Every connection slot is taken: say *busy* (no fault, the asker takes the shard from
        another holder or comes back) instead of closing the socket, which the asker would
        count against our failure budget (on 50 loopback nodes, the trainer's 64 slots were
        all held by askers' pooled connections and it was dropped for the version)."""
        self.turned_away += 1
        with trio.move_on_after(1), contextlib.suppress(OSError, trio.BrokenResourceError):
            await _send_status(
                stream,
                BUSY,
                f"busy: all {self.config.max_connections} data channel connections are in use",
            )
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True
            await stream.aclose()

    async def _session(self, stream: trio.SocketStream) -> None:
        with trio.fail_after(self.config.idle_timeout):
            magic, token = _HELLO.unpack(await _recv_exact(stream, _HELLO.size))
        if magic != MAGIC:
            await _send_status(stream, REFUSED, "not a SHARDCAST data channel hello")
            return
        try:
            self.shards.redeem_token(token)
        except SwarmError as exc:
            await _send_status(stream, REFUSED, str(exc))
            return
        await stream.send_all(bytes([OK]))
        while True:
            with trio.fail_after(self.config.idle_timeout):
                first = await stream.receive_some(_REQUEST.size)
                if not first:
                    return
                head = first + await _recv_exact(stream, _REQUEST.size - len(first))
            version, index, offset, length = _REQUEST.unpack(head)
            try:
                span = self.shards.span(version, index, offset, length)
                self.shards.take_slot()
            except PeerBusy as exc:
                await _send_status(stream, BUSY, str(exc))
                continue
            except ShardNotHeld as exc:
                await _send_status(stream, NOT_HELD, str(exc))
                continue
            except SwarmError as exc:
                await _send_status(stream, REFUSED, str(exc))
                continue
            try:
                self.shards.grant(version, index, offset)
            except SwarmError as exc:
                self.shards.release_slot()
                elsewhere = isinstance(exc, ShardElsewhere)
                await _send_status(stream, ELSEWHERE if elsewhere else REFUSED, str(exc))
                continue
            try:
                await stream.send_all(bytes([OK]) + _LENGTH.pack(span.length))
                with trio.fail_after(self.config.send_timeout):
                    await self._sendfile(stream, span.fd, span.offset, span.length)
            finally:
                self.shards.release_slot()
            self.shards.served_bytes += span.length
            self.shards.served_shards += 1

    async def _sendfile(self, stream: trio.SocketStream, fd: int, offset: int, length: int) -> None:
        sock = stream.socket
        out = sock.fileno()
        while length > 0:
            chunk = min(length, self.config.chunk)
            if self._bucket is not None:
                chunk = await self._bucket.take(chunk)
            await trio.lowlevel.wait_writable(out)
            try:
                sent = os.sendfile(out, fd, offset, chunk)
            except BlockingIOError:
                if self._bucket is not None:
                    self._bucket._tokens += chunk  # give back what was not sent
                continue
            if sent == 0:
                raise StorageError("the shard file ended early; it was truncated on disk")
            if self._bucket is not None and sent < chunk:
                self._bucket._tokens += chunk - sent
            offset += sent
            length -= sent


async def _recv_exact(stream: trio.SocketStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise PeerError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def _send_status(stream: trio.SocketStream, status: int, reason: str) -> None:
    data = reason.encode()[:1000]
    await stream.send_all(bytes([status]) + _REASON.pack(len(data)) + data)


# --- client ---------------------------------------------------------------------------------

Negotiate = Callable[[str], Awaitable[tuple[str, int, bytes]]]
"""``negotiate(peer) -> (host, port, token)``: asks the peer (over libp2p) for a channel."""


class _Conn:
    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock

    async def recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = await self.sock.recv(n - len(buf))
            if not chunk:
                raise PeerError(f"data channel closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    async def status(self) -> None:
        status = (await self.recv_exact(1))[0]
        if status == OK:
            return
        (n,) = _REASON.unpack(await self.recv_exact(_REASON.size))
        reason = (await self.recv_exact(n)).decode("utf-8", "replace")
        if status == NOT_HELD:
            raise ShardNotHeld(reason)
        if status == BUSY:
            raise PeerBusy(reason)
        if status == ELSEWHERE:
            raise ShardElsewhere(reason)
        raise PeerError(f"data channel refused: {reason}")

    async def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[await self.sock.send(view) :]

    def close(self) -> None:
        self.sock.close()


class ControlSource(Protocol):
    """The part of a ``ShardSource`` that answers small questions (manifest, holdings)."""

    async def manifest(self, peer: str, version: int | None) -> bytes: ...

    async def have(
        self, peer: str, version: int, known: int = -1, wait: float = 0.0
    ) -> bytes | None: ...


class DataChannelSource:
    """A ``ShardSource`` whose shard bytes come over data channels.

    ``negotiate`` gets an address and token per connection; ``manifest`` and ``have`` go to
    ``control`` (a source that speaks libp2p streams, or a test double). Idle connections are
    kept per peer and reused.
    """

    def __init__(
        self, negotiate: Negotiate, control: ControlSource, *, connect_timeout: float = 5.0
    ) -> None:
        self._negotiate = negotiate
        self._control = control
        self._idle: dict[str, list[_Conn]] = {}
        self.connect_timeout = connect_timeout
        self.connects = 0

    async def manifest(self, peer: str, version: int | None) -> bytes:
        return await self._control.manifest(peer, version)

    async def have(
        self, peer: str, version: int, known: int = -1, wait: float = 0.0
    ) -> bytes | None:
        return await self._control.have(peer, version, known, wait)

    async def _connect(self, peer: str) -> _Conn:
        pool = self._idle.get(peer)
        if pool:
            return pool.pop()
        host, port, token = await self._negotiate(peer)
        sock = trio.socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            with trio.fail_after(self.connect_timeout):
                await sock.connect((host, port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            await conn.send_all(_HELLO.pack(MAGIC, token))
            with trio.fail_after(self.connect_timeout):
                await conn.status()
        except trio.TooSlowError as exc:
            sock.close()
            raise RequestTimeout(f"data channel {host}:{port} of {peer} did not answer") from exc
        except OSError as exc:
            sock.close()
            raise NetworkError(f"cannot reach data channel {host}:{port} of {peer}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        self.connects += 1
        return conn

    async def pull(self, peer: str, version: int, index: int, sink: ShardSink) -> None:
        conn = await self._connect(peer)
        reusable = False
        try:
            await conn.send_all(_REQUEST.pack(version, index, 0, sink.length))
            await conn.status()
            (length,) = _LENGTH.unpack(await conn.recv_exact(_LENGTH.size))
            if length != sink.length:
                raise PeerError(f"peer announced {length} bytes for a shard of {sink.length}")
            buf = bytearray(min(_RECV_CHUNK, max(1, length)))
            view = memoryview(buf)
            left = length
            while left > 0:
                n = await conn.sock.recv_into(view, min(left, len(buf)))
                if n == 0:
                    return  # truncated: the scheduler sees fewer bytes than the shard holds
                sink.write(view[:n])
                left -= n
            reusable = True
        except (ShardNotHeld, PeerBusy):
            reusable = True
            raise
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise StorageError(str(exc)) from exc
            raise NetworkError(f"data channel to {peer} failed: {exc}") from exc
        finally:
            if reusable:
                self._idle.setdefault(peer, []).append(conn)
            else:
                conn.close()

    def close(self) -> None:
        for pool in self._idle.values():
            for conn in pool:
                conn.close()
        self._idle.clear()

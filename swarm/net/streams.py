"""Request/response over libp2p streams, with a size limit and a deadline on every request.

Framing, both directions: a 4-byte big-endian length, then that many bytes. A response starts
with a status byte: 0 = ok (the rest is the answer), 1 = refused (the rest is a UTF-8 reason).
A server bounds how many requests it serves at once; past that it resets new streams at once
(or, with ``StreamLimits.shed_answer``, refuses them unread with that reason) rather than
queueing them, so a peer opening streams in a loop cannot pile up work. The bounds
are per peer as well as global (``StreamLimits.per_peer``), so one peer cannot hold every slot;
and ``StreamLimits.reserved`` more slots open only to peers the server's ``trusted`` predicate
accepts (a validator trusts workers with accepted work), so a flood of fresh identities that
fills the shared slots competes only with itself.

Later protocols (``/swarm-node/<run>/manifest/1``, ``/shard/1``, ``/submit/1``,
``/ledger-sync/1``) are a handler plus limits on top of ``serve`` and ``request``.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from swarm.errors import NetworkError, PeerError, PeerUnreachable, RequestTimeout, SwarmError
from swarm.net.host import check_peer_id

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
OK, REFUSED = 0, 1

Handler = Callable[[str, bytes], Awaitable[bytes]]
"""``handler(peer_id, request) -> response``; raise a ``SwarmError`` to refuse with its text."""


@dataclass(frozen=True, slots=True)
class StreamLimits:
    max_request: int = 64 * 1024
    max_response: int = 64 * 1024
    timeout: float = 10.0
    concurrency: int = 16
    per_peer: int = 0
    """Requests served at once for one peer (0: only the global ``concurrency`` bounds it)."""
    reserved: int = 0
    """Slots past ``concurrency`` for peers that ``StreamServer.trusted`` accepts."""
    shed_answer: str = ""
    """What a stream past the slots is told (a refusal with this reason, unread; the asker
    then knows it is not at fault) instead of a reset. Empty: reset. A reset reached the
    asker as "failed to open a stream", a fault, and at N = 100 receivers spent their failure
    budget for the trainer on its full slots (docs/BENCHMARKS.md, Scale)."""


async def _read_exact(stream: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.read(n - len(buf))
        if not chunk:
            raise PeerError(f"stream closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def read_frame(stream: Any, limit: int) -> bytes:
    """One length-prefixed frame; ``PeerError`` if it announces more than ``limit`` bytes."""
    (length,) = _LEN.unpack(await _read_exact(stream, _LEN.size))
    if length > limit:
        raise PeerError(f"peer sent a frame of {length} bytes; the limit is {limit}")
    return await _read_exact(stream, length)


async def write_frame(stream: Any, data: bytes) -> None:
    await stream.write(_LEN.pack(len(data)) + data)


async def request(
    host: Any, peer_id: str, protocol: str, payload: bytes, limits: StreamLimits = StreamLimits()
) -> bytes:
    """Send one request and return the answer.

    Raises ``RequestTimeout`` past ``limits.timeout``, ``PeerError`` for an oversize or refused
    answer, ``PeerUnreachable`` when no stream can be opened. Cancellation closes the stream.
    """
    if len(payload) > limits.max_request:
        raise PeerError(f"request of {len(payload)} bytes is over the limit {limits.max_request}")
    peer = check_peer_id(peer_id)
    stream = None
    try:
        with trio.fail_after(limits.timeout):
            try:
                stream = await host.new_stream(peer, [protocol])
            except Exception as exc:
                raise PeerUnreachable(f"cannot open {protocol} to {peer_id}: {_why(exc)}") from exc
            try:
                await write_frame(stream, payload)
                answer = await read_frame(stream, limits.max_response + 1)
            except SwarmError:
                raise
            except Exception as exc:
                raise NetworkError(f"{protocol} to {peer_id} failed: {exc}") from exc
    except trio.TooSlowError as exc:
        raise RequestTimeout(
            f"{peer_id} did not answer {protocol} within {limits.timeout:g} s"
        ) from exc
    finally:
        if stream is not None:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                with contextlib.suppress(Exception):
                    await stream.close()
    if not answer:
        raise PeerError(f"{peer_id} sent an empty answer on {protocol}")
    if answer[0] == REFUSED:
        reason = answer[1:].decode("utf-8", "replace")[:500]
        raise PeerError(f"{peer_id} refused {protocol}: {reason}")
    if answer[0] != OK:
        raise PeerError(f"{peer_id} sent an unknown status {answer[0]} on {protocol}")
    return answer[1:]


class StreamServer:
    """Serves one request/response protocol on a host; counts what it served and refused."""

    def __init__(self, protocol: str, handler: Handler, limits: StreamLimits) -> None:
        self.protocol = protocol
        self.handler = handler
        self.limits = limits
        self._limiter = trio.CapacityLimiter(limits.concurrency)
        self._reserved = trio.CapacityLimiter(limits.reserved) if limits.reserved > 0 else None
        self._active: dict[str, int] = {}
        self.trusted: Callable[[str], bool] | None = None
        """Peers that may use the ``reserved`` slots (None: nobody)."""
        self.served = 0
        self.refused = 0
        self.shed = 0

    def _admit(self, peer: str) -> trio.CapacityLimiter | None:
        """The limiter whose slot this stream holds, or None to shed it."""
        if self.limits.per_peer and self._active.get(peer, 0) >= self.limits.per_peer:
            return None
        for limiter in (self._limiter, self._reserved):
            if limiter is None:
                continue
            if limiter is self._reserved and (self.trusted is None or not self.trusted(peer)):
                continue
            try:
                limiter.acquire_nowait()
            except trio.WouldBlock:
                continue
            return limiter
        return None

    async def __call__(self, stream: Any) -> None:
        peer = str(stream.muxed_conn.peer_id)
        limiter = self._admit(peer)
        if limiter is None:
            self.shed += 1
            if not self.limits.shed_answer:
                await _reset(stream)
                return
            with trio.move_on_after(1) as late:  # a moment's work, never a slot's worth
                try:
                    await write_frame(stream, bytes([REFUSED]) + self.limits.shed_answer.encode())
                    await stream.close()
                except Exception:
                    await _reset(stream)
            if late.cancelled_caught:
                await _reset(stream)
            return
        self._active[peer] = self._active.get(peer, 0) + 1
        try:
            await self._serve(stream)
        finally:
            limiter.release()
            self._active[peer] -= 1
            if not self._active[peer]:
                del self._active[peer]

    async def _serve(self, stream: Any) -> None:
        peer = str(stream.muxed_conn.peer_id)
        try:
            with trio.fail_after(self.limits.timeout):
                body = await read_frame(stream, self.limits.max_request)
                try:
                    answer = bytes([OK]) + await self.handler(peer, body)
                    if len(answer) > self.limits.max_response + 1:
                        raise PeerError("answer over the protocol's response limit")
                    self.served += 1
                except SwarmError as exc:
                    answer = bytes([REFUSED]) + str(exc).encode()[:1000]
                    self.refused += 1
                await write_frame(stream, answer)
            await stream.close()
        except trio.TooSlowError:
            self.refused += 1
            await _reset(stream)
        except Exception as exc:
            self.refused += 1
            log.debug("%s from %s failed: %s", self.protocol, peer, exc)
            await _reset(stream)


async def _reset(stream: Any) -> None:
    with contextlib.suppress(Exception):
        await stream.reset()


def serve(host: Any, protocol: str, handler: Handler, limits: StreamLimits) -> StreamServer:
    """Register ``handler`` for ``protocol`` on ``host``; returns the server (for its counts)."""
    server = StreamServer(protocol, handler, limits)
    host.set_stream_handler(protocol, server)
    return server


def _why(exc: BaseException) -> str:
    """The error, or in place of py-libp2p's "unable to connect to ..., no addresses
    established a successful connection (with exceptions)", the root error of each address it
    tried (the ``MultiError`` it raises from, ``errors``): "Maximum connections limit reached"
    on either side, a refused port."""
    cause: BaseException | None = exc
    for _ in range(4):  # new_stream's error, from the dial's, from the MultiError
        errors = getattr(cause, "errors", None)
        if isinstance(errors, list | tuple) and errors:
            roots = dict.fromkeys(_root(e)[:160] for e in errors if isinstance(e, BaseException))
            return "; ".join(list(roots)[:3]) or str(exc)
        cause = cause.__cause__ if cause is not None else None
    return str(exc)


def _root(exc: BaseException) -> str:
    """The innermost error behind ``exc`` that says something."""
    text = str(exc)
    inner = exc.__cause__ or exc.__context__
    for _ in range(6):
        if inner is None:
            break
        text = str(inner) or text
        inner = inner.__cause__ or inner.__context__
    return text

"""The local admin endpoint: a Unix socket in the node's home, one JSON request per line.

Requests are ``{"cmd": "status"}`` or ``{"cmd": "announce", "version": V, "manifest": HEX}``;
every answer is one JSON line ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. Only
the home's owner can open the socket (mode 0600). Requests are bounded (64 KiB, 5 s) and a few
connections are served at once, so a stuck client cannot stall the node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket as pysocket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from swarm.errors import NetworkError, RequestTimeout, SwarmError

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024
MAX_ANSWER = 4 * 1024 * 1024
SOCKET_NAME = "admin.sock"

Command = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def socket_path(home: Path) -> Path:
    return home / SOCKET_NAME


async def _read_line(stream: trio.abc.ReceiveStream, limit: int) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = await stream.receive_some(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise NetworkError(f"admin message over {limit} bytes")
    return bytes(buf.split(b"\n", 1)[0])


async def serve_admin(
    path: Path,
    commands: dict[str, Command],
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,  # trio.TaskStatus (absent in trio-stubs)
) -> None:
    """Serve ``commands`` on a Unix socket at ``path`` until cancelled; removes the socket file
    on exit (if it is still ours). A stale socket file from a crashed node is replaced."""
    if path.exists():
        path.unlink()
    sock = trio.socket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        await sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(16)
        mine = path.stat().st_ino
    except OSError as exc:
        sock.close()
        raise NetworkError(f"cannot open the admin socket {path}: {exc.strerror or exc}") from exc
    listener = trio.SocketListener(sock)
    limiter = trio.CapacityLimiter(8)

    async def handle(stream: trio.SocketStream) -> None:
        async with stream, limiter:
            try:
                with trio.fail_after(5):
                    line = await _read_line(stream, MAX_REQUEST)
                    request = json.loads(line or b"{}")
                    if not isinstance(request, dict):
                        raise ValueError("request is not a JSON object")
                    command = commands.get(str(request.get("cmd")))
                    if command is None:
                        answer = {"ok": False, "error": f"unknown command {request.get('cmd')!r}"}
                    else:
                        answer = {"ok": True, **await command(request)}
            except SwarmError as exc:
                answer = {"ok": False, "error": str(exc)}
            except (ValueError, trio.TooSlowError) as exc:
                answer = {"ok": False, "error": f"bad admin request: {exc}"}
            except Exception as exc:  # never let one request take the node down
                log.exception("admin command failed")
                answer = {"ok": False, "error": f"internal error: {exc}"}
            try:
                with trio.move_on_after(5):
                    await stream.send_all(json.dumps(answer).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    try:
        async with listener:
            task_status.started()
            async with trio.open_nursery() as nursery:
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(handle, stream)
    finally:
        # Only our own socket: a home deleted and made again may hold another node's by now.
        with contextlib.suppress(OSError):
            if path.stat().st_ino == mine:
                path.unlink()


async def query(path: Path, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send one request to a node's admin socket and return its answer.

    ``NetworkError`` when no node listens there, ``RequestTimeout`` past ``timeout``.
    """
    if not path.exists():
        raise NetworkError(f"no node is running with home {path.parent} (no {path.name})")
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_unix_socket(str(path))
            async with stream:
                await stream.send_all(json.dumps(request).encode() + b"\n")
                line = await _read_line(stream, MAX_ANSWER)
    except trio.TooSlowError as exc:
        raise RequestTimeout(f"the node at {path.parent} did not answer in {timeout:g} s") from exc
    except OSError as exc:
        raise NetworkError(
            f"no node answers at {path} ({exc.strerror or exc}); is `swarm-node join` running?"
        ) from exc
    try:
        answer = json.loads(line)
    except ValueError as exc:
        raise NetworkError(f"the node at {path.parent} sent a malformed answer") from exc
    if not isinstance(answer, dict):
        raise NetworkError(f"the node at {path.parent} sent a malformed answer")
    if not answer.get("ok"):
        raise SwarmError(str(answer.get("error", "the node refused the request")))
    return answer


def read_status(home: Path) -> dict[str, Any] | None:
    """The node's ``status`` over its admin socket, from outside an event loop; ``None`` when it
    does not answer (not started yet, or gone)."""
    try:
        answer = trio.run(query, socket_path(home), {"cmd": "status"})
    except Exception:
        return None
    status: dict[str, Any] = answer["status"]
    return status

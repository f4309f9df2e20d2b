"""Dial the bootstrap peers: all at once, retrying each with backoff, succeeding with any.

py-libp2p's own bootstrap discovery only logs failures; a user needs to know per address why it
failed, so each attempt first opens a plain TCP connection (refused? timeout?) and then lets
libp2p dial and run the Noise handshake, which fails when the peer there has another peer ID.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from swarm.errors import BootstrapError, ConfigError
from swarm.net.host import parse_peer_addr, unblock

log = logging.getLogger(__name__)

_AFTER_SUCCESS = 3


@dataclass(frozen=True, slots=True)
class DialPolicy:
    """How hard to try: ``attempts`` per address (``math.inf`` keeps trying), a per-attempt
    ``timeout`` (s) and exponential backoff from ``backoff`` up to ``max_backoff`` seconds."""

    attempts: float = 3
    timeout: float = 5.0
    backoff: float = 0.5
    max_backoff: float = 30.0


@dataclass
class DialReport:
    """What happened per address: who answered, why the others failed, how often we tried."""

    connected: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return "; ".join(f"{addr} ({why})" for addr, why in self.failures.items())


def _tcp_target(info: Any) -> tuple[str, int] | None:
    for addr in info.addrs:
        host = None
        for proto in ("ip4", "ip6", "dns4", "dns6", "dns"):
            try:
                host = addr.value_for_protocol(proto)
            except Exception:
                continue
            if host:
                break
        try:
            port = addr.value_for_protocol("tcp")
        except Exception:
            port = None
        if host and port:
            return host, int(port)
    return None


def _chain_text(exc: BaseException) -> str:
    parts: list[str] = []
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack and len(parts) < 32:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        stack.extend(getattr(e, "exceptions", ()) or ())  # ExceptionGroup
        errors = getattr(e, "errors", ())  # py-libp2p's MultiError keeps its list here
        if isinstance(errors, (list, tuple)):
            stack.extend(x for x in errors if isinstance(x, BaseException))
    return " | ".join(parts)


async def _probe_tcp(target: tuple[str, int], timeout: float) -> str | None:
    """``None`` when something accepts TCP connections there, else why not."""
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(*target)
    except trio.TooSlowError:
        return f"timeout after {timeout:g} s"
    except OSError as exc:
        # trio reports "all attempts to connect failed" with the per-address OSErrors in an
        # ExceptionGroup as the cause; the first real errno among them says why.
        causes = [exc]
        if isinstance(exc.__cause__, BaseExceptionGroup):
            causes += [e for e in exc.__cause__.exceptions if isinstance(e, OSError)]
        elif isinstance(exc.__cause__, OSError):
            causes.append(exc.__cause__)
        codes = {e.errno for e in causes if e.errno is not None}
        if errno.ECONNREFUSED in codes or any("refused" in str(e).lower() for e in causes):
            return "connection refused"
        if codes & {errno.ETIMEDOUT}:
            return f"timeout after {timeout:g} s"
        detail = next((e.strerror for e in causes if e.strerror), None) or str(exc)
        return f"unreachable ({detail})"
    await stream.aclose()
    return None


SLOW_HANDSHAKE = "in the libp2p handshake"
"""How ``dial_once``'s reason ends when TCP connected but the libp2p handshake timed out."""


async def dial_once(host: Any, addr: str, timeout: float) -> str | None:
    """One attempt at ``addr``: ``None`` when connected, else a short reason."""
    info = parse_peer_addr(addr)
    target = _tcp_target(info)
    if target is not None:
        why = await _probe_tcp(target, timeout)
        if why is not None:
            return why
    unblock(host, info.peer_id)  # our backoff decides when to retry, not its cache
    # py-libp2p dials one address per transport class (``Swarm.dial_peer``: TCP's first in the
    # peerstore), so an address kept from a peer's previous life shadowed ``addr``: a node
    # restarted on a new port was dialed at its old one, "connection refused", and every
    # dial-back called it private (docs/RELIABILITY.md). This attempt is at ``addr`` alone.
    with contextlib.suppress(Exception):
        host.get_peerstore().clear_addrs(info.peer_id)
    try:
        with trio.fail_after(timeout):
            await host.connect(info)
    except trio.TooSlowError:
        return f"timeout after {timeout:g} s {SLOW_HANDSHAKE}"
    except Exception as exc:
        text = _chain_text(exc)
        if "PeerIDMismatch" in text or "mismatch" in text.lower():
            return "wrong peer ID (a different peer answers at that address)"
        if "refused" in text.lower():
            return "connection refused"
        return f"libp2p handshake failed ({text[:160]})"
    return None


async def dial_bootstrap(
    host: Any,
    addrs: Sequence[str],
    policy: DialPolicy = DialPolicy(),
    report: DialReport | None = None,
) -> DialReport:
    """Dial every address concurrently with retries; ``BootstrapError`` when none connects.

    Malformed addresses raise ``ConfigError`` before anything is dialed. With
    ``policy.attempts == math.inf`` this only returns once some peer answered. ``report``
    (when given) is filled in place, so a caller can see the attempts after a
    ``BootstrapError`` too.
    """
    if not addrs:
        raise ConfigError("no bootstrap peers given")
    for addr in addrs:
        parse_peer_addr(addr)
    report = DialReport() if report is None else report

    async def one(addr: str) -> None:
        attempt, delay = 0, policy.backoff
        while True:
            attempt += 1
            report.attempts[addr] = attempt
            why = await dial_once(host, addr, policy.timeout)
            if why is None:
                report.connected.append(addr)
                report.failures.pop(addr, None)
                log.info("connected to bootstrap peer %s", addr)
                return
            report.failures[addr] = why
            # With --wait, keep trying only until some other bootstrap peer has answered.
            if attempt >= policy.attempts or (report.connected and attempt >= _AFTER_SUCCESS):
                log.warning("bootstrap peer %s failed %d times: %s", addr, attempt, why)
                return
            log.info("bootstrap peer %s: %s; retrying in %.1f s", addr, why, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, policy.max_backoff)

    async with trio.open_nursery() as nursery:
        for addr in dict.fromkeys(addrs):
            nursery.start_soon(one, addr)
    if not report.connected:
        raise BootstrapError(
            f"no bootstrap peer answered: {report.summary()}; check the addresses, pass"
            " --bootstrap, or use --wait to keep trying"
        )
    return report


__all__ = ["DialPolicy", "DialReport", "dial_bootstrap", "dial_once"]

"""Serving the dashboard inside the node's trio event loop: Hypercorn's trio worker.

Decisions this module owns:
- **Same loop, same nursery.** ``serve_dashboard`` runs Hypercorn (``hypercorn.trio.serve``)
  and the view's holder lookups as tasks of the caller's nursery; cancelling the nursery stops
  both (open streams are cut, the socket is closed). No thread, no second process.
- **Bound to 127.0.0.1 unless told.** ``--http PORT`` listens on 127.0.0.1; another address
  only when one is given (``--http 0.0.0.0:8080``). Port 0 picks a free port; the URL actually
  bound is what ``nursery.start`` returns and what the CLI prints.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from node.web.app import create_app
from node.web.views import RunView
from swarm.errors import ConfigError, NetworkError

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"


def parse_http(value: str) -> tuple[str, int]:
    """``PORT``, ``ADDR:PORT`` or ``[V6]:PORT`` -> (host, port); ``ConfigError`` otherwise."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = DEFAULT_HOST, text
    host = host.strip("[]") or DEFAULT_HOST
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"--http {value[:60]!r}: give PORT or ADDR:PORT (for example 127.0.0.1:8080)"
        )
    return host, int(port)


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_dashboard(
    view: RunView,
    host: str,
    port: int,
    *,
    tick_s: float = 1.0,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``view``'s dashboard on ``host:port`` until cancelled; ``task_status.started``
    gets the page's URL. ``NetworkError`` when the address cannot be bound."""
    config = Config()
    config.bind = [_bind(host, port)]
    config.accesslog = None
    config.errorlog = log
    config.graceful_timeout = 1.0
    config.include_server_header = False
    app = create_app(view, tick_s=tick_s)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(view.holders.run)
        try:
            binds = await nursery.start(serve, app, config)
        except OSError as exc:
            raise NetworkError(
                f"cannot serve the dashboard on {host}:{port}: {exc.strerror or exc};"
                " choose another --http port"
            ) from exc
        url = str(binds[0]).rstrip("/") + "/"
        log.info("dashboard at %s", url)
        task_status.started(url)


async def start_dashboard(nursery: trio.Nursery, view: RunView, http: str) -> str:
    """Parse ``--http`` and serve ``view`` in ``nursery``; returns the page's URL."""
    host, port = parse_http(http)
    url: str = await nursery.start(serve_dashboard, view, host, port)
    return url

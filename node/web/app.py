"""The dashboard's ASGI app (Starlette): the page, its static files and JSON under ``/api/v1/``.

Decisions this module owns:
- **Read-only.** Only GET (and HEAD) routes exist; anything else is 405.
- **Versioned JSON** (``API_VERSION``), documented in ``docs/dashboard.md``. Lists are pages:
  ``{"items": [...], "next_cursor": str | null}``; ``limit`` is clamped to ``1..MAX_LIMIT``; a
  cursor is opaque (pass back what you got). Bad parameters answer 400 with ``{"error": ...}``.
- **Live updates by server-sent events** (``/api/v1/stream``): one ``Pulse`` task per app
  compares a small digest (policy version, ledger change key, peers) every ``tick_s`` and wakes
  every stream when it moved; a client then re-reads the pages it shows. Watchers share the
  pulse, so ten of them cost ten small writes per change, not ten ledger scans. At most
  ``MAX_STREAMS`` streams at once (503 beyond).
- **Inert peer text.** Everything from peers is JSON data, served as ``application/json`` with
  ``nosniff``; the page puts it on screen with ``textContent`` only; a strict
  Content-Security-Policy allows scripts from this origin alone.
- Ledger reads run in worker threads (``LedgerQueries``), never on the event loop.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from node.web.queries import SORT_KEYS, LedgerQueries, clamp_limit
from node.web.views import RunView
from swarm.errors import SwarmError

API_VERSION = 1
MAX_STREAMS = 64
SMOOTH_WINDOW = 5
HEARTBEAT_S = 15.0

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
EVAL_ABSENT = (
    "no held-out evaluation is held here yet (the run's genesis sets eval_every; 0 = none);"
    " the reward curve is the mean verifier reward of accepted samples"
)


class BadRequest(Exception):
    pass


def _int(request: Request, name: str) -> int | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise BadRequest(f"{name} must be an integer, not {value[:40]!r}") from exc


def smoothed(values: list[float | None], window: int = SMOOTH_WINDOW) -> list[float | None]:
    """Trailing mean over the last ``window`` known values."""
    out: list[float | None] = []
    recent: list[float] = []
    for v in values:
        if v is not None:
            recent = [*recent[-(window - 1) :], v]
        out.append(sum(recent) / len(recent) if recent else None)
    return out


class Pulse:
    """Wakes every live stream when the node's digest changed (see the module docstring)."""

    def __init__(self, digest: Callable[[], Awaitable[dict[str, Any]]], tick_s: float) -> None:
        self.digest = digest
        self.tick_s = tick_s
        self.seq = 0
        self.payload: dict[str, Any] = {}
        self.streams = 0
        self._changed = anyio.Event()

    async def run(self) -> None:
        while True:
            try:
                payload = await self.digest()
            except SwarmError:
                payload = self.payload
            if payload != self.payload:
                self.seq += 1
                self.payload = payload
                self._changed.set()
                self._changed = anyio.Event()
            await anyio.sleep(self.tick_s)

    async def wait(self, seen: int, timeout: float) -> None:
        if self.seq != seen:
            return
        with anyio.move_on_after(timeout):
            await self._changed.wait()


def create_app(view: RunView, *, tick_s: float = 1.0) -> Starlette:
    """The dashboard of ``view``'s node."""

    def ledger() -> LedgerQueries:
        if view.queries is None:
            raise LookupError("this node keeps no ledger of the run")
        return view.queries

    async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    async def digest() -> dict[str, Any]:
        key = await in_thread(view.queries.change_key) if view.queries else (0, 0)
        return {
            "policy_version": view.policy.newest(),
            "ledger_key": list(key),
            "holders": sum(len(h) for h in view.holders.holders.values()),
            "evaluations": len(await in_thread(view.evaluations)),
        }

    pulse = Pulse(digest, tick_s)

    async def status(request: Request) -> dict[str, Any]:
        g = view.genesis.message
        totals = await in_thread(view.queries.totals) if view.queries else None
        return {
            "api_version": API_VERSION,
            "run": {
                "run_id": view.run_id,
                "name": g.name,
                "model": g.model.name,
                "trainers": list(g.trainers),
                "validators": list(g.validators),
                "initial_balance": g.params.initial_balance,
                "ban_threshold": g.params.ban_threshold,
            },
            "node": view.public_status(),
            "policy_version": view.policy.newest(),
            "ledger": totals,
            "server_time_ms": int(time.time() * 1000),
        }

    async def versions(request: Request) -> dict[str, Any]:
        limit = clamp_limit(_int(request, "limit"))
        items = view.policy.page(limit, _int(request, "cursor"))
        items = [i | {"holders": view.holders.holders.get(i["version"])} for i in items]
        more = len(items) == limit and items[-1]["version"] > 0
        return {"items": items, "next_cursor": str(items[-1]["version"]) if more else None}

    async def rewards(request: Request) -> dict[str, Any]:
        limit = clamp_limit(_int(request, "limit"))
        before = _int(request, "cursor")
        rows = await in_thread(ledger().rewards_by_version)
        smooth = smoothed([r["mean_reward"] for r in rows])
        rows = [r | {"smoothed": s} for r, s in zip(rows, smooth, strict=True)]
        if before is not None:
            rows = [r for r in rows if r["version"] < before]
        page = rows[-limit:][::-1]
        more = len(rows) > limit
        return {
            "items": page,
            "next_cursor": str(page[-1]["version"]) if more and page else None,
            "smoothing": f"trailing mean over {SMOOTH_WINDOW} versions",
            "eval": await eval_curve(),
        }

    async def eval_curve() -> dict[str, Any]:
        curve = await in_thread(view.evaluations)
        p = view.params
        return {
            "available": bool(curve),
            "items": curve,
            "eval_every": p.eval_every,
            "eval_size": p.eval_size,
            "reason": None if curve else EVAL_ABSENT,
        }

    async def evaluations(request: Request) -> dict[str, Any]:
        return await eval_curve()

    async def contributors(request: Request) -> dict[str, Any]:
        sort = request.query_params.get("sort", "balance")
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest(f"order must be asc or desc, not {order[:20]!r}")
        if sort not in SORT_KEYS:
            raise BadRequest(f"sort must be one of {', '.join(SORT_KEYS)}")
        return await in_thread(  # type: ignore[no-any-return]
            ledger().contributors,
            roles=view.roles(),
            live_seen_ms=view.live_seen_ms(),
            limit=_int(request, "limit"),
            cursor=request.query_params.get("cursor"),
            sort=sort,
            descending=order == "desc",
            search=request.query_params.get("search", "")[:128],
        )

    async def slashes(request: Request) -> dict[str, Any]:
        page = await in_thread(
            ledger().slashes,
            limit=_int(request, "limit"),
            cursor=request.query_params.get("cursor"),
        )
        for item in page["items"]:
            worker = quote(item["peer"], safe="")
            item["bundle_url"] = f"/api/v1/bundles/{item['evidence']}?worker={worker}"
        return page  # type: ignore[no-any-return]

    async def disputes(request: Request) -> dict[str, Any]:
        return await in_thread(  # type: ignore[no-any-return]
            ledger().disputes,
            limit=_int(request, "limit"),
            cursor=request.query_params.get("cursor"),
        )

    async def training_disputes(request: Request) -> dict[str, Any]:
        items = await in_thread(view.training_disputes)
        return {"items": items}

    async def ledger_page(request: Request) -> dict[str, Any]:
        return await in_thread(  # type: ignore[no-any-return]
            ledger().ledger_page,
            limit=_int(request, "limit"),
            cursor=request.query_params.get("cursor"),
            peer=request.query_params.get("peer") or None,
            event=request.query_params.get("event") or None,
        )

    async def shardcast(request: Request) -> dict[str, Any]:
        view.holders.note_progress()
        holders = view.holders.holders
        node = view.public_status()
        served = (node.get("role_status") or {}).get("shardcast") or {}
        return {
            "holders": [{"version": v, "peers": holders[v]} for v in sorted(holders, reverse=True)],
            "downloads": [
                view.holders.downloads[v] for v in sorted(view.holders.downloads, reverse=True)
            ],
            "served_bytes": served.get("served_bytes"),
            "served_shards": served.get("served_shards"),
            # Bytes per version this node moved (a patch against the full size) and saved.
            "transfers": served.get("transfers"),
        }

    async def bundle(request: Request) -> Response:
        text = request.path_params["verdict"]
        try:
            subject = bytes.fromhex(text)
        except ValueError:
            subject = b""
        if len(subject) != 32:
            raise BadRequest("a verdict id is 64 hex characters")
        worker = request.query_params.get("worker", "")
        data = await view.bundle(worker, subject)
        if data is None:
            return JSONResponse(
                {"error": "no node reachable from here holds the evidence of this verdict"},
                status_code=404,
            )
        return Response(
            data,
            media_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="bundle-{text[:16]}.msgpack"'},
        )

    async def stream(request: Request) -> Response:
        if pulse.streams >= MAX_STREAMS:
            return JSONResponse({"error": "too many live viewers; retry later"}, status_code=503)

        async def events() -> AsyncIterator[str]:
            pulse.streams += 1
            try:
                seen = -1
                yield "retry: 2000\n\n"
                while True:
                    await pulse.wait(seen, HEARTBEAT_S)
                    if pulse.seq == seen:
                        yield ": keep-alive\n\n"
                        continue
                    seen = pulse.seq
                    yield f"event: update\ndata: {json.dumps(pulse.payload | {'seq': seen})}\n\n"
            finally:
                pulse.streams -= 1

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
        )

    def api(handler: Callable[[Request], Awaitable[dict[str, Any]]]) -> Callable[..., Any]:
        async def endpoint(request: Request) -> Response:
            return JSONResponse(await handler(request))

        return endpoint

    async def index(request: Request) -> Response:
        return FileResponse(_static_dir() / "index.html", media_type="text/html")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            if view.queries is not None:  # fold the ledger once now, not in the first request
                tg.start_soon(in_thread, view.queries.totals)
            tg.start_soon(pulse.run)
            yield
            tg.cancel_scope.cancel()

    routes = [
        Route("/", index),
        Route("/api/v1/status", api(status)),
        Route("/api/v1/versions", api(versions)),
        Route("/api/v1/rewards", api(rewards)),
        Route("/api/v1/evaluations", api(evaluations)),
        Route("/api/v1/contributors", api(contributors)),
        Route("/api/v1/slashes", api(slashes)),
        Route("/api/v1/disputes", api(disputes)),
        Route("/api/v1/training-disputes", api(training_disputes)),
        Route("/api/v1/ledger", api(ledger_page)),
        Route("/api/v1/shardcast", api(shardcast)),
        Route("/api/v1/bundles/{verdict}", bundle),
        Route("/api/v1/stream", stream),
        Mount("/static", StaticFiles(directory=_static_dir()), name="static"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(_Guard)],
        exception_handlers={
            BadRequest: _bad_request,
            ValueError: _bad_request,
            LookupError: _missing,
        },
    )
    app.state.pulse = pulse
    return app


def _static_dir() -> Path:
    return Path(__file__).with_name("static")


async def _bad_request(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=400)


async def _missing(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc).strip("'\"")}, status_code=404)


SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]


class _Guard:
    """Security headers on every answer (a plain ASGI wrapper: streams pass through as they
    are)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)

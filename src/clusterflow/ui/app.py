"""The dashboard's ASGI app (Starlette): pages, a JSON API, live updates, ``/metrics``.

Pages are rendered by Jinja2 from ``templates/``; their figures then update over
server-sent events (``/api/.../stream``): every ``interval_s`` the stream reads the
cluster as ``describe`` does (in a worker thread, files only) and sends it when it
changed. Charts keep their points in the browser, so the server holds no history.
Access rules live in ``access.py``; what is read, in ``views.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from clusterflow.errors import ClusterflowError
from clusterflow.manager import registry
from clusterflow.ui import pages, views
from clusterflow.ui.access import COOKIE, Access
from clusterflow.ui.data_progress import DataProgress
from clusterflow.ui.metrics import make_registry

log = logging.getLogger(__name__)

__all__ = ["Settings", "make_app"]

HERE: Final = Path(__file__).parent
KEEPALIVE_S: Final = 15.0
"""A comment line this often keeps proxies from closing a quiet stream."""
CHECKPOINTS_EVERY_S: Final = 5.0
"""Checkpoints are listed less often than figures: a listing walks the storage."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """How one dashboard serves."""

    access: Access
    """Its bind address and token."""
    interval_s: float = 1.0
    """Seconds between two reads of a watched cluster: jobs report once a second."""
    stop_grace_s: float = 10.0
    """The stop button's grace period, as ``clusterflow stop``'s default."""


class AccessMiddleware:
    """Refuses what ``Access`` refuses, before any route runs; remembers a URL's token.

    A pure ASGI middleware (not ``BaseHTTPMiddleware``), so event streams pass through
    unbuffered.
    """

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if not self.access.host_allowed(request.headers.get("host")):
            await _plain(403, "refused: this dashboard answers only to a loopback host name")(
                scope, receive, send
            )
            return
        token = self.access.presented(request.headers, request.query_params)
        if not self.access.may_read(token) and not request.url.path.startswith("/static/"):
            message = "refused: this dashboard needs its token (the URL `clusterflow ui` printed)"
            await _plain(401, message)(scope, receive, send)
            return
        scope.setdefault("state", {})["token_ok"] = self.access.valid(token)
        remember = "token" in request.query_params and self.access.valid(token)

        async def send_with_cookie(message: MutableMapping[str, Any]) -> None:
            if remember and message["type"] == "http.response.start":
                cookie = f"{COOKIE}={self.access.token}; Path=/; HttpOnly; SameSite=Strict"
                message.setdefault("headers", []).append((b"set-cookie", cookie.encode()))
            await send(message)

        await self.app(scope, receive, send_with_cookie)


def _plain(code: int, text: str) -> Response:
    return Response(text + "\n", status_code=code, media_type="text/plain")


def make_app(settings: Settings) -> Starlette:
    """The dashboard, ready for uvicorn (``server.serve``) or a test client."""
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    data = DataProgress()
    metrics_registry = make_registry()
    handlers = _Handlers(settings, templates, data)

    async def not_found(request: Request, exc: Exception) -> Response:
        detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
        code = exc.status_code if isinstance(exc, HTTPException) else 404
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": detail}, status_code=code)
        return templates.TemplateResponse(
            request, "error.html", {"code": code, "message": detail}, status_code=code
        )

    async def metrics(request: Request) -> Response:
        body = await anyio.to_thread.run_sync(generate_latest, metrics_registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/", handlers.index),
        Route("/clusters/{cluster_id}", handlers.cluster_page),
        Route("/clusters/{cluster_id}/stop", handlers.stop, methods=["POST"]),
        Route("/api/clusters", handlers.api_clusters),
        Route("/api/clusters/stream", handlers.stream_clusters),
        Route("/api/clusters/{cluster_id}", handlers.api_cluster),
        Route("/api/clusters/{cluster_id}/stream", handlers.stream_cluster),
        Route("/metrics", metrics),
        *pages.routes(templates),
        Mount("/static", app=StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: not_found, views.UnknownCluster: not_found},
        lifespan=_closing(data),
    )
    app.add_middleware(AccessMiddleware, access=settings.access)
    app.state.settings = settings
    return app


def _closing(data: DataProgress) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """The app's lifespan: its RPC clients to managers close when it stops."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            data.close()

    return lifespan


class _Handlers:
    """The cluster routes; each reads in a worker thread, never on the event loop."""

    def __init__(self, settings: Settings, templates: Jinja2Templates, data: DataProgress):
        self.settings = settings
        self.templates = templates
        self.data = data

    def _token(self, request: Request) -> str | None:
        """The token for the page's own actions: only to a request that showed it."""
        return self.settings.access.token if request.state.token_ok else None

    async def index(self, request: Request) -> Response:
        rows = await anyio.to_thread.run_sync(views.cluster_rows)
        return self.templates.TemplateResponse(
            request, "index.html", {"clusters": rows, "token": self._token(request)}
        )

    async def cluster_page(self, request: Request) -> Response:
        cluster_id = request.path_params["cluster_id"]
        detail = await anyio.to_thread.run_sync(self._detail, cluster_id, True)
        return self.templates.TemplateResponse(
            request,
            "cluster.html",
            {
                "c": detail,
                "token": self._token(request),
                "interval_ms": int(self.settings.interval_s * 1000),
            },
        )

    async def api_clusters(self, request: Request) -> Response:
        return JSONResponse(await anyio.to_thread.run_sync(views.cluster_rows))

    async def api_cluster(self, request: Request) -> Response:
        cluster_id = request.path_params["cluster_id"]
        return JSONResponse(await anyio.to_thread.run_sync(self._detail, cluster_id, True))

    def _detail(self, cluster_id: str, with_checkpoints: bool) -> dict[str, Any]:
        cluster = views.find(cluster_id)
        detail = views.cluster_detail(cluster, with_checkpoints=with_checkpoints)
        detail["logs"] = views.log_tails(cluster, [t["task"] for t in detail["tasks"]])
        detail["data"] = self.data.read(cluster, cluster.read_state())
        return detail

    async def stream_clusters(self, request: Request) -> Response:
        return _stream(request, self.settings.interval_s, lambda n: views.cluster_rows())

    async def stream_cluster(self, request: Request) -> Response:
        cluster_id = request.path_params["cluster_id"]
        await anyio.to_thread.run_sync(views.find, cluster_id)  # 404 before the stream
        every = max(1, round(CHECKPOINTS_EVERY_S / self.settings.interval_s))
        listed: list[Any] = []

        def read(n: int) -> dict[str, Any]:
            detail = self._detail(cluster_id, n % every == 0)
            if "checkpoints" in detail:
                listed[:] = [detail["checkpoints"]]
            elif listed:
                detail["checkpoints"] = listed[0]  # the last listing, until the next
            return detail

        return _stream(request, self.settings.interval_s, read)

    async def stop(self, request: Request) -> Response:
        """Stops a cluster as ``clusterflow stop`` does; needs the token in a header.

        Only ``Authorization: Bearer`` counts here, never the cookie: a page of another
        site (or port) can make a browser post with cookies, not with that header.
        """
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if not self.settings.access.may_act(token):
            return JSONResponse(
                {"error": "stopping a cluster needs the dashboard's token"}, status_code=403
            )
        cluster_id = request.path_params["cluster_id"]
        cluster = await anyio.to_thread.run_sync(views.find, cluster_id)
        outcome = await anyio.to_thread.run_sync(_stop, cluster, self.settings.stop_grace_s)
        log.info("cluster %s stopped from the dashboard: %s", cluster_id, outcome)
        return JSONResponse({"cluster": cluster_id, "outcome": outcome})


def _stop(cluster: registry.ClusterDir, grace_s: float) -> str:
    from clusterflow.manager import handle

    return handle.stop(cluster, grace_s)


def _stream(request: Request, interval_s: float, read: Callable[[int], Any]) -> Response:
    """Server-sent events: ``read(n)`` every ``interval_s``, sent when it changed."""

    async def events() -> AsyncIterator[str]:
        last = None
        quiet_since = time.monotonic()
        n = 0
        while not await request.is_disconnected():
            try:
                value = await anyio.to_thread.run_sync(read, n)
            except views.UnknownCluster:
                yield "event: gone\ndata: {}\n\n"
                return
            except ClusterflowError as exc:
                value = {"error": str(exc)}
            text = json.dumps(value, separators=(",", ":"))
            if text != last:
                last, quiet_since = text, time.monotonic()
                yield f"data: {text}\n\n"
            elif time.monotonic() - quiet_since > KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield ": keepalive\n\n"
            n += 1
            await asyncio.sleep(interval_s)

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )

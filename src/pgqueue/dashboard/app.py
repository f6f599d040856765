"""The read-only dashboard as a Starlette app: GET routes, a single refresh loop, SSE push."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from .. import __version__
from ..db import validate_schema
from . import humanize, job_page
from .database import Database
from .metrics import exposition, registry_for
from .refresh import Refresher
from .security import BasicAuth, ReadOnlyMethods, SecurityHeaders

HERE = Path(__file__).parent
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
#: SSE comment lines keep proxies from closing an idle stream.
KEEPALIVE_SECONDS = 15.0
NO_STORE = {"Cache-Control": "no-store"}
log = logging.getLogger("pgqueue.dashboard")


def create_app(
    dsn: str,
    schema: str = "public",
    *,
    refresh_interval: float = 1.0,
    basic_auth: tuple[str, str] | None = None,
    allowed_hosts: Sequence[str] | None = None,
    late_heartbeat_seconds: float = 15.0,
    statement_timeout_ms: int = 5000,
    ready_timeout: float = 2.0,
    long_transaction_seconds: float = 300.0,
    dead_tuple_ratio: float = 0.2,
) -> Starlette:
    """The dashboard app. ``allowed_hosts`` defaults to loopback names (a guard against DNS
    rebinding); ``late_heartbeat_seconds`` is when a worker's heartbeat counts as late;
    ``ready_timeout`` bounds ``/readyz``'s look at the database. The health strip warns of a
    transaction holding back vacuum for ``long_transaction_seconds`` and of dead rows in the
    jobs table past ``dead_tuple_ratio`` of the live ones."""
    schema = validate_schema(schema)
    if not refresh_interval > 0:
        raise ValueError("the refresh interval must be a positive number of seconds")
    if not late_heartbeat_seconds > 0:
        raise ValueError("the late-heartbeat threshold must be a positive number of seconds")
    if not long_transaction_seconds > 0 or not dead_tuple_ratio > 0:
        raise ValueError("the health strip's thresholds must be positive numbers")
    database = Database(dsn, statement_timeout_ms=statement_timeout_ms)
    refresher = Refresher(
        database, schema, interval=refresh_interval, late_after=late_heartbeat_seconds,
        long_transaction=long_transaction_seconds, dead_tuple_ratio=dead_tuple_ratio,
    )  # fmt: skip
    registry = registry_for(refresher)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True, auto_reload=False
    )
    env.globals["humanize"] = humanize
    templates = Jinja2Templates(env=env)

    async def index(request: Request) -> Response:
        return templates.TemplateResponse(
            request, "index.html", {"version": __version__, "interval": refresh_interval},
            headers=NO_STORE,
        )  # fmt: skip

    async def snapshot(request: Request) -> Response:
        if refresher.snapshot is None and refresher.broadcaster.latest is None:
            return JSONResponse({"status": "starting"}, status_code=503, headers=NO_STORE)
        body = refresher.broadcaster.latest or json.dumps(refresher.snapshot).encode()
        return Response(body, media_type="application/json", headers=NO_STORE)

    async def job(request: Request) -> Response:
        job_id = job_page.parse_job_id(request.path_params["job_id"])
        if job_id is None:
            return JSONResponse({"error": "not a job id"}, status_code=400, headers=NO_STORE)
        try:
            async with database.session() as conn:
                found = await job_page.read(conn, schema, job_id, late_after=late_heartbeat_seconds)
        except Exception:
            return JSONResponse(
                {"error": "database unavailable"}, status_code=503, headers=NO_STORE
            )
        if found is None:
            return JSONResponse({"error": "no such job"}, status_code=404, headers=NO_STORE)
        return JSONResponse(job_page.api(found), headers=NO_STORE)

    def job_html(request: Request, status_code: int, **context: Any) -> Response:
        return templates.TemplateResponse(
            request, "job.html", {"version": __version__, **context},
            status_code=status_code, headers=NO_STORE,
        )  # fmt: skip

    async def job_detail(request: Request) -> Response:
        typed = request.path_params["job_id"]
        job_id = job_page.parse_job_id(typed)
        if job_id is None:
            return job_html(request, 400, problem="bad_id", typed=typed)
        try:
            async with database.session() as conn:
                found = await job_page.read(conn, schema, job_id, late_after=late_heartbeat_seconds)
        except Exception as exc:
            log.warning("job %s could not be read: %s", job_id, exc)
            return job_html(request, 503, problem="unavailable", job_id=job_id)
        if found is None:
            return job_html(request, 404, problem="not_found", job_id=job_id)
        return job_html(request, 200, job=found, job_id=job_id)

    async def job_search(request: Request) -> Response:
        """The header's search box: a plain GET form, so it works without the script."""
        typed = request.query_params.get("id", "")
        job_id = job_page.parse_job_id(typed)
        if job_id is None:
            return job_html(request, 400, problem="bad_id", typed=typed)
        url = request.url_for("job_detail", job_id=str(job_id))
        return RedirectResponse(url.path, status_code=303, headers=NO_STORE)

    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[bytes]:
            broadcaster = refresher.broadcaster
            broadcaster.listeners += 1
            try:
                yield b"retry: 2000\n\n"
                seq = 0
                while True:
                    seq, payload = await broadcaster.next(seq, KEEPALIVE_SECONDS)
                    yield b": keepalive\n\n" if payload is None else b"data: " + payload + b"\n\n"
            finally:
                broadcaster.listeners -= 1

        return StreamingResponse(
            stream(), media_type="text/event-stream",
            headers={**NO_STORE, "X-Accel-Buffering": "no"},
        )  # fmt: skip

    async def metrics(request: Request) -> Response:
        return Response(
            exposition(registry), media_type="text/plain; version=0.0.4; charset=utf-8",
            headers=NO_STORE,
        )  # fmt: skip

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok" if refresher.healthy else "database unreachable",
                                 status_code=200 if refresher.healthy else 503)  # fmt: skip

    async def healthz(request: Request) -> Response:
        """Liveness: the process answers (the database is /readyz's business: a database
        outage must not get every dashboard restarted)."""
        return PlainTextResponse("ok", headers=NO_STORE)

    async def readyz(request: Request) -> Response:
        """Readiness: PostgreSQL answers now, within ``ready_timeout`` seconds."""
        problem = await database.reachable(ready_timeout)
        if problem is None:
            return PlainTextResponse("ok", headers=NO_STORE)
        return PlainTextResponse(f"database unreachable: {problem}", status_code=503,
                                 headers=NO_STORE)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(refresher.run(), name="pgqueue-dashboard-refresh")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await database.close()

    get = ["GET", "HEAD"]
    routes = [
        Route("/", index, methods=get),
        Route("/api/snapshot", snapshot, methods=get),
        Route("/api/jobs/{job_id}", job, methods=get),
        Route("/jobs", job_search, methods=get, name="job_search"),
        Route("/jobs/{job_id}", job_detail, methods=get, name="job_detail"),
        Route("/events", events, methods=get),
        Route("/metrics", metrics, methods=get),
        Route("/health", health, methods=get),
        Route("/healthz", healthz, methods=get),
        Route("/readyz", readyz, methods=get),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = [
        Middleware(SecurityHeaders),
        Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts or LOOPBACK_HOSTS)),
        Middleware(ReadOnlyMethods),
    ]
    if basic_auth is not None:
        username, password = basic_auth
        if not username or not password:
            raise ValueError("basic auth needs both a username and a password")
        middleware.append(Middleware(BasicAuth, username=username, password=password))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.refresher = refresher
    return app


def is_loopback(host: str) -> bool:
    if host in ("localhost", "::1", "[::1]"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve(
    dsn: str,
    schema: str = "public",
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    basic_auth: tuple[str, str] | None = None,
    allow_public: bool = False,
    allowed_hosts: Sequence[str] | None = None,
    refresh_interval: float = 1.0,
    late_heartbeat_seconds: float = 15.0,
    long_transaction_seconds: float = 300.0,
    dead_tuple_ratio: float = 0.2,
    log_level: str = "info",
) -> None:
    """Run the dashboard with uvicorn. A non-loopback bind without auth is refused unless
    ``allow_public``: job arguments and errors can hold anything."""
    import uvicorn

    loopback = is_loopback(host)
    if not loopback and basic_auth is None and not allow_public:
        raise PublicBindError(
            f"refusing to serve the dashboard on {host} without authentication: set a username "
            "and password, or pass --allow-public if something in front of it authenticates"
        )
    if allowed_hosts is None and not loopback:
        allowed_hosts = ["*"]  # names are unknown; auth (or the proxy in front) is the guard
    app = create_app(
        dsn, schema, refresh_interval=refresh_interval, basic_auth=basic_auth,
        allowed_hosts=allowed_hosts, late_heartbeat_seconds=late_heartbeat_seconds,
        long_transaction_seconds=long_transaction_seconds, dead_tuple_ratio=dead_tuple_ratio,
    )  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)


class PublicBindError(Exception):
    """Binding a non-loopback address without authentication was not explicitly allowed."""

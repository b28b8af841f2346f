"""The live cluster page's routes (``/dashboard``), mounted by :func:`add_dashboard_routes`.

- ``GET /dashboard``: the page (``assets/dashboard/index.html``; ``?replay`` opens it on the replay of an
  ``xllm-sim run --json ... --timeline S`` file instead of the live cluster). Its scripts and styles are
  ``GET /dashboard/static/<name>``, shipped in the wheel; nothing is loaded from elsewhere (a strict
  ``Content-Security-Policy`` says so to the browser). The page and its assets hold no data: they are
  open like ``/health``.
- ``GET /dashboard/api/snapshot``: one :class:`~xllm.gateway.dashboard.hub.ClusterSnapshot` and the
  hub's recent events (JSON).
- ``GET /dashboard/api/events``: Server-Sent Events (``text/event-stream``): ``hello`` (the server's
  time and last event), the ring's events after ``?after=N`` or the ``Last-Event-ID`` header (each an
  SSE ``id``), then a ``snapshot`` every ``interval_s`` and every event as it is published (kinds in
  :data:`~xllm.gateway.dashboard.hub.EVENT_KINDS`; ``dropped`` when this page was too slow to get
  some). A stream ends by itself after ``max_stream_s`` or when the server shuts down (so it never
  holds a graceful shutdown up); the page reconnects with the last id it saw and misses nothing the
  ring still holds.
- ``GET /dashboard/api/requests?limit=N``: the recent requests' span timelines (or why there are none).

The data routes (``/dashboard/api/``) are behind the same API keys as ``/v1/*``
(:class:`~xllm.gateway.guard.ApiGuard`): 401 with the OpenAI-style error body without a valid
``Authorization: Bearer`` key. The page reads the stream with ``fetch`` (``EventSource`` cannot send
that header) and asks for the key, kept in the tab's ``sessionStorage``, when it gets a 401.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI, Header, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from xllm.gateway.dashboard.hub import (
    TRACING_OFF_HINT,
    EventHub,
    RequestTimelines,
    SnapshotSources,
    build_snapshot,
    sse_message,
)
from xllm.gateway.openai.errors import APIError

if TYPE_CHECKING:
    from xllm.gateway.app import GatewayState
    from xllm.gateway.moves import Mover
    from xllm.gateway.roles import RoleController
    from xllm.gateway.router import Router

DASHBOARD_PATH = "/dashboard"
DATA_PREFIX = "/dashboard/api/"  # behind the API keys (xllm.gateway.guard)
ASSETS = ("xllm.gateway", "assets/dashboard")
_ASSET_NAME = re.compile(r"[A-Za-z0-9_-]+\.(?:js|css|svg|png)")
_TYPES = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8", "svg": "image/svg+xml",
          "png": "image/png"}
# the page loads only its own files and talks only to its own origin
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache",
                "Referrer-Policy": "no-referrer"}


@dataclass(frozen=True)
class DashboardOptions:
    """``interval_s`` between snapshots on a stream; ``max_stream_s`` a stream's life before the page
    reconnects; ``request_limit`` requests in a snapshot's timelines."""

    interval_s: float = 1.0
    max_stream_s: float = 30.0
    request_limit: int = 30


def asset(name: str) -> bytes:
    """The bytes of a shipped page file (``FileNotFoundError`` for an unknown one)."""
    return resources.files(ASSETS[0]).joinpath(ASSETS[1], name).read_bytes()


def uvicorn_exiting() -> bool:
    """Whether the uvicorn server running this process was told to stop: its SIGTERM handler is its
    ``Server.handle_exit``, which sets ``should_exit`` (False anywhere else: a server on a thread)."""
    server = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return bool(getattr(server, "should_exit", False))


def add_dashboard_routes(app: FastAPI, state: GatewayState, router: Router | None = None,
                         roles: RoleController | None = None, mover: Mover | None = None,
                         timelines: RequestTimelines | None = None, options: DashboardOptions | None = None,
                         exiting: Callable[[], bool] = uvicorn_exiting, hub: EventHub | None = None) -> EventHub:
    """Mount the page and its data routes on ``app``, its events from ``hub`` (the one the role controller and
    the mover publish to, :mod:`xllm.gateway.events`; None: a new one nobody publishes to), returned and also
    ``app.state.dashboard``. ``timelines``: the recent requests' spans (None: the panel says tracing is off);
    ``exiting``: whether the server is shutting down (streams then end)."""
    options = options or DashboardOptions()
    hub = hub if hub is not None else EventHub()
    sources = SnapshotSources(state.registry, roles, router, mover, hub, timelines,
                              slo_ttft_s=state.pd_roles.slo_ttft_s, slo_tpot_s=state.pd_roles.slo_tpot_s,
                              started=state.started, request_limit=options.request_limit)
    app.state.dashboard = hub

    @app.get(DASHBOARD_PATH, include_in_schema=False)
    async def page():
        return HTMLResponse(asset("index.html"), headers=PAGE_HEADERS)

    @app.get(DASHBOARD_PATH + "/static/{name}", include_in_schema=False)
    async def static(name: str):
        if not _ASSET_NAME.fullmatch(name):
            raise APIError(404, f"no such file: {name}", "not_found_error")
        try:
            body = asset(name)
        except (FileNotFoundError, IsADirectoryError):
            raise APIError(404, f"no such file: {name}", "not_found_error") from None
        return Response(body, media_type=_TYPES[name.rsplit(".", 1)[1]], headers=PAGE_HEADERS)

    @app.get(DATA_PREFIX + "snapshot", include_in_schema=False)
    async def snapshot():
        snap = await build_snapshot(sources)  # asked once: always fresh (the streams share theirs)
        return JSONResponse({"snapshot": snap.to_dict(), "events": [e.to_dict() for e in hub.recent()]},
                            headers={"Cache-Control": "no-store"})

    @app.get(DATA_PREFIX + "requests", include_in_schema=False)
    async def requests(limit: int = Query(50, ge=1, le=500)):
        if timelines is None:
            return {"enabled": False, "hint": TRACING_OFF_HINT, "requests": []}
        return {"enabled": True, "hint": "", "requests": timelines.recent(limit)}

    @app.get(DATA_PREFIX + "events", include_in_schema=False)
    async def events(after: int | None = Query(None, ge=0),
                     last_event_id: str | None = Header(None, max_length=32)):
        start = after if after is not None else _event_id(last_event_id)
        return StreamingResponse(event_stream(hub, sources, start, options, exiting),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return hub


def _event_id(value: str | None) -> int:
    try:
        return max(int(value or 0), 0)
    except ValueError:
        return 0


async def event_stream(hub: EventHub, sources: SnapshotSources, after: int, options: DashboardOptions,
                       exiting: Callable[[], bool] = uvicorn_exiting) -> AsyncIterator[bytes]:
    """One page's stream (see the module docstring): subscribed before the ring is read, so no event
    falls between the two; each event sent once, in ``seq`` order."""
    loop = asyncio.get_running_loop()
    sub = hub.subscribe()
    try:
        yield f"retry: {int(options.interval_s * 1000)}\n\n".encode()
        yield sse_message("hello", {"seq": hub.seq, "time": time.time(),
                                    "interval_s": options.interval_s})
        last = after
        for event in hub.recent(after):
            yield event.sse()
            last = event.seq
        end = loop.time() + options.max_stream_s
        next_snapshot = loop.time()
        while loop.time() < end and not exiting():
            if loop.time() >= next_snapshot:
                snap = await sources.snapshot()
                yield sse_message("snapshot", snap.to_dict())
                if sub.dropped:
                    yield sse_message("dropped", {"events": sub.dropped})
                    sub.dropped = 0
                next_snapshot = loop.time() + options.interval_s
            try:
                event = await asyncio.wait_for(sub.queue.get(), max(next_snapshot - loop.time(), 0.01))
            except TimeoutError:
                continue
            if event.seq > last:
                yield event.sse()
                last = event.seq
    finally:
        hub.unsubscribe(sub)

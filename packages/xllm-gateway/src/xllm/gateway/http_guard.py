"""The HTTP front's bounds on slow and numerous clients, at the uvicorn protocol level.

:func:`build_server` runs the gateway app under uvicorn with its HTTP protocol class (httptools
or h11, as ``http="auto"`` picks) extended by :class:`_GuardedProtocol`:

- **header deadline**: a request head must be complete ``header_timeout_s`` after the connection
  opened (its first request) or after its first byte arrived (later requests on a kept-alive
  connection; the idle wait before that byte is the keep-alive timeout's). Past it the client
  gets a 408 with an OpenAI-style error body and the connection is closed.
- **body deadline**: the whole request body must arrive ``body_timeout_s`` after the head was
  complete; past it the request is answered 408 (if no response has started) and the connection is
  closed, and the app reads a disconnect. Only reading the request is bounded: once its body is
  complete (or its response has started) nothing is timed, so a long SSE stream runs as long as it
  needs.
- **idle keep-alive**: uvicorn's own ``timeout_keep_alive`` (``keep_alive_s``): a connection with
  no request under way and no byte of the next one is closed after it, silently.
- **connection caps**: at most ``max_connections_per_client`` connections per remote address and
  ``max_connections`` in all. A connection beyond a cap is accepted but not counted; its first
  request is answered at once (429 for the per-client cap, 503 for the total, both with
  ``Retry-After``) and the connection closed; it lives at most the header deadline.

Each refusal is counted in ``xllm:http_refused_total{reason}`` (:class:`~xllm.gateway.metrics.HttpMetrics`).
The clock starts at the protocol callbacks, so the bounds hold whatever the app does; the app itself
is not changed. The caps count remote addresses: behind a reverse proxy every client is the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xllm.gateway.openai.errors import RETRY_AFTER_SECONDS, APIError, overloaded

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # not imported to build the command line's parser (HttpGuardOptions)
    import uvicorn
    from prometheus_client import CollectorRegistry

    from xllm.gateway.metrics import HttpMetrics

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[dict, Receive, Send], Awaitable[None]]


def default_max_connections() -> int:
    """Three quarters of the process's open-file limit (the rest for the engine, etcd, files), at least 64."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else max(64, soft * 3 // 4)


@dataclass(frozen=True)
class HttpGuardOptions:
    """The bounds (see the module docstring); a cap of None is no cap."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections_per_client: int | None = 512
    max_connections: int | None = field(default_factory=default_max_connections)

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_connections_per_client", "max_connections"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (None: no cap)")


def timeout_error(what: str, seconds: float) -> APIError:
    """The 408 of a read deadline."""
    return APIError(408, f"the request {what} did not arrive within {seconds:g} s", "invalid_request_error", None,
                    "request_timeout", headers={"Connection": "close"})


def cap_error(reason: str, limit: int) -> APIError:
    """The refusal of a connection beyond a cap: 429 for the per-client cap, 503 for the total."""
    if reason == "client_cap":
        return APIError(429, f"too many connections from this client (limit {limit}); retry later",
                        "rate_limit_error", None, "too_many_connections",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS), "Connection": "close"})
    err = overloaded(f"the server holds its limit of {limit} connections; retry later")
    err.headers["Connection"] = "close"
    return err


def raw_response(err: APIError) -> bytes:
    """``err`` as a whole HTTP/1.1 response, for a connection with no request cycle to answer through."""
    body = json.dumps(err.body()).encode()
    phrase = {408: "Request Timeout"}.get(err.status, "")
    headers = {"content-type": "application/json", "content-length": str(len(body)), **err.headers}
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"HTTP/1.1 {err.status} {phrase}\r\n{head}\r\n".encode("latin-1") + body


async def send_error(send: Send, err: APIError) -> None:
    """``err`` through an ASGI ``send``."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass
class ConnectionTally:
    """The connections admitted, in all and per remote address (one event loop: no lock)."""

    options: HttpGuardOptions
    metrics: HttpMetrics
    total: int = 0
    per_client: dict[str, int] = field(default_factory=dict)

    def admit(self, client: str) -> APIError | None:
        """Count a new connection from ``client``; or count the refusal it gets and return it (the
        connection itself is then not counted)."""
        o = self.options
        for reason, limit, used in (("client_cap", o.max_connections_per_client, self.per_client.get(client, 0)),
                                    ("total_cap", o.max_connections, self.total)):
            if limit is not None and used >= limit:
                self.metrics.refuse(reason)
                return cap_error(reason, limit)
        self.total += 1
        self.per_client[client] = self.per_client.get(client, 0) + 1
        self.metrics.open.set(self.total)
        return None

    def release(self, client: str) -> None:
        """An admitted connection from ``client`` closed."""
        self.total -= 1
        left = self.per_client.pop(client) - 1
        if left:
            self.per_client[client] = left
        self.metrics.open.set(self.total)


@dataclass
class _BodyDeadline:
    """One request's ASGI ``receive``/``send`` with the body deadline (see the module docstring)."""

    receive_: Receive
    send_: Send
    deadline: float
    timeout_s: float
    metrics: HttpMetrics
    body_done: bool = False
    response_started: bool = False
    timed_out: bool = False

    async def receive(self) -> Message:
        if self.body_done or self.timed_out:
            return await self.receive_()  # after the body: waiting for a disconnect is not bounded
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self.receive_()
        except TimeoutError:
            self.timed_out = True
            self.metrics.refuse("body_timeout")
            if not self.response_started:  # through send_, not send: that drops the app's messages from now on
                self.response_started = True
                await send_error(self.send_, timeout_error("body", self.timeout_s))
            return {"type": "http.disconnect"}
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
        return message

    async def send(self, message: Message) -> None:
        if self.timed_out:
            return  # the 408 has been sent; what the app answers to its disconnect goes nowhere
        if message["type"] == "http.response.start":
            self.response_started = True
        await self.send_(message)


class _GuardedProtocol:
    """Mixed in before uvicorn's HTTP protocol class (:func:`guarded_protocol`): the deadlines and
    caps of one connection. Relies on what uvicorn's httptools and h11 protocols share: ``self.app``
    (called once a request head is complete), ``transport``, ``loop``, ``on_response_complete``."""

    tally: ConnectionTally  # set on the class by guarded_protocol
    app: App
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inner_app = self.app
        self.app = self._serve_request
        self._client = ""
        self._refusal: APIError | None = None
        self._admitted = False
        self._awaiting_head = True  # no request under way: the next bytes are a request head
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self._refusal = self.tally.admit(self._client)
        self._admitted = self._refusal is None
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head and self._head_timer is None and data:
            self._start_head_timer()  # the first byte of a later request on this connection
        super().data_received(data)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._awaiting_head = True  # idle: uvicorn's keep-alive timer runs until a byte comes

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._admitted:
            self._admitted = False
            self.tally.release(self._client)
        super().connection_lost(exc)  # type: ignore[misc]

    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.tally.options.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._awaiting_head or self.transport.is_closing():
            return
        self.tally.metrics.refuse("header_timeout")
        self.transport.write(raw_response(timeout_error("head", self.tally.options.header_timeout_s)))
        self.transport.close()

    async def _serve_request(self, scope: dict, receive: Receive, send: Send) -> None:
        """The app as uvicorn calls it for each request, its head complete."""
        self._awaiting_head = False
        self._cancel_head_timer()
        if self._refusal is not None:
            await send_error(send, self._refusal)
            return
        body = _BodyDeadline(receive, send, self.loop.time() + self.tally.options.body_timeout_s,
                             self.tally.options.body_timeout_s, self.tally.metrics)
        await self._inner_app(scope, body.receive, body.send)


def guarded_protocol(base: type[asyncio.Protocol], tally: ConnectionTally) -> type[asyncio.Protocol]:
    """``base`` (a uvicorn HTTP protocol class) with the bounds of ``tally``'s options."""
    return type(f"Guarded{base.__name__}", (_GuardedProtocol, base), {"tally": tally})


def build_server(app: App, host: str, port: int, options: HttpGuardOptions, registry: CollectorRegistry,
                 log_level: str = "info", http: str = "auto", stop_when: Callable[[], bool] | None = None
                 ) -> uvicorn.Server:
    """A uvicorn server of ``app`` with these bounds, counted in ``registry`` (the app's /metrics); it shuts
    down (as on SIGTERM) once ``stop_when()`` is true, checked ten times a second."""
    import uvicorn
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    from xllm.gateway.metrics import HttpMetrics

    base = import_from_string(HTTP_PROTOCOLS[http])
    tally = ConnectionTally(options, HttpMetrics(registry))
    # loop "auto": uvloop where installed; ws "none": the API has no WebSocket route, and an upgrade
    # would hand the transport to a protocol without these bounds
    # log_config None: uvicorn's lines go through the process's own logging (xllm.engine_api.logs: text or
    # JSON, the request id in each)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="auto", log_config=None,
                            http=guarded_protocol(base, tally), ws="none",
                            timeout_keep_alive=options.keep_alive_s)  # type: ignore[arg-type]
    if stop_when is None:
        return uvicorn.Server(config)

    class _StoppableServer(uvicorn.Server):
        async def on_tick(self, counter: int) -> bool:
            return await super().on_tick(counter) or stop_when()

    return _StoppableServer(config)


def serve(app: Any, host: str, port: int, options: HttpGuardOptions, log_level: str = "info") -> None:
    """Serve the gateway ``app`` (:func:`xllm.gateway.app.create_app`: its /metrics registry counts the
    refusals) until stopped, as ``uvicorn.run`` does: Ctrl-C ends quietly; a server that never started
    (the port taken, the app's start-up failed) exits with uvicorn's start-up failure status; a gateway
    that failed (:meth:`GatewayState.fail <xllm.gateway.app.GatewayState.fail>`: an in-process engine
    taken for hung) shuts down and exits with status 1."""
    from uvicorn.main import STARTUP_FAILURE

    gateway = app.state.gateway
    server = build_server(app, host, port, options, gateway.metrics.registry, log_level=log_level,
                          stop_when=lambda: gateway.failure is not None)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)
    if gateway.failure is not None:
        log.error("xllm serve stopped: %s", gateway.failure)
        raise SystemExit(1)

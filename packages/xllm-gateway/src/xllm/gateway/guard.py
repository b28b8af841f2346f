"""The ASGI middleware in front of the gateway's routes (:class:`ApiGuard`).

For every HTTP request it assigns a request id (the ``x-request-id`` response header; the 500
handler logs the failure under it and names it to the client). For ``/v1/*`` it authenticates
the caller by :class:`~xllm.gateway.access.AccessPolicy` (401 before anything is read) and
leaves the :class:`~xllm.gateway.access.Caller` in the request state; so it does for the live
cluster page's data (``/dashboard/api/*``: the cluster's state and its requests), not for the
page itself. For generation requests (``POST /v1/*``) it enforces ``max_inflight``: a request
beyond it gets 503 with ``Retry-After`` at once, and a request counts until its response (a whole
stream) has been sent.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from xllm.gateway.access import API_PREFIX, KEYED_PREFIXES, AccessPolicy, Caller
from xllm.gateway.openai.errors import REQUEST_ID, APIError, new_request_id, overloaded

REQUEST_ID_HEADER = "x-request-id"


def request_id_of(scope: Scope) -> str | None:
    """The id :class:`ApiGuard` gave this request."""
    return scope.get("state", {}).get("request_id")


def caller_of(scope: Scope) -> Caller | None:
    """The caller :class:`ApiGuard` authenticated (None outside ``/v1/*``)."""
    return scope.get("state", {}).get("caller")


class ApiGuard:
    """Request ids, API-key authentication and the in-flight bound (see the module docstring)."""

    def __init__(self, app: ASGIApp, access: AccessPolicy, max_inflight: int | None = None) -> None:
        self.app = app
        self.access = access
        self.max_inflight = max_inflight
        self.inflight = 0  # generation requests being served (one event loop: no lock needed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        token = REQUEST_ID.set(request_id)
        try:
            await self._guarded(scope, receive, send, request_id)
        finally:
            REQUEST_ID.reset(token)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        state = scope["state"]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            await send(message)

        if not scope["path"].startswith(KEYED_PREFIXES):
            await self.app(scope, receive, send_with_id)
            return
        try:
            state["caller"] = self.access.authenticate(Headers(scope=scope).get("authorization"))
        except APIError as err:
            await err.response()(scope, receive, send_with_id)
            return
        if scope["method"] != "POST" or self.max_inflight is None or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send_with_id)
            return
        if self.inflight >= self.max_inflight:
            err = overloaded(f"the server is handling its limit of {self.max_inflight} requests; retry later")
            await err.response()(scope, receive, send_with_id)
            return
        self.inflight += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.inflight -= 1

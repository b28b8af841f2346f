"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Error bodies never carry internal exception text: an unexpected failure is logged with the
request's id (:data:`REQUEST_ID`, set for each request by :class:`xllm.gateway.guard.ApiGuard`) and
answered by :func:`internal_error` with a generic message naming that id. Every 503 carries a
``Retry-After`` header (:data:`RETRY_AFTER_SECONDS`).
"""

from __future__ import annotations

import logging
import uuid

from fastapi.responses import JSONResponse

from xllm.engine_api.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from xllm.engine_api.logs import REQUEST_ID

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1  # what a 503 asks the client to wait before retrying

# REQUEST_ID (xllm.engine_api.logs): the id of the HTTP request being served, in its context (tasks it starts
# inherit it): a failure deep in dispatch or mid-stream is logged and answered under the id the client sees,
# and every log line of the request names it.


class APIError(Exception):
    """An error to return to the client with an HTTP status (and extra response headers)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message, param = _clean(message, 4096), None if param is None else _clean(param, 256)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = dict(headers or {})
        if status == 503:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def _clean(text: str, limit: int) -> str:
    """``text`` safe to send back: lone surrogates (a client's invalid field name, echoed) escaped
    as ``\\udXXX`` (they cannot be encoded as UTF-8), and at most ``limit`` characters."""
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def overloaded(message: str) -> APIError:
    return APIError(503, message, "server_overloaded", None, "overloaded")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str, param: str | None = None) -> APIError:
    return APIError(403, message, "permission_error", param, "permission_denied")


def payload_too_large(limit: int) -> APIError:
    """413; the connection is closed after it (the rest of the body is never read)."""
    return APIError(413, f"the request body exceeds this server's limit of {limit} bytes", "invalid_request_error",
                    None, "request_too_large", headers={"Connection": "close"})


def internal(message: str) -> APIError:
    return APIError(500, message, "internal_error", None, None)


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def internal_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """Log ``exc`` (with its traceback) under ``request_id`` (default: the current request's, else a
    new id) and return the 500 the client gets: a generic message naming that id, never the
    exception's text."""
    request_id = request_id or REQUEST_ID.get() or new_request_id()
    log.error("request %s: internal error", request_id, exc_info=exc)
    return internal(f"The server had an error while processing your request (request id {request_id}).")


def to_api_error(exc: BaseException) -> APIError:
    """The API error an engine error (or any failure) stands for."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, EngineOverloadedError):
        return overloaded(str(exc))
    if isinstance(exc, EngineDeadError):  # its text may hold internals (a crash's repr, gRPC details)
        request_id = REQUEST_ID.get() or new_request_id()
        log.warning("request %s: engine unavailable: %s", request_id, exc)
        return APIError(503, f"The engine is unavailable; retry later (request id {request_id}).",
                        "server_unavailable")
    return internal_error(exc)

"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from xllm.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError


class APIError(Exception):
    """An error to return to the client with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def overloaded(message: str) -> APIError:
    return APIError(503, message, "server_overloaded", None, "overloaded")


def internal(message: str) -> APIError:
    return APIError(500, message, "internal_error", None, None)


def to_api_error(exc: BaseException) -> APIError:
    """The API error an engine error (or any failure) stands for."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, EngineOverloadedError):
        return overloaded(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_unavailable")
    return internal(f"{type(exc).__name__}: {exc}")

"""From HTTP body to validated request: a bounded read, strict JSON, one walk over the parsed
value for what no schema sees, the pydantic model, then the limits.

- :func:`read_body` (on the event loop: it only awaits the client) stops at ``max_body_bytes``:
  a ``Content-Length`` past it is refused before anything is read, a chunked body as soon as the
  bytes read pass it (413, connection closed).
- :func:`parse_request` (CPU work: the caller runs it off the event loop) decodes the JSON, refuses
  lone UTF-16 surrogates in any string or object key (they cannot be encoded as UTF-8: the
  tokenizer and the response encoder would fail), non-finite numbers (Python's JSON reader
  accepts ``NaN``, ``Infinity`` and overflowing literals) and nesting deeper than
  ``max_json_depth``, each as a 400 naming the top-level field; then validates the model and checks
  :class:`~xllm.gateway.openai.limits.ApiLimits`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from xllm.gateway.openai.errors import APIError, bad_request, payload_too_large
from xllm.gateway.openai.limits import ApiLimits, check_limits

M = TypeVar("M", bound=BaseModel)

_SURROGATE = re.compile("[\ud800-\udfff]")
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, at most ``max_bytes`` of it (413 past that, without reading the rest)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > max_bytes:
            raise payload_too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise payload_too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise APIError(499, "client disconnected", "client_closed_request") from exc
    return b"".join(chunks)


def parse_request(raw: bytes, model: type[M], limits: ApiLimits) -> M:
    """``raw`` as a validated ``model`` within ``limits``; an :class:`APIError` (400) naming the field
    otherwise. CPU-bound (up to ``limits.max_body_bytes`` of JSON): run it off the event loop."""
    data = decode_json(raw, limits.max_json_depth)
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    check_limits(req, limits)
    return req


def decode_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The JSON object in ``raw``, checked by :func:`check_json_values`."""
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8") from None
    except RecursionError:
        raise bad_request(f"request body nests deeper than {max_depth} levels") from None
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    check_json_values(data, max_depth)
    return data


def check_json_values(data: dict[str, Any], max_depth: int) -> None:
    """Refuse lone surrogates (strings and keys), non-finite numbers and nesting past ``max_depth``
    anywhere in ``data``; the error names the top-level field and the path to the value."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict):
            if depth > max_depth:
                _fail(path, f"nests deeper than {max_depth} levels")
            for key, item in value.items():
                if not key.isascii() and _SURROGATE.search(key):
                    _fail((*path, key), "has a key with a lone UTF-16 surrogate (not valid Unicode)")
                if not _scalar_ok(item):
                    stack.append((item, (*path, key), depth + 1))
        elif isinstance(value, list):
            if depth > max_depth:
                _fail(path, f"nests deeper than {max_depth} levels")
            for i, item in enumerate(value):
                if not _scalar_ok(item):
                    stack.append((item, (*path, i), depth + 1))
        elif isinstance(value, str):
            _fail(path, "contains a lone UTF-16 surrogate (not valid Unicode)")
        else:  # a float
            _fail(path, f"must be a finite number, got {value!r}")


def _scalar_ok(value: Any) -> bool:
    """True for values that need no further look (ints, bools, null, clean strings and floats)."""
    if isinstance(value, str):
        return value.isascii() or _SURROGATE.search(value) is None
    if isinstance(value, float):
        return math.isfinite(value)
    return not isinstance(value, (dict, list))


def _fail(path: tuple, problem: str) -> None:
    where = ".".join(str(p) for p in path)
    param = str(path[0]) if path else None
    shown = where if len(where) <= 80 else where[:77] + "..."
    raise bad_request(f"{shown}: {problem}" if path else f"request body {problem}", param)


def _is_type_tag(part: object) -> bool:
    """Pydantic names the member of a union it tried (``str``, ``list[int]``, ...) in ``loc``."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


def validation_error(errors: list[dict]) -> APIError:
    """The 400 for pydantic (or FastAPI) validation errors: the first error, located by its field
    path; ``param`` is the top-level request field, as in OpenAI's error bodies."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg')}")
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    loc = [str(x) for x in loc if not _is_type_tag(x)]
    param = loc[0] if loc else None
    where = ".".join(loc)
    if len(where) > 80:
        where = where[:77] + "..."
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {where}", param)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"{where}: {msg}" if where else msg, param)

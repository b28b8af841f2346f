"""The gateway's ``/openapi.json``: the real request and response schemas of every route.

The OpenAI routes read their body themselves (:mod:`xllm.gateway.openai.request_body`: a bounded
read, strict JSON, surrogate, non-finite and depth checks, then the pydantic model), so FastAPI
sees no body parameter and would publish none. The routes declare their body here instead:
:meth:`RequestBodies.json` (``openapi_extra``) names the request model's component, and
:func:`answers` (``responses=``) the answers (the JSON body, the SSE stream, the OpenAI error body
of each 4xx/5xx the route can give). :func:`install_openapi` builds the document with the request
models' JSON schemas (:meth:`pydantic.BaseModel.model_json_schema`, as validated, tightened by
this server's :class:`~xllm.gateway.openai.limits.ApiLimits` where a schema can state them) among
its components, and the bearer API-key scheme on ``/v1/*`` when keys are configured. Parsing is
unchanged: the schema only describes it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from xllm.gateway.access import KEYED_PREFIXES
from xllm.gateway.openai.errors import RETRY_AFTER_SECONDS
from xllm.gateway.openai.limits import OPENAI_MAX_COMPLETION_LOGPROBS, ApiLimits
from xllm.gateway.openai.protocol_responses import STREAM_MODELS, ErrorResponse

COMPONENTS = "#/components/schemas/{model}"
SECURITY_SCHEME = "apiKey"

_ERRORS = {
    400: "Invalid request (the message names the field; `param` is the top-level field)",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`)",
    403: "A priority the caller may not ask for",
    404: "Unknown model",
    413: "The request body is larger than the server's limit (the connection is closed)",
    500: "Internal error (the message names the request id, also in the `x-request-id` header)",
    503: f"Overloaded or no engine available; retry after `Retry-After` ({RETRY_AFTER_SECONDS} s)",
}
GENERATION_ERRORS = (400, 403, 404, 413, 500, 503)
RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds to wait before retrying"}}
SSE_DESCRIPTION = ("With `stream: true`: server-sent events, each `data:` line one JSON chunk ({chunk}), an "
                   "error object (`ErrorResponse`) if the engine fails mid-stream, and `data: [DONE]` last. Each "
                   "chunk's event has an `id:` line: the response id, `/`, then each choice's output tokens so "
                   "far (comma-separated): what a client reconnecting after a lost connection quotes as "
                   "`Last-Event-ID`.")
STREAM_END = "[DONE]"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": COMPONENTS.format(model=model.__name__)}


class RequestBodies:
    """The request models of an app's routes, for :func:`install_openapi`."""

    def __init__(self) -> None:
        self.models: list[type[BaseModel]] = []

    def json(self, model: type[BaseModel]) -> dict[str, Any]:
        """The ``openapi_extra`` of a route whose JSON body validates as ``model`` (recorded)."""
        self.models.append(model)
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(model)}}}}


def answers(ok: type[BaseModel] | None, *errors: int, stream: type[BaseModel] | None = None,
            named_events: bool = False) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route: 200 as ``ok`` (JSON; with ``stream``, also a ``text/event-stream``
    of ``stream`` chunks, ``named_events``: each with its ``event:`` type and no ``[DONE]``; None: the route's
    own response class) and the OpenAI error body for each of ``errors``."""
    out: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        out[200] = {"model": ok, "description": "OK"}
        if stream is not None:
            schema = named_sse_event(stream) if named_events else sse_event(stream)
            out[200]["content"] = {"text/event-stream": {"schema": schema}}
    for status in errors:
        out[status] = error_answer(status)
    return out


def named_sse_event(event: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream of typed events (``/v1/responses``): ``event`` names its type, its
    ``data`` is the event as JSON (or an error)."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(event), _ref(ErrorResponse)]}}
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"type": "string", "description": "the event's `type`"}, "data": json_data}}


def sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """The schema of one server-sent event of a stream of ``chunk``s (OpenAPI 3.1 reads a
    ``text/event-stream`` schema as one event's, 3.2 as an ``itemSchema``): its ``data`` is JSON, a
    ``chunk`` or an error, or the closing ``[DONE]``."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}
    return {"type": "object", "description": SSE_DESCRIPTION.format(chunk=chunk.__name__), "required": ["data"],
            "properties": {"id": {"type": "string", "description": "`<response id>/<tokens>[,<tokens>...]`"},
                           "data": {"anyOf": [{"const": STREAM_END}, json_data]}}}


def error_answer(status: int) -> dict[str, Any]:
    """The documented answer of an error ``status``: the OpenAI error body, whatever the route's own
    response class (503 with its ``Retry-After``)."""
    out = {"description": _ERRORS[status], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    if status == 503:
        out["headers"] = RETRY_AFTER
    return out


def install_openapi(app: FastAPI, bodies: RequestBodies, requires_key: bool, limits: ApiLimits) -> None:
    """Make ``app.openapi()`` publish the request models of ``bodies`` (the routes' request bodies,
    within this server's ``limits``) and the stream chunks among the components, and, when
    ``requires_key``, the bearer scheme on every ``/v1/*`` operation with its 401."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (*STREAM_MODELS, ErrorResponse):  # answers: FastAPI may have published them already
            _add_schema(components, model, "serialization", exclusive=False)
        for model in bodies.models:
            _add_schema(components, model, "validation")
        for name, rules in _limit_rules(limits).items():
            if name in components:
                for field, by_type in rules.items():
                    _bound(components[name]["properties"][field], by_type)
        if requires_key:
            _add_security(doc)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi


def _add_schema(components: dict[str, Any], model: type[BaseModel], mode: JsonSchemaMode,
                exclusive: bool = True) -> None:
    """``model``'s schema (as validated or as serialized) and its nested models (``$defs``) as
    components. ``exclusive``: a name already taken by another schema is an error (a request model
    named as an answer's model would publish one of them wrongly); else the published one stays."""
    schema = model.model_json_schema(ref_template=COMPONENTS, mode=mode)
    for name, sub in (*schema.pop("$defs", {}).items(), (model.__name__, schema)):
        if components.setdefault(name, sub) != sub and exclusive:
            raise ValueError(f"two schemas named {name} in /openapi.json")


def _limit_rules(limits: ApiLimits) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """The bounds of ``limits`` a JSON schema can state: per request model, per field, per JSON type
    of its value, the keywords (the others, such as a prompt's characters, only ``check_limits``
    applies; the published ones are checked there too)."""
    stop = {"string": {"maxLength": limits.max_stop_chars},
            "array": {"maxItems": limits.max_stop, "items": {"maxLength": limits.max_stop_chars}}}
    logprobs = {"integer": {"maximum": limits.max_logprobs}}
    sampling = {"n": {"integer": {"maximum": limits.max_n}}, "stop": stop, "prompt_logprobs": logprobs,
                "stop_token_ids": {"array": {"maxItems": limits.max_stop_token_ids}},
                "logit_bias": {"object": {"maxProperties": limits.max_logit_bias}}}
    messages = {"messages": {"array": {"maxItems": limits.max_messages}}}
    completion_logprobs = min(limits.max_logprobs, OPENAI_MAX_COMPLETION_LOGPROBS)
    return {"ChatCompletionRequest": {**sampling, **messages, "top_logprobs": logprobs},
            "CompletionRequest": {**sampling, "logprobs": {"integer": {"maximum": completion_logprobs}}},
            "RecommendRequest": messages}


def _bound(prop: dict[str, Any], by_type: dict[str, dict[str, Any]]) -> None:
    """Tighten ``prop`` (a field's schema, or each branch of its ``anyOf``) by the keywords of its type."""
    for branch in prop.get("anyOf", [prop]):
        for key, value in by_type.get(branch.get("type"), {}).items():
            if isinstance(value, dict):
                branch.setdefault(key, {}).update(value)
            else:
                branch[key] = min(value, branch.get(key, value))


def _add_security(doc: dict[str, Any]) -> None:
    doc["components"]["securitySchemes"] = {SECURITY_SCHEME: {
        "type": "http", "scheme": "bearer", "description": "an API key of `xllm serve --api-key` (or $XLLM_API_KEY)"}}
    unauthorized = error_answer(401)
    for path, ops in doc.get("paths", {}).items():
        if not path.startswith(KEYED_PREFIXES):
            continue
        for op in ops.values():
            op["security"] = [{SECURITY_SCHEME: []}]
            op.setdefault("responses", {})["401"] = unauthorized

"""OpenAI-style error bodies and the mapping of engine errors to HTTP statuses."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

from xllm.engine_api.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from xllm.gateway.openai.errors import (
    APIError,
    bad_request,
    forbidden,
    internal,
    internal_error,
    model_not_found,
    overloaded,
    payload_too_large,
    to_api_error,
    unauthorized,
)
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from xllm.gateway.openai.request_body import validation_error


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    err = validation_error(errors)
    assert (err.status, err.type) == (400, "invalid_request_error")
    return err.message, err.param


def test_body_has_the_four_openai_fields():
    err = APIError(418, "short and stout", "teapot_error", "spout", "im_a_teapot")
    assert err.body() == {"error": {"message": "short and stout", "type": "teapot_error", "param": "spout",
                                    "code": "im_a_teapot"}}
    resp = err.response()
    assert resp.status_code == 418
    assert json.loads(resp.body) == err.body()
    assert resp.media_type == "application/json"
    assert str(err) == "short and stout"


def test_helpers():
    assert bad_request("nope", "max_tokens").body() == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "max_tokens", "code": None}}
    assert bad_request("nope").status == 400
    nf = model_not_found("gpt-9")
    assert nf.status == 404
    assert nf.body()["error"] == {"message": "The model `gpt-9` does not exist.", "type": "invalid_request_error",
                                  "param": "model", "code": "model_not_found"}
    ov = overloaded("busy")
    assert (ov.status, ov.type, ov.code) == (503, "server_overloaded", "overloaded")
    ie = internal("boom")
    assert (ie.status, ie.type, ie.param, ie.code) == (500, "internal_error", None, None)
    un = unauthorized("no key")
    assert (un.status, un.type, un.code, un.headers) == (401, "authentication_error", "invalid_api_key",
                                                         {"WWW-Authenticate": "Bearer"})
    fb = forbidden("no priority for you", "priority")
    assert (fb.status, fb.type, fb.param) == (403, "permission_error", "priority")
    big = payload_too_large(1024)
    assert (big.status, big.code, big.headers["Connection"]) == (413, "request_too_large", "close")
    assert "1024" in big.message


def test_every_503_carries_retry_after():
    for err in (overloaded("busy"), APIError(503, "gone", "server_unavailable"), to_api_error(EngineDeadError("x"))):
        assert err.status == 503
        assert err.response().headers["retry-after"] == "1"
    assert "retry-after" not in bad_request("x").response().headers


def test_engine_errors_map_to_statuses():
    e = to_api_error(InvalidRequestError("max_tokens too big", "max_tokens"))
    assert (e.status, e.type, e.param, e.message) == (400, "invalid_request_error", "max_tokens",
                                                      "max_tokens too big")
    assert to_api_error(EngineOverloadedError("full")).status == 503
    assert to_api_error(EngineOverloadedError("full")).code == "overloaded"
    dead = to_api_error(EngineDeadError("engine loop crashed: KeyError('secret')"))
    assert (dead.status, dead.type) == (503, "server_unavailable")
    assert "secret" not in dead.message and "request id req_" in dead.message
    same = bad_request("x")
    assert to_api_error(same) is same


def test_internal_errors_are_logged_not_shown(caplog):
    """The client gets a generic message naming the request id; the log has the exception."""
    with caplog.at_level(logging.ERROR, logger="xllm.gateway.openai.errors"):
        other = to_api_error(RuntimeError("password=hunter2"))
        named = internal_error(ValueError("internal detail"), "req_abc")
    assert other.status == 500 and "hunter2" not in other.message and "RuntimeError" not in other.message
    assert named.message == "The server had an error while processing your request (request id req_abc)."
    first, second = caplog.records
    assert str(first.exc_info[1]) == "password=hunter2"
    assert f"(request id {first.getMessage().split()[1].rstrip(':')})" in other.message  # the same id
    assert second.getMessage() == "request req_abc: internal error"
    assert str(second.exc_info[1]) == "internal detail"


def _validation_error(model, body) -> list[dict]:
    try:
        model.model_validate(body)
    except ValidationError as exc:
        # what FastAPI reports for a JSON body: every loc starts with "body" (our routes: without it)
        return [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    raise AssertionError("body was valid")


@pytest.mark.parametrize(("model", "body", "param", "where"), [
    (ChatCompletionRequest, {}, "messages", "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, "max_tokens",
     "max_tokens"),
    (ChatCompletionRequest, {"messages": [{"role": "bot", "content": "x"}]}, "messages", "messages.0.role"),
    # union members ("str", "list[TextPart]", ...) are not request parameters
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages", "messages.0.content"),
    (CompletionRequest, {"prompt": 7}, "prompt", "prompt"),
    (CompletionRequest, {"prompt": "x", "stop": 5}, "stop", "stop"),
])
def test_validation_message_names_the_parameter(model, body, param, where):
    message, got_param = _validation_message(_validation_error(model, body))
    assert got_param == param
    assert message.startswith(f"{where}: ")
    assert "[" not in message.split(":")[0]


def test_validation_message_of_a_cross_field_rule_names_the_dependent_field():
    exc = _validation_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                    "top_logprobs": 2})
    message, param = _validation_message(exc)
    assert param == "top_logprobs"
    assert message == "top_logprobs: requires logprobs to be true"


def test_validation_message_of_an_unknown_field_is_openais():
    message, param = _validation_message(_validation_error(CompletionRequest, {"prompt": "x", "frobnicate": 1}))
    assert (message, param) == ("Unrecognized request argument supplied: frobnicate", "frobnicate")
    body = {"messages": [{"role": "user", "content": "x", "colour": "red"}]}
    message, param = _validation_message(_validation_error(ChatCompletionRequest, body))
    assert (message, param) == ("Unrecognized request argument supplied: messages.0.colour", "messages")


def test_validation_message_of_bad_json():
    errors = [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error", "input": {},
               "ctx": {"error": "Expecting value"}}]
    message, param = _validation_message(errors)
    assert param is None
    assert message.startswith("request body is not valid JSON")
    assert _validation_message([]) == ("invalid request", None)

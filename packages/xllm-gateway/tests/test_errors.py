"""OpenAI-style error bodies and the mapping of engine errors to HTTP statuses."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from xllm.core import EngineDeadError, EngineOverloadedError, InvalidRequestError
from xllm.gateway.app import _validation_message
from xllm.gateway.openai.errors import APIError, bad_request, internal, model_not_found, overloaded, to_api_error
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest


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


def test_engine_errors_map_to_statuses():
    e = to_api_error(InvalidRequestError("max_tokens too big", "max_tokens"))
    assert (e.status, e.type, e.param, e.message) == (400, "invalid_request_error", "max_tokens",
                                                      "max_tokens too big")
    assert to_api_error(EngineOverloadedError("full")).status == 503
    assert to_api_error(EngineOverloadedError("full")).code == "overloaded"
    dead = to_api_error(EngineDeadError("crashed"))
    assert (dead.status, dead.type) == (503, "server_unavailable")
    other = to_api_error(RuntimeError("oops"))
    assert (other.status, other.message) == (500, "RuntimeError: oops")
    same = bad_request("x")
    assert to_api_error(same) is same


def _validation_error(model, body) -> RequestValidationError:
    try:
        model.model_validate(body)
    except ValidationError as exc:
        # what FastAPI reports for a JSON body: every loc starts with "body"
        return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()])
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


def test_validation_message_of_a_cross_field_rule():
    exc = _validation_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                    "top_logprobs": 2})
    message, param = _validation_message(exc)
    assert param is None
    assert message == "top_logprobs requires logprobs to be true"


def test_validation_message_of_bad_json():
    exc = RequestValidationError([{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
                                   "input": {}, "ctx": {"error": "Expecting value"}}])
    message, param = _validation_message(exc)
    assert param is None
    assert message.startswith("request body is not valid JSON")
    assert _validation_message(RequestValidationError([])) == ("invalid request", None)

"""A request's output constraint: ``response_format``, vLLM's ``guided_*`` and forced tool calls.

:func:`structured_output` turns the request's fields into one ``StructuredOutput`` message (at most
one constraint per request: two are a 400 naming the second) and checks it with the grammar
engine's own validator (:func:`xllm.engine_api.grammar_spec.check`), so an invalid schema, regex or
grammar is a 400 naming its field before anything is submitted, in embedded and cluster mode alike.
The engine compiles the same text (:mod:`xllm.core.grammar`) and enforces it token by token.
Runs on the preprocessor's threads (a large schema takes milliseconds to check).
"""

from __future__ import annotations

import json

from xllm.engine_api.errors import InvalidRequestError
from xllm.engine_api.grammar_spec import check
from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.protocol import _SamplingFields
from xllm.proto.engine.v1 import engine_pb2

ANY_JSON_OBJECT = json.dumps({"type": "object"})


def _candidates(req: _SamplingFields) -> list[engine_pb2.StructuredOutput]:
    out: list[engine_pb2.StructuredOutput] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(engine_pb2.StructuredOutput(json_schema=ANY_JSON_OBJECT, field="response_format"))
    elif rf is not None and rf.type == "json_schema":
        out.append(engine_pb2.StructuredOutput(json_schema=json.dumps(rf.json_schema.schema_),
                                               field="response_format"))
    if req.guided_json is not None:
        text = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        out.append(engine_pb2.StructuredOutput(json_schema=text, field="guided_json"))
    if req.guided_regex is not None:
        out.append(engine_pb2.StructuredOutput(regex=req.guided_regex, field="guided_regex"))
    if req.guided_choice is not None:
        out.append(engine_pb2.StructuredOutput(choice=engine_pb2.StringList(values=req.guided_choice),
                                               field="guided_choice"))
    if req.guided_grammar is not None:
        out.append(engine_pb2.StructuredOutput(grammar=req.guided_grammar, field="guided_grammar"))
    return out


def structured_output(req: _SamplingFields, tool_grammar: str | None = None) -> engine_pb2.StructuredOutput | None:
    """The request's constraint, checked (None: free text). ``tool_grammar`` is the Lark grammar of
    a forced tool call (``tool_choice`` ``required`` or a named function; see
    :mod:`xllm.gateway.openai.tools`). Raises a 400 naming the offending field."""
    found = _candidates(req)
    if tool_grammar is not None:
        found.insert(0, engine_pb2.StructuredOutput(grammar=tool_grammar, field="tool_choice"))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"{found[1].field} cannot be combined with {found[0].field}: a request takes one "
                          f"output constraint", found[1].field)
    msg = found[0]
    try:
        check(msg)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    return msg


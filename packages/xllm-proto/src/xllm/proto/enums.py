"""The names protobuf enum values have outside the wire: in the OpenAI API, metrics and logs.

Hand-written (not generated): the one table each of these names lives in.
"""

from __future__ import annotations

from xllm.proto.engine.v1 import engine_pb2

FINISH_REASON_NAMES: dict[int, str] = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
    engine_pb2.FINISH_REASON_ERROR: "error",
}


def finish_reason_name(code: int) -> str | None:
    """``"stop"``, ``"length"``, ``"abort"`` or ``"error"``; None for ``FINISH_REASON_UNSPECIFIED``
    (the request is still running). A value this version does not know (a newer engine) reads as
    ``"stop"``: the request ended."""
    if code == engine_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return FINISH_REASON_NAMES.get(code, "stop")

"""The names protobuf enum values have outside the wire: in the OpenAI API, metrics and logs.

Hand-written (not generated): the one table each of these names lives in.
"""

from __future__ import annotations

from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2

FINISH_REASON_NAMES: dict[int, str] = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
    engine_pb2.FINISH_REASON_ERROR: "error",
    engine_pb2.FINISH_REASON_HANDED_OFF: "handed_off",  # prefill side only: the decode instance continues
}

ROLE_NAMES: dict[int, str] = {
    instance_pb2.INSTANCE_ROLE_MIXED: "mixed",
    instance_pb2.INSTANCE_ROLE_PREFILL: "prefill",
    instance_pb2.INSTANCE_ROLE_DECODE: "decode",
    instance_pb2.INSTANCE_ROLE_ENCODE: "encode",  # EPD: images only (EngineService.Encode)
}


def finish_reason_name(code: int) -> str | None:
    """``"stop"``, ``"length"``, ``"abort"`` or ``"error"``; None for ``FINISH_REASON_UNSPECIFIED``
    (the request is still running). A value this version does not know (a newer engine) reads as
    ``"stop"``: the request ended."""
    if code == engine_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return FINISH_REASON_NAMES.get(code, "stop")


def role_name(role: int) -> str:
    """``"mixed"``, ``"prefill"``, ``"decode"`` or ``"encode"``; an unset role is a mixed instance."""
    return ROLE_NAMES.get(role, "mixed")


def role_from_name(name: str) -> int:
    """The ``InstanceRole`` called ``name``; ``ValueError`` names the known ones."""
    for value, known in ROLE_NAMES.items():
        if known == name:
            return value
    raise ValueError(f"unknown instance role {name!r}; known: {', '.join(ROLE_NAMES.values())}")

"""What crosses the wire besides the protobuf messages: metadata keys and the one mapping
between engine errors and gRPC statuses (the server maps errors to statuses with
:func:`status_for`, the client maps them back with :func:`error_from_status`).

``Generate`` accepts or rejects before it streams: a rejected request ends with a status and no
message; an accepted one first sends the initial metadata ``xllm-accepted: 1``.

============================  ==================  =======================================
engine error                  gRPC status         client side
============================  ==================  =======================================
``InvalidRequestError``       INVALID_ARGUMENT    ``InvalidRequestError``; the offending
                                                  parameter in ``xllm-error-param``
``EngineOverloadedError``     RESOURCE_EXHAUSTED  ``EngineOverloadedError``
``EngineDeadError`` (other)   UNAVAILABLE         ``InstanceUnavailableError``
draining                      UNAVAILABLE         ``InstanceUnavailableError``;
                                                  ``xllm-draining: 1``
handed back at shutdown       UNAVAILABLE         ``InstanceUnavailableError(handed_back)``;
                                                  ``xllm-handed-back: 1``
============================  ==================  =======================================

Any other status, and transport failures, also read as :class:`InstanceUnavailableError`:
"this instance cannot take or continue the request; another one may".
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from xllm.core.errors import EngineDeadError, EngineError, EngineOverloadedError, InvalidRequestError

ACCEPTED_KEY = "xllm-accepted"
ERROR_PARAM_KEY = "xllm-error-param"
DRAINING_KEY = "xllm-draining"
HANDED_BACK_KEY = "xllm-handed-back"

Metadata = tuple[tuple[str, str], ...]


class InstanceUnavailableError(EngineDeadError):
    """A remote instance cannot take or continue a request: unreachable, draining, or it
    handed the request back while shutting down. The request may go to another instance."""

    def __init__(self, message: str, instance_id: str = "", handed_back: bool = False) -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.handed_back = handed_back


@dataclass(frozen=True)
class Status:
    """A gRPC status to end a call with."""

    code: grpc.StatusCode
    details: str
    trailing: Metadata = ()


DRAINING = Status(grpc.StatusCode.UNAVAILABLE, "instance is draining", ((DRAINING_KEY, "1"),))
HANDED_BACK = Status(grpc.StatusCode.UNAVAILABLE, "instance shut down; request handed back",
                     ((HANDED_BACK_KEY, "1"),))


def status_for(exc: EngineError) -> Status:
    """The status a server ends a call with when the engine raised ``exc``."""
    if isinstance(exc, InvalidRequestError):
        return Status(grpc.StatusCode.INVALID_ARGUMENT, str(exc), ((ERROR_PARAM_KEY, exc.param or ""),))
    if isinstance(exc, EngineOverloadedError):
        return Status(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    return Status(grpc.StatusCode.UNAVAILABLE, str(exc))


def error_from_status(code: grpc.StatusCode, details: str | None, trailing: Metadata | None = None,
                      instance_id: str = "") -> EngineError:
    """The engine error a failed call of instance ``instance_id`` stands for (the inverse of
    :func:`status_for`)."""
    meta = dict(trailing or ())
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details or code.name.lower(), meta.get(ERROR_PARAM_KEY) or None)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return EngineOverloadedError(details or code.name.lower())
    if HANDED_BACK_KEY in meta:
        why = "handed the request back"
    elif DRAINING_KEY in meta:
        why = "is draining"
    else:
        why = f"is unavailable ({code.name}: {details})"
    return InstanceUnavailableError(f"instance {instance_id} {why}", instance_id, HANDED_BACK_KEY in meta)

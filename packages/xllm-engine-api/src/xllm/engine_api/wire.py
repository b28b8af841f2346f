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
                              ``xllm-overloaded``
``EngineCrashedError``        UNAVAILABLE         ``InstanceUnavailableError(crashed,
                              ``xllm-crashed:``   suspect)``: the engine loop crashed;
                              suspect|bystander   suspect = the request was in the step
``EngineDeadError`` (other)   UNAVAILABLE         ``InstanceUnavailableError``
draining                      UNAVAILABLE         ``InstanceUnavailableError``;
                                                  ``xllm-draining: 1``
handed back at shutdown       UNAVAILABLE         ``InstanceUnavailableError(handed_back)``;
                                                  ``xllm-handed-back: 1``
wrong/missing cluster token   UNAUTHENTICATED     ``ClusterAuthError`` (a configuration
(``xllm.engine_api.security``)    (PERMISSION_DENIED) error: not retried elsewhere)
============================  ==================  =======================================

Transport failures (UNAVAILABLE without our metadata: the process or the network went away, or a
deadline/idle timeout) also read as :class:`InstanceUnavailableError`: "this instance cannot take or
continue the request; another one may" — marked ``crashed`` and ``suspect``, since the request may be
what killed it. A status the server did not choose for a reason of ours is a fault of the request,
not of the instance: RESOURCE_EXHAUSTED without ``xllm-overloaded`` (a message over the engine's size
bound for its kind, refused unparsed: :mod:`xllm.engine.intake`) reads as ``InvalidRequestError``;
INTERNAL, UNKNOWN and the rest as :class:`RequestFailedError` (answered 500, never replayed on
another instance).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from xllm.engine_api.errors import (
    EngineCrashedError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)

ACCEPTED_KEY = "xllm-accepted"
ERROR_PARAM_KEY = "xllm-error-param"
DRAINING_KEY = "xllm-draining"
HANDED_BACK_KEY = "xllm-handed-back"
OVERLOADED_KEY = "xllm-overloaded"
CRASHED_KEY = "xllm-crashed"  # "suspect" (the request was in the step that crashed) or "bystander"
REQUEST_FAILED_KEY = "xllm-request-failed"

Metadata = tuple[tuple[str, str], ...]


class ClusterAuthError(EngineError):
    """A remote service refused this process's credentials (``UNAUTHENTICATED``/``PERMISSION_DENIED``:
    the cluster tokens differ). A configuration error, not a dead instance: the instance is up, and
    another instance would most likely refuse too, so the request is not moved elsewhere."""

    def __init__(self, message: str, instance_id: str = "") -> None:
        super().__init__(message)
        self.instance_id = instance_id


class InstanceUnavailableError(EngineDeadError):
    """A remote instance cannot take or continue a request: unreachable, draining, or it
    handed the request back while shutting down. The request may go to another instance.

    ``crashed``: the instance failed while running it (its engine loop crashed, or it vanished);
    ``suspect``: the request may be the cause (it was in the crashing step, or nobody can tell). A
    gateway fails a request that was a suspect in too many crashes instead of replaying it."""

    def __init__(self, message: str, instance_id: str = "", handed_back: bool = False, crashed: bool = False,
                 suspect: bool = False) -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.handed_back = handed_back
        self.crashed = crashed
        self.suspect = suspect


class RequestFailedError(EngineError):
    """The instance failed this request for a reason of its own (an unexpected server error): a
    fault of the request, answered as an internal error and not replayed elsewhere."""


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
        return Status(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), ((OVERLOADED_KEY, "1"),))
    if isinstance(exc, RequestFailedError):
        return Status(grpc.StatusCode.INTERNAL, str(exc), ((REQUEST_FAILED_KEY, "1"),))
    if isinstance(exc, EngineCrashedError):
        role = "suspect" if exc.suspect else "bystander"
        return Status(grpc.StatusCode.UNAVAILABLE, str(exc), ((CRASHED_KEY, role),))
    return Status(grpc.StatusCode.UNAVAILABLE, str(exc))


def error_from_status(code: grpc.StatusCode, details: str | None, trailing: Metadata | None = None,
                      instance_id: str = "", mid_stream: bool = False) -> EngineError:
    """The engine error a failed call of instance ``instance_id`` stands for (the inverse of
    :func:`status_for`). ``mid_stream``: the call had been accepted and was streaming, so a
    transport failure means the instance failed while running the request."""
    meta = dict(trailing or ())
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details or code.name.lower(), meta.get(ERROR_PARAM_KEY) or None)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if OVERLOADED_KEY in meta:
            return EngineOverloadedError(details or code.name.lower())
        return InvalidRequestError(f"the request is too large for the engine service ({details})", "prompt")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return ClusterAuthError(f"instance {instance_id} refused this process's credentials ({code.name}: {details}); "
                                "check that every engine and gateway has the same --cluster-token", instance_id)
    if REQUEST_FAILED_KEY in meta or code == grpc.StatusCode.UNKNOWN:  # an exception in the server's handler
        return RequestFailedError(f"instance {instance_id} failed the request ({code.name}: {details})")
    if HANDED_BACK_KEY in meta:
        return InstanceUnavailableError(f"instance {instance_id} handed the request back", instance_id,
                                        handed_back=True)
    if DRAINING_KEY in meta:
        return InstanceUnavailableError(f"instance {instance_id} is draining", instance_id)
    if CRASHED_KEY in meta:
        return InstanceUnavailableError(f"instance {instance_id} crashed ({details})", instance_id, crashed=True,
                                        suspect=meta[CRASHED_KEY] == "suspect")
    # the process, the connection or a deadline failed; mid-stream nobody can tell whether the request caused it
    return InstanceUnavailableError(f"instance {instance_id} is unavailable ({code.name}: {details})", instance_id,
                                    crashed=mid_stream, suspect=mid_stream)

"""How the gateway talks to an engine instance: one interface, in-process or remote.

The data crossing this boundary are the ``xllm.engine.v1`` protobuf messages,
whether the engine runs in this process (:class:`InProcessEngineClient`) or
behind gRPC in another process.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Protocol

from xllm.core import AsyncEngine
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2


class EngineClient(Protocol):
    """An engine instance as the gateway sees it.

    ``submit`` validates and queues synchronously, raising
    ``InvalidRequestError``/``EngineOverloadedError``/``EngineDeadError`` before
    any chunk is produced; iterating the result yields the request's chunks and
    stops after the final one; leaving the iteration early aborts the request.
    """

    info: instance_pb2.InstanceInfo

    def submit(self, req: engine_pb2.GenerateRequest) -> AsyncIterable[engine_pb2.GenerateResponse]: ...

    async def abort(self, request_id: str) -> None: ...

    async def health(self) -> engine_pb2.HealthResponse: ...

    async def load(self) -> instance_pb2.LoadReport: ...


class InProcessEngineClient:
    """An :class:`~xllm.core.AsyncEngine` in this process."""

    def __init__(self, engine: AsyncEngine, info: instance_pb2.InstanceInfo) -> None:
        self.engine = engine
        self.info = info

    def submit(self, req: engine_pb2.GenerateRequest) -> AsyncIterable[engine_pb2.GenerateResponse]:
        return self.engine.submit(req)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def health(self) -> engine_pb2.HealthResponse:
        ok = self.engine.is_running
        return engine_pb2.HealthResponse(healthy=ok, status="ok" if ok else (self.engine.dead_reason or "stopped"))

    async def load(self) -> instance_pb2.LoadReport:
        return self.engine.load_report()

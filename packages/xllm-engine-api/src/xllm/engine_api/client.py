"""The client side of ``xllm.engine.v1.EngineService``: how a gateway talks to an engine instance.

One contract (:class:`EngineClient`), two implementations: :class:`GrpcEngineClient` for an
instance in another process, :class:`xllm.engine.inprocess.InProcessEngineClient` for one in
this process. The data crossing the boundary are the ``xllm.engine.v1`` protobuf messages either
way. This module imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from xllm.engine_api.credential import new_nonce, proven
from xllm.engine_api.security import NO_SECURITY, ClusterSecurity, open_channel
from xllm.engine_api.tracing import TraceCarrier
from xllm.engine_api.wire import ACCEPTED_KEY, ClusterAuthError, InstanceUnavailableError, error_from_status
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc
from xllm.proto.kvstore.v1 import kv_events_pb2
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)
CONTROL_TIMEOUT_S = 1800.0  # EngineService.Control: a sleep or weight update drains the engine first


class EngineClient(Protocol):
    """An engine instance as the gateway sees it.

    ``await submit(req)`` validates and queues, raising ``InvalidRequestError`` /
    ``EngineOverloadedError`` / ``EngineDeadError`` (``InstanceUnavailableError`` when another
    instance could take it) before any chunk is produced; iterating the result yields the
    request's chunks and stops after the final one; leaving the iteration early aborts the
    request.
    """

    info: instance_pb2.InstanceInfo

    async def submit(self, req: engine_pb2.GenerateRequest,
                     trace: TraceCarrier | None = None) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """``trace``: the W3C context of the caller's span for this call (:mod:`xllm.engine_api.tracing`);
        the instance's spans of the request become its children."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def migrate(self, request_id: str, target: engine_pb2.KVTarget,
                      num_tokens: int) -> engine_pb2.MigrateResponse:
        """Move the running request ``request_id`` to the reservation ``target`` made for its first
        ``num_tokens`` tokens on another instance (raises ``InstanceUnavailableError``)."""
        ...

    async def health(self) -> engine_pb2.HealthResponse: ...

    async def load_lora(self, name: str, path: str) -> engine_pb2.LoadLoraResponse:
        """Load the LoRA adapter in the instance host's directory ``path`` as ``name`` (``path`` "": unload it);
        a refusal is ``ok`` false with its reason (raises ``InstanceUnavailableError``)."""
        ...

    async def load(self) -> instance_pb2.LoadReport: ...

    async def embed(self, req: engine_pb2.EmbedRequest) -> engine_pb2.EmbedResponse:
        """A prompt's pooled hidden state (raises ``InvalidRequestError`` naming the field, or
        ``InstanceUnavailableError``)."""
        ...

    async def encode(self, req: engine_pb2.EncodeRequest, timeout: float) -> engine_pb2.EncodeResponse:
        """Images through the vision tower (an encode instance's ``EngineService.Encode``) within ``timeout``
        seconds (raises ``InvalidRequestError`` naming the field, or ``InstanceUnavailableError``: unreachable,
        died or late)."""
        ...

    async def control(self, req: engine_pb2.ControlRequest) -> engine_pb2.ControlResponse:
        """Sleep, wake, update the weights or ask whether it sleeps (``EngineService.Control``); a refusal is
        ``ok`` false with its reason (raises ``InstanceUnavailableError``)."""
        ...

    async def kv_events(self, since_version: int, epoch: int, snapshot: bool = False) -> kv_events_pb2.KVCacheEvents:
        """The instance's prefix-cache changes since ``since_version`` of ``epoch`` (a delta), or
        everything it holds (``snapshot``); raises ``InstanceUnavailableError``."""
        ...

    async def close(self) -> None:
        """Release connections (the instance itself keeps running)."""
        ...


class RemoteStream:
    """The chunks of one remote request; leaving early cancels the call and sends ``Abort`` (an
    explicit abort: the engine does not keep the request for a reattach, see ``EngineService.Reattach``)."""

    def __init__(self, call, client: GrpcEngineClient, request_id: str) -> None:
        self._call = call
        self._client = client
        self.request_id = request_id
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        instance_id = self._client.info.instance_id
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(self._call.read(), self._client.stream_idle_timeout)
                except TimeoutError:
                    self.finished = True
                    self._leave()
                    raise InstanceUnavailableError(
                        f"instance {instance_id} sent nothing for {self._client.stream_idle_timeout:g} s",
                        instance_id, crashed=True, suspect=True) from None
                except grpc.aio.AioRpcError as exc:
                    self.finished = True
                    raise error_from_status(exc.code(), exc.details(), exc.trailing_metadata(), instance_id,
                                            mid_stream=True) from None
                if chunk is grpc.aio.EOF:
                    self.finished = True
                    code = await self._call.code()
                    if code != grpc.StatusCode.OK:
                        raise error_from_status(code, await self._call.details(),
                                                await self._call.trailing_metadata(), instance_id, mid_stream=True)
                    raise InstanceUnavailableError(  # the stream ended without its final chunk
                        f"instance {instance_id} ended the stream early", instance_id, crashed=True, suspect=True)
                if chunk.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                    self.finished = True
                yield chunk
                if self.finished:
                    return
        finally:
            if not self.finished:
                self._leave()

    def release(self) -> None:
        """Give the stream up unread without an ``Abort`` (a reattached request is then detached again,
        for another ``Reattach``)."""
        self.finished = True
        self._call.cancel()

    def _leave(self) -> None:
        """Cancel the call and abort the request (in the background: this may run while a generator closes)."""
        self._call.cancel()
        try:
            task = asyncio.get_running_loop().create_task(self._client.abort(self.request_id))
        except RuntimeError:  # no running loop (interpreter shutdown): the engine's grace period ends it
            return
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)


_BACKGROUND: set[asyncio.Task] = set()  # abort calls under way (referenced until done)
_REATTACH_REFUSALS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE)


class GrpcEngineClient:
    """An instance serving ``xllm.engine.v1.EngineService`` at ``info.address``.

    The channel is created on first use (inside the caller's event loop), with the per-call proofs
    and TLS of ``security`` (:func:`xllm.engine_api.security.open_channel`). With a cluster token,
    nothing is sent to the instance before it has proven that it holds the credential too: the first
    call (of any kind) is preceded by ``Prove`` with a fresh nonce, whose answer must be
    ``HMAC(prove key, nonce || info.instance_id || info.address)`` (:mod:`xllm.engine_api.credential`).
    An instance that fails to prove itself gets nothing, and the call raises :class:`ClusterAuthError`
    (counted in ``prove_failures``); the next call challenges it again.
    """

    def __init__(self, info: instance_pb2.InstanceInfo, rpc_timeout: float = 5.0,
                 security: ClusterSecurity = NO_SECURITY, stream_idle_timeout: float | None = 300.0,
                 request_deadline: float | None = None) -> None:
        """``rpc_timeout``: deadline of the unary calls; ``stream_idle_timeout``: longest wait for a
        request's next chunk (its first one included: queueing counts) before the instance is taken
        for hung and the request moved elsewhere (``InstanceUnavailableError``); ``request_deadline``:
        a deadline on the whole ``Generate`` call (None: none). The instance's answer to accept or
        reject a request is awaited at most ``stream_idle_timeout`` too."""
        if not info.address:
            raise ValueError(f"instance {info.instance_id} has no address")
        self.info = info
        self.rpc_timeout = rpc_timeout
        self.stream_idle_timeout = stream_idle_timeout
        self.request_deadline = request_deadline
        self.security = security
        self._channel: grpc.aio.Channel | None = None
        self._stub: engine_pb2_grpc.EngineServiceStub | None = None
        self._proven = not security.keys  # nothing to prove without a credential
        self._proving: asyncio.Lock | None = None
        self.prove_failures = 0

    async def _ready(self) -> engine_pb2_grpc.EngineServiceStub:
        """The stub, once the instance has proven it holds the cluster credential (see the class doc)."""
        stub = self._get_stub()
        if self._proven:
            return stub
        if self._proving is None:
            self._proving = asyncio.Lock()
        async with self._proving:
            if not self._proven:
                await self._prove(stub)
        return stub

    async def _prove(self, stub: engine_pb2_grpc.EngineServiceStub) -> None:
        iid, address = self.info.instance_id, self.info.address
        nonce = new_nonce()
        try:
            answer = await stub.Prove(engine_pb2.ProveRequest(nonce=nonce), timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise self._unavailable(exc) from None
            answer = None  # UNIMPLEMENTED and the like: not one of ours
        if (answer is None or answer.instance_id != iid or answer.address != address
                or not proven(self.security.keys, nonce, iid, address, answer.mac)):
            self.prove_failures += 1
            log.warning("instance %s at %s did not prove it holds the cluster credential: nothing is sent to it",
                        iid, address)
            raise ClusterAuthError(f"instance {iid} at {address} did not prove it holds the cluster credential "
                                   "(a stranger at a registered address, or a different --cluster-token)", iid)
        self._proven = True

    def _get_stub(self) -> engine_pb2_grpc.EngineServiceStub:
        if self._stub is None:
            self._channel = open_channel(self.info.address, self.security, options=[
                ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2_000),
                ("grpc.enable_retries", 0)])
            self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        return self._stub

    def _unavailable(self, exc: grpc.aio.AioRpcError) -> InstanceUnavailableError:
        return InstanceUnavailableError(f"instance {self.info.instance_id}: {exc.details()}", self.info.instance_id)

    async def submit(self, req: engine_pb2.GenerateRequest, trace: TraceCarrier | None = None) -> RemoteStream:
        """Send ``req``; ``trace`` goes as the call's metadata (``traceparent``, ``tracestate``)."""
        stub = await self._ready()  # InstanceUnavailableError (unreachable), ClusterAuthError (no proof)
        call = stub.Generate(req, timeout=self.request_deadline, metadata=tuple(trace.items()) if trace else None)
        return await self._accepted(call, req.request_id)

    async def reattach(self, request_id: str, from_token: int) -> RemoteStream:
        """Continue the detached request ``request_id`` (its gateway died mid-stream) from output token
        ``from_token`` (a chunk boundary): its chunks from there on (``EngineService.Reattach``). Raises
        ``InstanceUnavailableError``, ``ClusterAuthError``, or ``LookupError`` when the instance refuses
        (no such detached request, still attached to a call, not a chunk boundary)."""
        stub = await self._ready()
        req = engine_pb2.ReattachRequest(request_id=request_id, from_token=from_token)
        call = stub.Reattach(req, timeout=self.request_deadline)
        try:
            return await self._accepted(call, request_id)
        except Exception as exc:  # refusals arrive as the status of an unaccepted call
            if call.done() and await call.code() in _REATTACH_REFUSALS:
                raise LookupError(f"instance {self.info.instance_id}: {await call.details()}") from exc
            raise

    async def _accepted(self, call, request_id: str) -> RemoteStream:
        """The stream of a ``Generate``/``Reattach`` call once the instance accepted it (raises its refusal)."""
        try:
            metadata = await asyncio.wait_for(call.initial_metadata(), self.stream_idle_timeout)
        except TimeoutError:
            call.cancel()
            raise InstanceUnavailableError(f"instance {self.info.instance_id} did not accept or reject the request "
                                           f"within {self.stream_idle_timeout:g} s", self.info.instance_id) from None
        except grpc.aio.AioRpcError as exc:
            raise error_from_status(exc.code(), exc.details(), exc.trailing_metadata(),
                                    self.info.instance_id) from None
        if dict(metadata or ()).get(ACCEPTED_KEY) != "1":
            code = await call.code()
            raise error_from_status(code, await call.details(), await call.trailing_metadata(), self.info.instance_id)
        return RemoteStream(call, self, request_id)

    async def _unary(self, method: str, req, timeout: float | None = None):
        """One unary call after the proof. Raises ``InstanceUnavailableError`` when the instance is
        unreachable, fails its proof, or the channel was closed under the call (the instance left the
        registry while the call was in flight: grpc then cancels the call locally, which must not read
        as the caller's own cancellation)."""
        try:
            return await self._call(method, req, timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._unavailable(exc) from None
        except ClusterAuthError as exc:
            raise InstanceUnavailableError(str(exc), self.info.instance_id) from None

    async def _call(self, method: str, req, timeout: float | None = None):
        """:meth:`_unary` with the call's own ``AioRpcError`` and ``ClusterAuthError`` left as they are
        (``timeout``: the deadline, ``rpc_timeout`` by default)."""
        try:
            stub = await self._ready()
            return await getattr(stub, method)(req, timeout=timeout or self.rpc_timeout)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller is being cancelled
            raise InstanceUnavailableError(f"instance {self.info.instance_id}: its connection was closed",
                                           self.info.instance_id) from None

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(asyncio.TimeoutError, InstanceUnavailableError):
            await self._unary("Abort", engine_pb2.AbortRequest(request_id=request_id))

    async def migrate(self, request_id: str, target: engine_pb2.KVTarget,
                      num_tokens: int) -> engine_pb2.MigrateResponse:
        req = engine_pb2.MigrateRequest(request_id=request_id, kv_target=target, num_tokens=num_tokens)
        return await self._unary("Migrate", req)

    async def health(self) -> engine_pb2.HealthResponse:
        """The instance's health; an unreachable (status ``unreachable: CODE``), closed or unproven instance
        reads as unhealthy."""
        try:
            return await self._call("Health", engine_pb2.HealthRequest())
        except grpc.aio.AioRpcError as exc:
            return engine_pb2.HealthResponse(healthy=False, status=f"unreachable: {exc.code().name}")
        except (InstanceUnavailableError, ClusterAuthError) as exc:
            return engine_pb2.HealthResponse(healthy=False, status=str(exc))

    async def load(self) -> instance_pb2.LoadReport:
        return await self._unary("GetLoad", engine_pb2.GetLoadRequest())

    async def load_lora(self, name: str, path: str) -> engine_pb2.LoadLoraResponse:
        return await self._unary("LoadLora", engine_pb2.LoadLoraRequest(lora_name=name, lora_path=path))

    async def control(self, req: engine_pb2.ControlRequest) -> engine_pb2.ControlResponse:
        # draining and reading weights take as long as the requests in flight and the weights' size
        return await self._unary("Control", req, CONTROL_TIMEOUT_S)

    async def embed(self, req: engine_pb2.EmbedRequest) -> engine_pb2.EmbedResponse:
        try:
            return await self._call("Embed", req)
        except grpc.aio.AioRpcError as exc:
            raise error_from_status(exc.code(), exc.details(), exc.trailing_metadata(),
                                    self.info.instance_id) from None

    async def encode(self, req: engine_pb2.EncodeRequest, timeout: float) -> engine_pb2.EncodeResponse:
        try:
            return await self._call("Encode", req, timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise InstanceUnavailableError(f"instance {self.info.instance_id}: no embeddings within {timeout:g} s",
                                               self.info.instance_id) from None
            raise error_from_status(exc.code(), exc.details(), exc.trailing_metadata(),
                                    self.info.instance_id) from None
        except ClusterAuthError as exc:
            raise InstanceUnavailableError(str(exc), self.info.instance_id) from None

    async def kv_events(self, since_version: int, epoch: int, snapshot: bool = False) -> kv_events_pb2.KVCacheEvents:
        req = engine_pb2.GetKVEventsRequest(since_version=since_version, epoch=epoch, snapshot=snapshot)
        return await self._unary("GetKVEvents", req)

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            self._proven = not self.security.keys
            await channel.close()

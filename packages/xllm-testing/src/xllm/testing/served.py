"""Engines served over loopback gRPC inside the test process, and the prefill/decode hand-off as a
gateway drives it (for tests of the engine service and of the gateway's dispatch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xllm.core import AsyncEngine, LLMEngine
from xllm.engine.handoff.base import HandoffOptions
from xllm.engine.server import EngineServer
from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.registration.agent import InstanceAgent
from xllm.engine_api.registration.embedded import LeaseTable
from xllm.engine_api.security import NO_SECURITY, ClusterSecurity
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.enums import role_from_name
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.engine import Collected, make_request
from xllm.testing.registry import LocalPublisher

PREFILL, DECODE = engine_pb2.DISAGG_PHASE_PREFILL, engine_pb2.DISAGG_PHASE_DECODE
HANDED_OFF = engine_pb2.FINISH_REASON_HANDED_OFF


class ServedEngine:
    """One :class:`LLMEngine` behind an :class:`EngineServer` on 127.0.0.1 (a free port), with a
    client to it; registered (heartbeats every 50 ms) when started with a lease table. ``security``:
    the cluster token and TLS the server requires and its client presents; ``step_timeout``: the step
    watchdog's floor (0: none)."""

    def __init__(self, engine: LLMEngine, *, role: str = "mixed", model: str = "tiny",
                 handoff: HandoffOptions | None = None, security: ClusterSecurity = NO_SECURITY,
                 step_timeout: float = 60.0) -> None:
        self.engine = engine
        self.aeng = AsyncEngine(engine)
        self.security = security
        self.server = EngineServer(self.aeng, handoff=handoff, security=security, stall_timeout=step_timeout)
        self.info = instance_pb2.InstanceInfo(
            instance_id=engine.instance_id, role=role_from_name(role),
            model=instance_pb2.ModelInfo(served_name=model, max_model_len=engine.max_model_len,
                                         block_size=engine.layout.block_size))
        self.client: GrpcEngineClient | None = None
        self.agent: InstanceAgent | None = None

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    async def start(self, leases: LeaseTable | None = None) -> ServedEngine:
        self.aeng.start()
        port = await self.server.start("127.0.0.1", 0)
        self.info.address = f"127.0.0.1:{port}"
        self.client = GrpcEngineClient(self.info, security=self.security)
        if leases is not None:
            self.agent = InstanceAgent(self.server, self.info, LocalPublisher(leases), interval=0.05)
            await self.agent.start()
        return self

    async def stop(self) -> None:
        """Stop serving (idempotent): what a dead instance looks like to its peers. It drains first
        (for 0 s), so its running requests are handed back or offered as moves."""
        if self.aeng.is_running:
            await self._leave()
            await self.server.drain(0)
            await self._close()

    async def kill(self) -> None:
        """Die as a crashed process does (idempotent): the calls break mid-stream, with no hand-back
        and no move offer."""
        if self.aeng.is_running:
            await self._leave()
            await self._close()

    async def _leave(self) -> None:
        if self.agent is not None:
            await self.agent.stop()
        if self.client is not None:
            await self.client.close()

    async def _close(self) -> None:
        await self.server.stop(0)
        self.aeng.shutdown()
        self.engine.close()


class ServedEngines:
    """One :class:`ServedEngine` per ``roles`` entry (instance id -> role), each over a fresh engine from
    ``make_engine`` with KV hand-offs over ``transport``: started together (registered with ``leases``)
    and stopped together. ``nodes`` maps instance ids to them."""

    def __init__(self, roles: dict[str, str], make_engine: Callable[[], LLMEngine], transport: str,
                 model: str = "tiny") -> None:
        self.nodes: dict[str, ServedEngine] = {}
        for iid, role in roles.items():
            engine = make_engine()
            engine.instance_id = iid
            self.nodes[iid] = ServedEngine(engine, role=role, model=model, handoff=HandoffOptions(transport=transport))

    async def start(self, leases: LeaseTable) -> None:
        for node in self.nodes.values():
            await node.start(leases)

    async def stop(self) -> None:
        for node in self.nodes.values():
            await node.stop()


def pd_request(rid: str, phase: int, prompt: list[int], target: engine_pb2.KVTarget | None = None,
               images: Sequence[engine_pb2.ImageInput] = (), **sampling) -> engine_pb2.GenerateRequest:
    """:func:`~xllm.testing.engine.make_request` for one phase of a hand-off (to ``target``), with ``images``."""
    req = make_request(rid, prompt, **sampling)
    req.disagg_phase = phase
    req.images.extend(images)
    if target is not None:
        req.kv_target.CopyFrom(target)
    return req


async def pd_generate(prefill: ServedEngine, decode: ServedEngine, rid: str, prompt: list[int],
                      images: Sequence[engine_pb2.ImageInput] = (), **sampling
                      ) -> tuple[Collected, engine_pb2.KVTarget, engine_pb2.DisaggStats | None]:
    """What a gateway does: reserve on the decode side, prefill with its target, stream both (each side gets the
    request's ``images``). Returns the client's view, the reservation and the decode side's hand-off stats
    (``None`` when the request ended on the prefill side)."""
    d_stream = aiter(await decode.client.submit(pd_request(rid, DECODE, prompt, images=images, **sampling)))
    reservation = (await anext(d_stream)).kv_reservation
    got, stats = Collected(), None
    async for chunk in await prefill.client.submit(pd_request(rid, PREFILL, prompt, reservation, images=images,
                                                              **sampling)):
        if chunk.finish_reason == HANDED_OFF:
            break
        got.add([chunk])
    if rid in got.final:
        await d_stream.aclose()
        return got, reservation, None
    async for chunk in d_stream:
        if chunk.HasField("disagg_stats") and stats is None:
            stats = chunk.disagg_stats
        got.add([chunk])
    return got, reservation, stats


def corrupt_grpc_pages(monkeypatch, page_range: int, offset: int = 100) -> None:
    """Make the grpc KV transport flip one byte (at ``offset``) of every ``KVPages`` message of range ``page_range``
    on the wire, after its CRC was taken (``monkeypatch``: pytest's, undone with the test)."""
    from xllm.engine.handoff import grpc as grpc_transport

    real = grpc_transport.TransferChannels.transfer

    async def corrupting_transfer(self, address, messages, timeout):
        async def flipped():
            async for message in messages:
                if message.HasField("pages") and message.pages.range == page_range:
                    data = bytearray(message.pages.data)
                    data[offset] ^= 0xFF
                    message.pages.data = bytes(data)
                yield message

        return await real(self, address, flipped(), timeout)

    monkeypatch.setattr(grpc_transport.TransferChannels, "transfer", corrupting_transfer)

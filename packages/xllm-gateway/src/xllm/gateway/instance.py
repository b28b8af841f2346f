"""One engine instance as a process: ``xllm engine``.

Composition (the gateway package is the composition root; core never imports models): load
the model with :mod:`xllm.models`, build the :class:`~xllm.core.LLMEngine`, serve it with
core's :class:`~xllm.core.grpc_server.EngineServer`, and keep it registered with an
:class:`~xllm.gateway.registry.publisher.InstanceAgent` (etcd or a gateway's embedded
registry). On SIGTERM/SIGINT (or when the parent process goes away, with
``--exit-with-parent``) it shuts down gracefully: deregister first (gateways stop sending new
requests at once), refuse late arrivals, let running requests finish for up to the drain time,
hand the rest back to their gateways (which resume them elsewhere), then stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass

from xllm.core import AsyncEngine, ComputeThread, EngineConfig, LLMEngine
from xllm.core.grpc_server import EngineServer
from xllm.gateway.engine_loader import load_engine, served_name
from xllm.gateway.registry.publisher import InstanceAgent, Publisher
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)


@dataclass
class InstanceOptions:
    model: str | None = None
    served_model_name: str | None = None
    engine: EngineConfig | None = None
    instance_id: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    advertise_address: str | None = None
    etcd: str | None = None
    etcd_prefix: str = "/xllm"
    registry: str | None = None
    lease_ttl: float = 3.0
    heartbeat_interval: float = 0.5
    drain_timeout: float = 30.0
    exit_with_parent: bool = False
    progress: bool = True


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def build_publisher(opts: InstanceOptions) -> Publisher | None:
    if opts.etcd:
        from xllm.gateway.registry.etcd import EtcdPublisher
        from xllm.gateway.registry.etcd_client import EtcdClient

        return EtcdPublisher(EtcdClient(opts.etcd), opts.etcd_prefix, opts.lease_ttl)
    if opts.registry:
        from xllm.gateway.registry.publisher import GrpcRegistryPublisher

        return GrpcRegistryPublisher(opts.registry, opts.lease_ttl)
    return None


async def serve_instance(engine: LLMEngine, info: instance_pb2.InstanceInfo, opts: InstanceOptions,
                         publisher: Publisher | None = None, stop: asyncio.Event | None = None,
                         compute: ComputeThread | None = None) -> int:
    """Serve ``engine`` until ``stop`` is set (or a signal arrives), then shut down gracefully.

    Returns how many requests were handed back at shutdown.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    aeng = AsyncEngine(engine, compute=compute)
    aeng.start()
    server = EngineServer(aeng)
    agent = None
    watchdog = None
    handed_back = 0
    try:
        port = await server.start(opts.host, opts.port)
        info.address = opts.advertise_address or f"{opts.host}:{port}"
        if publisher is not None:
            agent = InstanceAgent(server, info, publisher, opts.heartbeat_interval)
            await agent.start()
        if opts.exit_with_parent:
            watchdog = loop.create_task(_watch_parent(os.getppid(), stop))
        print(f"xllm engine {info.instance_id} serving {info.model.served_name} on {info.address}", flush=True)
        await stop.wait()
        log.info("instance %s shutting down (drain up to %.0f s)", info.instance_id, opts.drain_timeout)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if agent is not None:
            await agent.stop(deregister=True)
        handed_back = await server.drain(opts.drain_timeout)
        await server.stop(1.0)
        aeng.shutdown()
        engine.close()
        if publisher is not None:
            with contextlib.suppress(Exception):
                await publisher.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
    log.info("instance %s stopped (%d request(s) handed back)", info.instance_id, handed_back)
    return handed_back


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    log.warning("parent process %d is gone; shutting down", parent)
    stop.set()


def run_instance(opts: InstanceOptions) -> int:
    """``xllm engine``: load, serve, shut down gracefully. Returns the exit code."""
    loaded = load_engine(opts.model, served_name(opts.model, opts.served_model_name), opts.engine,
                         opts.instance_id or default_instance_id(), opts.progress)
    publisher = build_publisher(opts)
    asyncio.run(serve_instance(loaded.engine, loaded.info, opts, publisher, compute=loaded.compute))
    loaded.compute.shutdown(wait=False)
    return 0

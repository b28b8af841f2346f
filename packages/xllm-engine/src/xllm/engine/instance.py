"""One engine instance as a process: ``xllm engine`` (or ``python -m xllm.engine``).

Load the model with :mod:`xllm.models` and build the :class:`~xllm.core.LLMEngine`
(:mod:`xllm.engine.loader`), serve it with :class:`~xllm.engine.server.EngineServer`, and keep it
registered with an :class:`~xllm.engine_api.registration.agent.InstanceAgent` (etcd or a gateway's
embedded registry). On SIGTERM/SIGINT (or when the parent process goes away, with
``--exit-with-parent``) it shuts down gracefully: a heartbeat says it drains (gateways stop
sending new requests at once), late arrivals are refused, running requests are offered to their
gateways to move elsewhere (with their KV or by recompute) and the rest may finish for up to the
drain time; what is left is handed back (resumed elsewhere); a last heartbeat carries the final
counters, then it deregisters and stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field

from xllm.core import AsyncEngine, ComputeThread, EngineConfig, LLMEngine
from xllm.core.parallel.comm import CollectiveError
from xllm.engine.config import engine_config, handoff_options
from xllm.engine.handoff.base import HandoffOptions
from xllm.engine.loader import load_engine
from xllm.engine.server import EngineServer
from xllm.engine_api import flags
from xllm.engine_api.errors import ConfigError, EngineCrashedError
from xllm.engine_api.metrics import MetricsEndpoint
from xllm.engine_api.registration.agent import InstanceAgent, Publisher
from xllm.engine_api.registration.etcd import DEFAULT_PREFIX
from xllm.engine_api.security import NO_SECURITY, ClusterSecurity, is_loopback
from xllm.engine_api.tracing import Tracing, TracingOptions, tracing_options
from xllm.models import ModelConfigError, ModelNotFoundError, served_name
from xllm.proto.enums import role_from_name
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
    etcd_prefix: str = DEFAULT_PREFIX
    registry: str | None = None
    lease_ttl: float = 3.0
    heartbeat_interval: float = 0.5
    drain_timeout: float = 30.0
    step_timeout: float = 60.0  # the step watchdog's floor (0: none; xllm.engine.server.EngineServer)
    metrics_port: int | None = None  # the engine's own /metrics (xllm.engine_api.metrics.MetricsEndpoint); None: none
    metrics_host: str = "127.0.0.1"
    detached_grace_s: float = 30.0
    exit_with_parent: bool = False
    progress: bool = True
    role: str = "mixed"
    handoff: HandoffOptions = field(default_factory=HandoffOptions)
    security: ClusterSecurity = NO_SECURITY
    tracing: TracingOptions = field(default_factory=TracingOptions)  # --otlp-traces-* (off by default)


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def build_publisher(opts: InstanceOptions) -> Publisher | None:
    if opts.etcd:
        from xllm.engine_api.registration.etcd import EtcdPublisher
        from xllm.engine_api.registration.etcd_client import EtcdClient

        return EtcdPublisher(EtcdClient(opts.etcd, ssl_context=opts.security.etcd_ssl_context()), opts.etcd_prefix,
                             opts.lease_ttl, security=opts.security)
    if opts.registry:
        from xllm.engine_api.registration.embedded import GrpcRegistryPublisher

        return GrpcRegistryPublisher(opts.registry, opts.lease_ttl, security=opts.security)
    return None


async def serve_instance(engine: LLMEngine, info: instance_pb2.InstanceInfo, opts: InstanceOptions,
                         publisher: Publisher | None = None, stop: asyncio.Event | None = None,
                         compute: ComputeThread | None = None) -> int:
    """Serve ``engine`` until ``stop`` is set (or a signal arrives), then shut down gracefully.

    Returns how many requests were handed back at shutdown; raises ``EngineCrashedError`` (after the
    same shutdown) when the engine loop crashed.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    aeng = AsyncEngine(engine, compute=compute)
    tracing = Tracing(opts.tracing, {"xllm.instance_id": info.instance_id, "xllm.role": opts.role}, roots=False)
    # before the loop starts: it observes every step
    server = EngineServer(aeng, handoff=opts.handoff, security=opts.security, stall_timeout=opts.step_timeout,
                          detached_grace_s=opts.detached_grace_s, tracing=tracing)
    metrics = None
    if opts.metrics_port is not None:
        if not is_loopback(opts.metrics_host):
            log.warning("--metrics-host %s: this engine's /metrics is readable from other machines without "
                        "authentication", opts.metrics_host)
        metrics = MetricsEndpoint(info.model.served_name, info.instance_id, opts.metrics_host, opts.metrics_port)
        aeng.add_observer(metrics.observer)
        print(f"xllm engine {info.instance_id} metrics at {metrics.url}", flush=True)
    aeng.start()
    agent = None
    watchdog = engine_watch = None
    handed_back = 0
    try:
        port = await server.start(opts.host, opts.port, opts.advertise_address)
        info.address = opts.advertise_address or f"{opts.host}:{port}"
        info.role = role_from_name(opts.role)
        if publisher is not None:
            agent = InstanceAgent(server, info, publisher, opts.heartbeat_interval)
            await agent.start()
        if opts.exit_with_parent:
            watchdog = loop.create_task(_watch_parent(os.getppid(), stop))
        engine_watch = loop.create_task(_watch_engine(aeng, stop))
        print(f"xllm engine {info.instance_id} serving {info.model.served_name} on {info.address}", flush=True)
        await stop.wait()
        log.info("instance %s shutting down (drain up to %.0f s)", info.instance_id, opts.drain_timeout)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if engine_watch is not None:
            engine_watch.cancel()
        server.begin_drain()
        if agent is not None:  # registered while draining: gateways stop routing here and move what runs
            with contextlib.suppress(Exception):
                await agent.beat()
        handed_back = await server.drain(opts.drain_timeout)
        if agent is not None:  # the last counters (moves sent or failed here) reach the gateways
            with contextlib.suppress(Exception):
                await agent.beat()
            await agent.stop(deregister=True)
        await server.stop(1.0)
        aeng.shutdown(0.1 if aeng.hung else 10.0)
        if not aeng.hung:  # (a stuck step may still use the engine: the process exits without closing it)
            engine.close()
        if publisher is not None:
            with contextlib.suppress(Exception):
                await publisher.close()
        if metrics is not None:
            metrics.close()
        tracing.shutdown()  # the spans still queued are sent
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
    if aeng.crashed:
        raise EngineCrashedError(aeng.dead_reason or "engine loop crashed", suspect=False)
    log.info("instance %s stopped (%d request(s) handed back)", info.instance_id, handed_back)
    return handed_back


async def _watch_engine(aeng: AsyncEngine, stop: asyncio.Event, interval: float = 0.2) -> None:
    """A crashed engine loop (its streams already failed, each marked suspect or bystander) takes
    the instance down: deregistered and stopped, so no gateway sends it anything again and a
    supervisor can restart it (the process exits with status 1)."""
    while aeng.is_running:
        await asyncio.sleep(interval)
    if not stop.is_set():
        log.error("engine loop is dead (%s); deregistering and stopping", aeng.dead_reason)
        stop.set()


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    log.warning("parent process %d is gone; shutting down", parent)
    stop.set()


def run_instance(opts: InstanceOptions) -> int:
    """Load, serve, shut down gracefully. Returns the exit code."""
    loaded = load_engine(opts.model, served_name(opts.model, opts.served_model_name), opts.engine,
                         opts.instance_id or default_instance_id(), opts.progress)
    publisher = build_publisher(opts)
    try:
        asyncio.run(serve_instance(loaded.engine, loaded.info, opts, publisher, compute=loaded.compute))
    except EngineCrashedError as exc:
        log.error("instance stopped: %s", exc)
        return 1
    finally:
        loaded.compute.shutdown(wait=False)
    return 0


def options(args: argparse.Namespace) -> InstanceOptions:
    """The instance the flags of :func:`xllm.engine_api.flags.add_engine_process_arguments` describe."""
    return InstanceOptions(
        model=args.model, served_model_name=args.served_model_name, engine=engine_config(args),
        instance_id=args.instance_id, host=args.host, port=args.port, advertise_address=args.advertise_address,
        etcd=args.etcd, etcd_prefix=args.etcd_prefix, registry=args.registry, lease_ttl=args.lease_ttl,
        heartbeat_interval=args.heartbeat_interval, drain_timeout=args.drain_timeout, step_timeout=args.step_timeout,
        detached_grace_s=args.detached_grace_s, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        exit_with_parent=args.exit_with_parent, progress=not args.no_progress, role=args.role,
        handoff=handoff_options(args), security=flags.cluster_security(args),
        tracing=tracing_options(args, "xllm-engine"))


def run(args: argparse.Namespace, prog: str = "xllm engine") -> int:
    """Run the instance the parsed flags describe; configuration errors print and return 2."""
    if args.etcd and args.registry:
        print(f"{prog}: error: use --etcd or --registry, not both", file=sys.stderr)
        return 2
    try:
        opts = options(args)
        if opts.engine is not None and opts.engine.node_rank > 0:  # --nnodes: another host's ranks, no service
            from xllm.engine.nodes import run_node

            opts.security.check_files()
            return run_node(opts.model, opts.engine, opts.progress)
        opts.security.check_cluster(opts.etcd, prog)  # --etcd needs a credential or --insecure-cluster
        opts.security.check_bind(opts.host, "the engine service (--host)")  # before the model loads
        opts.security.check_files()
        return run_instance(opts)
    except (ConfigError, ModelNotFoundError, ModelConfigError, ValueError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except CollectiveError as exc:  # the ranks of --tensor-parallel-size could not form their group
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m xllm.engine`` (the same process as ``xllm engine``)."""
    parser = argparse.ArgumentParser(prog="python -m xllm.engine", description=flags.ENGINE_DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags.add_engine_process_arguments(parser)
    args = parser.parse_args(argv)
    flags.setup_logging(args.log_level, args.log_format)
    return run(args, parser.prog)

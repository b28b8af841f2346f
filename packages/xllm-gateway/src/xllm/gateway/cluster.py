"""Composition root for cluster mode: a gateway routing to engine processes.

- ``xllm serve --instances N``: starts N engine processes (``python -m xllm.engine``) on this
  machine. They register with the gateway's embedded registry over gRPC (``RegistryService`` on
  a loopback port), or in etcd with ``--etcd``.
- ``xllm serve --prefill-instances N --decode-instances M``: the same with engines in the prefill
  and decode roles; the gateway routes in PD mode (:mod:`xllm.gateway.disagg`).
- ``xllm serve --etcd HOST:PORT``: joins the engine instances registered in etcd under the
  prefix (started anywhere with ``xllm engine --etcd ...``).

Security (:mod:`xllm.engine_api.security`): the gateway's engine clients and its embedded registry use
the cluster token and TLS of ``ClusterOptions.security``; spawned engines get the token through
their environment (never their command line, which ``ps`` shows) and the TLS flags as arguments.
With the embedded registry and no token given, a random one is made for this run: only this
gateway and its own engines can then call them, even other users of the same machine cannot.

The gateway loads only the tokenizer and ``config.json`` (tokenization and prefix hashing happen
at the front); the engines load the model. Nothing here imports torch (the first use of a GGUF
model converts it once, which does).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.flags import security_args
from xllm.engine_api.registration.embedded import serve_registry
from xllm.engine_api.registration.etcd import DEFAULT_PREFIX
from xllm.engine_api.registration.etcd_client import DEFAULT_WATCH_TIMEOUT, EtcdClient
from xllm.engine_api.security import NO_SECURITY, ClusterSecurity
from xllm.engine_api.tracing import TracingOptions
from xllm.gateway.access import AccessPolicy
from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.encode import EPDOptions
from xllm.gateway.fronts import ModelFront
from xllm.gateway.kv_tier_metrics import KVTierCollector, from_registry
from xllm.gateway.media.intake import MediaIntake
from xllm.gateway.metrics import EngineMetrics, RegistryMetrics
from xllm.gateway.moves import MoveOptions
from xllm.gateway.openai.limits import ApiLimits
from xllm.gateway.openai.tool_parsers import DEFAULT_TOOL_PARSER
from xllm.gateway.progress import StallLimits
from xllm.gateway.registry import EmbeddedRegistry, EtcdRegistry
from xllm.gateway.roles import PDRoleOptions
from xllm.gateway.tracing import gateway_tracing
from xllm.models.config import ModelConfig
from xllm.models.source import gguf_file, resolve_model, served_name
from xllm.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class ClusterOptions:
    model: str | None = None
    served_model_name: str | None = None
    # more models behind this gateway: (model, served name), each with its own tokenizer and engines
    more_models: list[tuple[str | None, str | None]] = field(default_factory=list)
    instances: dict[str, int] = field(default_factory=dict)  # engine processes to start, by role (per model)
    etcd: str | None = None
    etcd_prefix: str = DEFAULT_PREFIX
    etcd_watch_timeout: float = DEFAULT_WATCH_TIMEOUT  # a silent watch counts as dead after this
    engine_idle_timeout: float = 300.0  # an engine silent this long on a request is taken for hung
    request_timeout: float | None = None  # deadline of each Generate call
    routing: str = "kv_aware"
    routing_fallback_ratio: float = 2.0  # --routing-fallback-ratio
    tool_parser: str = DEFAULT_TOOL_PARSER  # the tool-call format (xllm.gateway.openai.tools)
    media: MediaIntake = field(default_factory=MediaIntake)  # image inputs (xllm.gateway.media.intake)
    max_model_len: int | None = None
    engine_args: list[str] = field(default_factory=list)  # extra engine flags (engine config)
    log_level: str = "info"
    drain_timeout: float = 30.0
    progress: bool = True
    log_dir: str | None = None
    limits: ApiLimits = field(default_factory=ApiLimits)  # of the OpenAI API
    access: AccessPolicy = field(default_factory=AccessPolicy)  # API keys, priority permission
    security: ClusterSecurity = NO_SECURITY  # cluster token and TLS of the internal gRPC services
    moves: MoveOptions = field(default_factory=MoveOptions)  # requests on draining instances: migrate or recompute
    stall: StallLimits = field(default_factory=StallLimits)  # streams of stopped instances: broken off, resumed
    pd_roles: PDRoleOptions = field(default_factory=PDRoleOptions)  # static or dynamic PD roles (role flips)
    epd: EPDOptions = field(default_factory=EPDOptions)  # where images are encoded (EPD strategy)
    tracing: TracingOptions = field(default_factory=TracingOptions)  # request traces: the gateway's and its engines'
    log_format: str = "text"  # of the gateway and the engines it starts


class EngineProcesses:
    """Engine processes started by the gateway and stopped with it (``roles``: how many of each, for each of
    ``commands``: (instance id prefix, command) per model). ``env``: variables added to their environment
    (the cluster token)."""

    def __init__(self, roles: dict[str, int], commands: list[tuple[str, list[str]]], log_dir: Path | None = None,
                 stop_timeout: float = 40.0, env: dict[str, str] | None = None) -> None:
        self.roles = roles
        self.commands = commands
        self.env = env or {}
        self.log_dir = log_dir
        self.stop_timeout = stop_timeout
        self.procs: list[subprocess.Popen] = []
        self.names: list[str] = []
        self._reported: set[int] = set()  # pids whose exit was reported
        self._logs: list = []

    def start(self, registry_args: list[str]) -> None:
        for (prefix, base_cmd), role in ((c, r) for c in self.commands for r in self.roles):
            for i in range(self.roles[role]):
                name = prefix + (f"engine-{i}" if role == "mixed" else f"{role}-{i}")
                cmd = [*base_cmd, "--instance-id", name, "--role", role, *registry_args]
                out = None
                if self.log_dir is not None:
                    self.log_dir.mkdir(parents=True, exist_ok=True)
                    out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop())
                    self._logs.append(out)
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT if out else None,
                                        env={**os.environ, **self.env} if self.env else None)
                log.info("started %s (pid %d)", name, proc.pid)
                self.procs.append(proc)
                self.names.append(name)

    def newly_exited(self) -> list[tuple[str, int]]:
        """(instance id, exit status) of the processes that exited since the last call."""
        out = []
        for name, proc in zip(self.names, self.procs, strict=True):
            code = proc.poll()
            if code is not None and proc.pid not in self._reported:
                self._reported.add(proc.pid)
                out.append((name, code))
        return out

    @property
    def all_exited(self) -> bool:
        return bool(self.procs) and all(p.poll() is not None for p in self.procs)

    async def watch(self, fail: Callable[[str], None], interval: float = 1.0) -> None:
        """Until cancelled (the gateway stops them): log each engine process that exits, and ``fail`` the gateway
        once every one has (an engine that cannot start, say its weights are missing, is not waited on forever)."""
        while True:
            await asyncio.sleep(interval)
            for name, code in self.newly_exited():
                where = f"; its log: {self.log_dir / (name + '.log')}" if self.log_dir is not None else ""
                log.error("engine process %s exited with status %d%s", name, code, where)
            if self.all_exited:
                codes = ", ".join(f"{n}: {p.returncode}" for n, p in zip(self.names, self.procs, strict=True))
                fail(f"every engine process this gateway started has exited ({codes}); see their errors above")
                return

    def stop(self) -> None:
        """SIGTERM every child (they drain), SIGKILL what is left after the stop timeout."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0.1))
            if proc.poll() is None:
                log.warning("engine pid %d did not stop in time; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(10)
        for f in self._logs:
            f.close()
        self._logs.clear()


def engine_command(model_dir: str, name: str, opts: ClusterOptions) -> list[str]:
    return [sys.executable, "-m", "xllm.engine", "--model", model_dir, "--served-model-name", name,
            "--host", "127.0.0.1", "--port", "0", "--no-progress", "--exit-with-parent",
            "--drain-timeout", str(opts.drain_timeout), "--log-level", opts.log_level,
            "--log-format", opts.log_format, *opts.tracing.as_args(), *security_args(opts.security), *opts.engine_args]


def _front(model: str | None, served: str | None, opts: ClusterOptions) -> tuple[ModelFront, str]:
    """One served model's front (tokenizer, context length) and the model argument its engines get."""
    # a GGUF converts in a child, config and tokenizer only: the engines serve its weights as stored (or, with
    # --dtype / --quantization none, convert its weights themselves: they get the GGUF, not the directory)
    model_dir = resolve_model(model, progress=opts.progress, isolated=True, weights=False)
    max_len = opts.max_model_len or ModelConfig.from_dir(model_dir).max_position_embeddings
    return ModelFront(served_name(model, served), Tokenizer(model_dir), max_len), str(gguf_file(model) or model_dir)


def build_cluster(opts: ClusterOptions):
    """The gateway app for cluster mode (engines start with the app and stop with it)."""
    if opts.security.serves_tls and not opts.security.dials_tls and any(opts.instances.values()):
        raise ValueError("--tls-cert makes the engines this gateway starts serve TLS: give --tls-ca too (the CA "
                         "that signed it; the certificate itself if it is self-signed) so the gateway can dial them")
    opts.security.check_files()
    opts.security.check_cluster(opts.etcd, "xllm serve")  # --etcd needs a credential or --insecure-cluster
    fronts, commands = [], []
    for i, (model, served) in enumerate([(opts.model, opts.served_model_name), *opts.more_models]):
        front, model_arg = _front(model, served, opts)
        fronts.append(front)
        commands.append((f"m{i}-" if i else "", engine_command(model_arg, front.name, opts)))
    security = opts.security
    if not security.token and not opts.etcd and any(opts.instances.values()):
        security = security.with_token(secrets.token_urlsafe(32))  # this run's engines and registry only
    clients = functools.partial(GrpcEngineClient, security=security, stream_idle_timeout=opts.engine_idle_timeout,
                                request_deadline=opts.request_timeout)
    metrics = EngineMetrics()
    registry = (EtcdRegistry(EtcdClient(opts.etcd, ssl_context=security.etcd_ssl_context()), opts.etcd_prefix,
                             client_factory=clients, watch_timeout=opts.etcd_watch_timeout,
                             metrics=RegistryMetrics(metrics.registry), credential=security.keys)
                if opts.etcd else EmbeddedRegistry(client_factory=clients, credential=security.keys))
    metrics.registry.register(KVTierCollector(from_registry(registry)))  # xllm:kv_tier_*, from heartbeats
    state = GatewayState(registry=registry, tokenizer=fronts[0].tokenizer, metrics=metrics,
                         default_model=fronts[0].name, max_model_len=fronts[0].max_model_len,
                         extra_models=tuple(fronts[1:]), routing=opts.routing, limits=opts.limits, access=opts.access,
                         routing_fallback_ratio=opts.routing_fallback_ratio, moves=opts.moves,
                         pd_roles=opts.pd_roles, tool_parser=opts.tool_parser, stall=opts.stall, media=opts.media,
                         epd=opts.epd,
                         stream_key=security.keys.stream if security.keys else None,  # any gateway resumes any's
                         **gateway_tracing(opts.tracing))
    if any(opts.instances.values()):
        procs = EngineProcesses(opts.instances, commands,
                                Path(opts.log_dir) if opts.log_dir else None,
                                stop_timeout=opts.drain_timeout + 10, env=security.environment())
        grpc_server, watcher = {}, {}

        async def start_engines() -> None:
            if opts.etcd:
                args = ["--etcd", opts.etcd, "--etcd-prefix", opts.etcd_prefix]
            else:
                server, port = await serve_registry(registry, "127.0.0.1", 0, security)
                grpc_server["server"] = server
                args = ["--registry", f"127.0.0.1:{port}"]
            procs.start(args)
            watcher["task"] = asyncio.ensure_future(procs.watch(state.fail))

        async def stop_engines() -> None:
            task = watcher.pop("task", None)
            if task is not None:
                task.cancel()  # (their exits from here on are the stop's)
            await asyncio.get_running_loop().run_in_executor(None, procs.stop)
            server = grpc_server.pop("server", None)
            if server is not None:
                await server.stop(0.5)

        state.on_startup.append(start_engines)
        state.on_shutdown.append(stop_engines)
    local = ", ".join(f"{n} {role}" for role, n in opts.instances.items() if n)
    log.info("gateway for %s: %s registry, routing %s, PD roles %s, %s", ", ".join(f.name for f in fronts),
             registry.backend, opts.routing,
             opts.pd_roles.policy, f"local engine processes: {local}" if local else "engines from etcd")
    return create_app(state)

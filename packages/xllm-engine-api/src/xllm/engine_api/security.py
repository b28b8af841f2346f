"""Securing the cluster's internal gRPC services: one place that binds their ports and one that opens
channels to them.

The internal services are ``xllm.engine.v1.EngineService`` (gateway → engine, and engine → engine for
``TransferKV`` hand-offs) and the embedded registry's ``xllm.registry.v1.RegistryService`` (engine →
gateway). Every server of them is made by :func:`new_server` and bound by :func:`bind`; every
channel to them is opened by :func:`open_channel`. All three take the process's
:class:`ClusterSecurity`:

- **cluster token** (``--cluster-token``, ``--cluster-token-file`` or ``$XLLM_CLUSTER_TOKEN``): a
  shared secret that never crosses the wire (:mod:`xllm.engine_api.credential`). Channels attach a
  per-call proof derived from it to every call (metadata ``xllm-proof``: an HMAC over the method, a
  timestamp and a nonce; client interceptors installed on the channel, so no call site can forget
  it); servers check it in constant time with a replay window in a :class:`CallCheck` server
  interceptor and refuse anything else with ``UNAUTHENTICATED`` before a servicer runs. The one
  exception is ``EngineService.Prove``, the challenge by which an engine proves to its caller that it
  holds the credential before the caller sends it anything (:class:`xllm.engine_api.client.GrpcEngineClient`).
- **insecure cluster** (``--insecure-cluster``): an etcd cluster without a token, explicitly; without
  it ``--etcd`` refuses to start (:meth:`ClusterSecurity.check_cluster`).
- **TLS** (optional): servers with ``--tls-cert``/``--tls-key`` serve TLS; clients with ``--tls-ca``
  dial TLS and verify the server against that CA (``--tls-server-name``: the name the certificate
  carries, when it is not the dialled host). The proofs authenticate the client; TLS keeps the
  traffic private and authenticates the server.
- **bind policy** (:meth:`ClusterSecurity.check_bind`): a service refuses to bind an address that is
  not loopback unless a cluster token is set; loopback binds need nothing (the single-machine
  default stays zero-config).

Without a token nor TLS, servers and channels are exactly what they were before (no interceptor,
no cost). The etcd client's TLS settings (``--etcd-ca/--etcd-cert/--etcd-key``) ride along here so a
process has one security object; :meth:`ClusterSecurity.etcd_ssl_context` builds the context.

No torch here.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from xllm.engine_api.credential import PROOF_KEY, ClusterKeys, ProofCheck, make_proof

log = logging.getLogger(__name__)

TOKEN_ENV = "XLLM_CLUSTER_TOKEN"
PROVE_METHOD = "/xllm.engine.v1.EngineService/Prove"  # answered without a proof from the caller
MIN_TOKEN_LENGTH = 16
TOKEN_HINT = "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
REFUSED = "missing or wrong cluster token (every engine and gateway of a cluster needs the same --cluster-token)"

ChannelOptions = Sequence[tuple[str, object]]


class SecurityConfigError(ValueError):
    """A security setting is missing or unusable (raised at start-up, names the flag to fix)."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a service on this machine (``localhost``, 127.0.0.0/8, ::1).
    Anything else — ``0.0.0.0``, ``::``, an interface address, an unresolved name — is not."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_token(token: str) -> None:
    if len(token) < MIN_TOKEN_LENGTH:
        raise SecurityConfigError(f"the cluster token must have at least {MIN_TOKEN_LENGTH} characters ({TOKEN_HINT})")
    if not all(33 <= ord(c) <= 126 for c in token):  # a gRPC metadata value; no spaces, nothing unprintable
        raise SecurityConfigError("the cluster token may only hold printable ASCII characters without spaces "
                                  f"({TOKEN_HINT})")


@dataclass(frozen=True)
class ClusterSecurity:
    """How one process protects the internal services it serves and authenticates to the ones it dials.

    ``token``: the cluster's shared secret (``None``: no authentication; only loopback binds allowed).
    ``tls_cert``/``tls_key``: PEM files this process serves TLS with (both or neither).
    ``tls_ca``: PEM file of the CA that signed the servers' certificates; channels use TLS iff it is set.
    ``tls_server_name``: the name to verify servers' certificates against instead of the dialled host.
    ``etcd_ca``/``etcd_cert``/``etcd_key``: TLS to etcd (``https://`` endpoints), with an optional
    client certificate (etcd's ``--client-cert-auth``).
    ``insecure``: ``--insecure-cluster`` was given (an etcd cluster may run without a token).
    The token is never shown in ``repr``.
    """

    token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.token is not None:
            _check_token(self.token)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecurityConfigError("--tls-cert and --tls-key go together (the server's certificate and its key)")
        if self.etcd_key and not self.etcd_cert:
            raise SecurityConfigError("--etcd-key needs --etcd-cert (the client certificate it belongs to)")

    @property
    def serves_tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def dials_tls(self) -> bool:
        return bool(self.tls_ca)

    def with_token(self, token: str) -> ClusterSecurity:
        return replace(self, token=token)

    @functools.cached_property
    def keys(self) -> ClusterKeys | None:
        """The keys derived from the token (``None`` without one)."""
        return ClusterKeys.from_token(self.token) if self.token else None

    def check_cluster(self, etcd: str | None, command: str) -> None:
        """Refuse a cluster registered in etcd without a credential (raises :class:`SecurityConfigError`
        naming the flags) unless ``--insecure-cluster`` was given, which logs a loud warning instead."""
        if not etcd or self.token:
            return
        if not self.insecure:
            raise SecurityConfigError(
                f"{command} --etcd needs the cluster credential: anyone who can write to etcd could otherwise "
                f"register an instance and receive user traffic. Give every engine and gateway the same "
                f"--cluster-token, --cluster-token-file or ${TOKEN_ENV} ({TOKEN_HINT}), or accept the risk "
                f"explicitly with --insecure-cluster")
        log.warning("*** --insecure-cluster: instance records in etcd %s are NOT verified and the internal "
                    "services take calls from anyone who can reach them: whoever can write to etcd can receive "
                    "user traffic, and any local process can call or abort requests. Use --cluster-token. ***",
                    etcd)

    def environment(self) -> dict[str, str]:
        """What a child process needs in its environment to hold the same token (never its argv,
        which ``ps`` shows to every user)."""
        return {TOKEN_ENV: self.token} if self.token else {}

    def check_bind(self, host: str, service: str) -> None:
        """Refuse to serve ``service`` on a non-loopback ``host`` without a cluster token (raises
        :class:`SecurityConfigError`); warn when the token would cross the network unencrypted."""
        if is_loopback(host):
            return
        if not self.token:
            raise SecurityConfigError(
                f"refusing to serve {service} on {host}, which other machines can reach, without authentication: "
                f"give every engine and gateway of the cluster the same --cluster-token (or --cluster-token-file, "
                f"or ${TOKEN_ENV}; {TOKEN_HINT}), or bind 127.0.0.1")
        if not self.serves_tls:
            log.warning("%s on %s: the cluster token and all traffic cross the network unencrypted; "
                        "add --tls-cert/--tls-key (and --tls-ca on the clients)", service, host)

    def check_files(self) -> None:
        """Read every configured PEM file now (at start-up), raising :class:`SecurityConfigError`
        naming the flag of one that cannot be read, rather than when a server binds or a channel opens."""
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if path:
                _read(path, flag)
        self.etcd_ssl_context()

    def etcd_ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for etcd's ``https://`` endpoints (``None``: the defaults); raises
        :class:`SecurityConfigError` if the files cannot be loaded."""
        if not (self.etcd_ca or self.etcd_cert):
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.etcd_ca)
            if self.etcd_cert:
                ctx.load_cert_chain(self.etcd_cert, self.etcd_key)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityConfigError(f"--etcd-ca/--etcd-cert/--etcd-key: {exc}") from None
        return ctx


NO_SECURITY = ClusterSecurity()


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace and the trailing newline dropped)."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise SecurityConfigError(f"--cluster-token-file {path}: {exc.strerror or exc}") from None
    if not token:
        raise SecurityConfigError(f"--cluster-token-file {path} is empty")
    return token


def resolve_token(flag: str | None, path: str | None) -> str | None:
    """The cluster token from ``--cluster-token``, ``--cluster-token-file`` or ``$XLLM_CLUSTER_TOKEN``
    (in that order; the two flags exclude each other)."""
    if flag and path:
        raise SecurityConfigError("use --cluster-token or --cluster-token-file, not both")
    if flag:
        return flag
    if path:
        return read_token_file(path)
    return os.environ.get(TOKEN_ENV) or None


# ---- server side --------------------------------------------------------------------------------
async def _refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that refuses the call (requests are not even deserialised)."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)


class CallCheck(grpc.aio.ServerInterceptor):
    """Admits a call only if its metadata carries a valid per-call proof (``xllm-proof``,
    :class:`xllm.engine_api.credential.ProofCheck`: constant-time MAC, timestamp within the replay
    window, nonce not seen before); ``EngineService.Prove`` is admitted as is (it is how a server
    proves itself, and reveals nothing). A refused call ends with ``UNAUTHENTICATED`` before any
    servicer code runs. Refusals are counted by reason (``refused``) and logged (the first, then
    every 100th: a scanner cannot flood the log).
    """

    def __init__(self, keys: ClusterKeys) -> None:
        self.proofs = ProofCheck(keys)
        self.refused: dict[str, int] = {}

    def admits(self, metadata: Sequence[tuple[str, str | bytes]] | None, method: str) -> str | None:
        """``None`` if ``metadata`` proves a call of ``method``, else why not."""
        values = [value for key, value in metadata or () if key == PROOF_KEY]
        return self.proofs.check(values[0] if len(values) == 1 else None, method)

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method == PROVE_METHOD:
            return handler
        why = self.admits(handler_call_details.invocation_metadata, method)
        if why is None:
            return handler
        self.refused[why] = self.refused.get(why, 0) + 1
        total = sum(self.refused.values())
        if total % 100 == 1:
            log.warning("refused %s: %s: %s (%d refused so far)", method, why, REFUSED, total)
        return _refusing(handler)


# Our clients ping every 10 s (xllm.engine_api.client); gRPC's server default expects pings at most every 5 min
# while it sends nothing, and after 2 early ones closes the connection with GOAWAY "too_many_pings",
# failing every call on it. A request queued for long in an overloaded engine did that (seen in
# `benchmarks kv_tiers`' cluster runs: all streams of both engines failed with UNAVAILABLE "Too many pings").
# (gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS is the key below; an unknown key
# is ignored silently: a first version passed the macro's name and kept the 5-minute default)
KEEPALIVE_PERMITS = (("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                     ("grpc.keepalive_permit_without_calls", 1))


def new_server(security: ClusterSecurity = NO_SECURITY, options: ChannelOptions = ()) -> grpc.aio.Server:
    """A ``grpc.aio`` server for an internal service (the proof check installed when there is a token).
    Bind it with :func:`bind`."""
    interceptors = [CallCheck(security.keys)] if security.keys else None
    return grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0), *KEEPALIVE_PERMITS, *options])



def bind(server: grpc.aio.Server, host: str, port: int, security: ClusterSecurity, service: str) -> int:
    """Bind ``host:port`` (0: a free port) under the bind policy, with TLS when the security has a
    certificate; returns the bound port. Raises :class:`SecurityConfigError` (policy, unreadable
    certificate) or ``OSError`` (the port cannot be bound)."""
    security.check_bind(host, service)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if security.serves_tls:
        bound = server.add_secure_port(address, grpc.ssl_server_credentials(
            [(_read(security.tls_key, "--tls-key"), _read(security.tls_cert, "--tls-cert"))]))
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"cannot bind {service} to {address}")
    return bound


def _read(path: str | None, flag: str) -> bytes:
    try:
        return Path(path or "").read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{flag} {path}: {exc.strerror or exc}") from None


# ---- client side --------------------------------------------------------------------------------
class _WithProof:
    def __init__(self, keys: ClusterKeys) -> None:
        self._keys = keys

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method == PROVE_METHOD:  # the callee proves itself first: nothing of ours goes to it
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (PROOF_KEY, make_proof(self._keys, method)))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnaryProof(_WithProof, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamProof(_WithProof, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryProof(_WithProof, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamProof(_WithProof, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def proof_interceptors(keys: ClusterKeys) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors attaching a fresh per-call proof to every kind of call (gRPC files an
    interceptor under one call kind only, hence one per kind)."""
    return [cls(keys) for cls in (_UnaryUnaryProof, _UnaryStreamProof, _StreamUnaryProof, _StreamStreamProof)]


def open_channel(address: str, security: ClusterSecurity = NO_SECURITY,
                 options: ChannelOptions = ()) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to an internal service at ``host:port``: TLS verified against
    ``--tls-ca`` when set, a per-call proof of the cluster token on every call when there is one
    (never the token). Create it inside the event loop that uses it."""
    interceptors = proof_interceptors(security.keys) if security.keys else None
    opts = list(options)
    if not security.dials_tls:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
    if security.tls_server_name:
        opts.append(("grpc.ssl_target_name_override", security.tls_server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=_read(security.tls_ca, "--tls-ca"))
    return grpc.aio.secure_channel(address, credentials, options=opts, interceptors=interceptors)

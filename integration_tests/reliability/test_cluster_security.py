"""``xllm serve --instances 2`` with a cluster token (from a file) and TLS on the internal services:
the gateway hands the token to its engines through their environment, never their command line;
the engines and the embedded registry refuse callers without it, the registry refuses a take-over
of a live instance id, and requests are served throughout. Plus ``xllm engine`` refusing to bind a
non-loopback address without a token, and the etcd client over TLS with a client certificate
(etcd's own security, ``--etcd-ca/--etcd-cert/--etcd-key``)."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.registration.embedded import GrpcRegistryPublisher, RegistrationRefusedError
from xllm.engine_api.registration.etcd_client import EtcdClient, EtcdError
from xllm.engine_api.security import TOKEN_ENV, ClusterSecurity
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.processes import child_processes, ensure_etcd, free_port, spawn, stop_process_group, wait_for
from xllm.testing.tls import have_openssl, self_signed

MODEL = "tiny"
ENGINES = {"engine-0", "engine-1"}

pytestmark = pytest.mark.skipif(not have_openssl(), reason="the openssl command makes the test certificate")


def _complete(gw, prompt: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                      timeout=60, trust_env=False)


@pytest.fixture(scope="module")
def secured(tiny_model_dir, launch_server, tmp_path_factory):
    """The cluster, its token and certificate, and its engine processes ``{instance id: (pid, argv)}``."""
    work = tmp_path_factory.mktemp("cluster-security")
    token = secrets.token_urlsafe(32)
    token_file = work / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    cert = self_signed(work / "tls")
    gw = launch_server("--model", str(tiny_model_dir), "--served-model-name", MODEL, "--instances", "2",
                       "--routing", "round_robin", "--dtype", "float32", "--kv-cache-memory", "0.05", "--threads", "1",
                       "--cluster-token-file", str(token_file), "--tls-cert", str(cert.cert),
                       "--tls-key", str(cert.key), "--tls-ca", str(cert.cert))
    try:
        def both_up():
            body = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json()
            return {k for k, v in body["instances"].items() if v["healthy"]} == ENGINES

        wait_for(both_up, 120, "both engine processes registered")
        engines = {argv[argv.index("--instance-id") + 1]: (pid, argv)
                   for pid, argv in child_processes(gw.proc.pid).items() if "--instance-id" in argv}
        yield gw, token, cert, engines
    finally:
        gw.stop()


def _engine_address(gw, instance_id: str) -> str:
    found = re.search(rf"xllm engine {instance_id} serving {MODEL} on (\S+)", gw.log_tail(400))
    assert found, gw.log_tail(60)
    return found.group(1)


def test_requests_are_served_and_the_token_never_shows_in_a_command_line(secured):
    gw, token, _, engines = secured
    assert set(engines) == ENGINES
    served = [_complete(gw, f"hello {i}") for i in range(2)]
    assert [r.status_code for r in served] == [200, 200], [r.text for r in served]
    assert sorted(r.headers["x-xllm-instance"] for r in served) == sorted(ENGINES)  # round robin: both engines
    for pid, argv in engines.values():
        assert not any(token in arg for arg in argv)
        assert "--tls-cert" in argv and "--tls-ca" in argv
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"{TOKEN_ENV}={token}".encode() in environ
    gateway_argv = Path(f"/proc/{gw.proc.pid}/cmdline").read_bytes().decode()
    assert token not in gateway_argv and token not in gw.log_tail(2000)


def test_engines_refuse_callers_without_the_token_or_tls(secured):
    gw, token, cert, _ = secured
    info = instance_pb2.InstanceInfo(instance_id="engine-0", address=_engine_address(gw, "engine-0"))

    async def health(security: ClusterSecurity):
        client = GrpcEngineClient(info, rpc_timeout=10, security=security)
        try:
            return await client.health()
        finally:
            await client.close()

    ca = str(cert.cert)
    assert asyncio.run(health(ClusterSecurity(token=token, tls_ca=ca))).healthy
    refused = asyncio.run(health(ClusterSecurity(tls_ca=ca)))
    assert not refused.healthy and "UNAUTHENTICATED" in refused.status
    wrong = asyncio.run(health(ClusterSecurity(token=secrets.token_urlsafe(32), tls_ca=ca)))
    assert not wrong.healthy and "did not prove" in wrong.status  # another token: the engine cannot prove itself
    plaintext = asyncio.run(health(ClusterSecurity(token=token)))  # the right token, but no TLS
    assert not plaintext.healthy and "UNAUTHENTICATED" not in plaintext.status


def test_the_registry_refuses_strangers_and_take_overs(secured):
    gw, token, cert, engines = secured
    _, argv = engines["engine-0"]
    registry = argv[argv.index("--registry") + 1]
    assert registry.startswith("127.0.0.1:")

    async def register(security: ClusterSecurity, instance_id: str) -> None:
        publisher = GrpcRegistryPublisher(registry, security=security)
        try:
            await publisher.register(instance_pb2.InstanceInfo(instance_id=instance_id, address="127.0.0.1:1"))
        finally:
            await publisher.close()

    ca = str(cert.cert)
    with pytest.raises(RegistrationRefusedError, match="UNAUTHENTICATED"):
        asyncio.run(register(ClusterSecurity(tls_ca=ca), "intruder"))
    with pytest.raises(RegistrationRefusedError, match="ALREADY_EXISTS"):  # even with the token
        asyncio.run(register(ClusterSecurity(token=token, tls_ca=ca), "engine-0"))
    body = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json()
    assert set(body["instances"]) == ENGINES and all(v["healthy"] for v in body["instances"].values())
    r = _complete(gw, "still here")
    assert r.status_code == 200, r.text


def test_an_engine_refuses_a_public_bind_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    r = subprocess.run([sys.executable, "-m", "xllm.engine", "--host", "0.0.0.0", "--model", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2
    assert "refusing to serve the engine service (--host) on 0.0.0.0" in r.stderr and "--cluster-token" in r.stderr


def test_etcd_over_tls_with_a_client_certificate(tmp_path):
    """An etcd serving https and requiring client certificates: the client with ``--etcd-ca`` and
    ``--etcd-cert/--etcd-key`` reads and writes; without the certificate, or over http, it cannot."""
    binary = ensure_etcd()
    cert = self_signed(tmp_path / "tls", "etcd-test")
    client_port, peer_port = free_port(), free_port()
    url = f"https://127.0.0.1:{client_port}"
    proc = spawn([binary, "--name", "sec", "--data-dir", str(tmp_path / "data"),
                  "--listen-client-urls", url, "--advertise-client-urls", url,
                  "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                  "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                  "--initial-cluster", f"sec=http://127.0.0.1:{peer_port}",
                  "--cert-file", str(cert.cert), "--key-file", str(cert.key),
                  "--client-cert-auth", "--trusted-ca-file", str(cert.cert)], tmp_path / "etcd.log")

    async def put_get(endpoint: str, security: ClusterSecurity) -> bytes:
        client = EtcdClient(endpoint, ssl_context=security.etcd_ssl_context())
        try:
            await client.put("/xllm-tls/k", b"v")
            kv = await client.get("/xllm-tls/k")
            return kv.value if kv else b""
        finally:
            await client.close()

    def works(endpoint: str, security: ClusterSecurity) -> bool:
        try:
            return asyncio.run(put_get(endpoint, security)) == b"v"
        except EtcdError:
            return False

    try:
        full = ClusterSecurity(etcd_ca=str(cert.cert), etcd_cert=str(cert.cert), etcd_key=str(cert.key))
        wait_for(lambda: works(url, full), 30, "etcd over TLS with a client certificate")
        assert not works(url, ClusterSecurity(etcd_ca=str(cert.cert)))  # no client certificate
        assert not works(f"http://127.0.0.1:{client_port}", full)  # plaintext
    finally:
        stop_process_group(proc, 20)

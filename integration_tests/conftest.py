"""A real ``xllm serve`` process for the end-to-end tests.

The session-scoped :func:`server` fixture starts ``python -m xllm.gateway serve``
(the default model, SmolLM2-135M-Instruct) on a free loopback port in its own
process group, waits for ``/health`` and kills the whole group at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from xllm.testing.metrics import metric_value, parse_metrics
from xllm.testing.processes import ensure_etcd, free_port, spawn, stop_process_group, wait_healthy

STARTUP_TIMEOUT = 120.0
STOP_TIMEOUT = 20.0
# every process these tests start shares one cluster token (through the environment, as an operator would
# pass it): `--etcd` refuses to start without one (xllm.engine_api.security.ClusterSecurity.check_cluster)
CLUSTER_ENV = {**os.environ, "XLLM_CLUSTER_TOKEN": os.environ.get("XLLM_CLUSTER_TOKEN") or secrets.token_urlsafe(32)}




@dataclass
class Server:
    """A running ``xllm serve`` subprocess."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        """Terminate the process group (SIGTERM, then SIGKILL) and check nothing is left."""
        stop_process_group(self.proc, STOP_TIMEOUT)


def start_server(log_dir: Path, *extra: str, timeout: float = STARTUP_TIMEOUT,
                 env: dict[str, str] | None = None) -> Server:
    """Start ``xllm serve`` with ``extra`` flags (and ``env`` added to its environment) and wait until
    ``/health`` answers 200."""
    port = free_port()
    log_path = log_dir / f"xllm-serve-{port}.log"
    cmd = [sys.executable, "-m", "xllm.gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--no-progress", *extra]
    server = Server(spawn(cmd, log_path, {**CLUSTER_ENV, **(env or {})}), port, log_path)
    try:
        wait_healthy(server.proc, f"{server.url}/health", timeout, "xllm serve", server.log_tail, interval=0.25)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    """``xllm serve`` with the default model and settings."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def launch_server(tmp_path_factory) -> Callable[..., Server]:
    """``launch_server(*flags)`` starts another ``xllm serve``; the caller stops it (``.stop()``)."""
    log_dir = tmp_path_factory.mktemp("servers")

    def _launch(*extra: str, env: dict[str, str] | None = None) -> Server:
        return start_server(log_dir, *extra, env=env)

    return _launch


@pytest.fixture(scope="session")
def client(server) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120,
                      http_client=openai.DefaultHttpxClient(trust_env=False))
    yield c
    c.close()


@pytest.fixture(scope="session")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as c:
        yield c


@pytest.fixture(scope="session")
def scrape(http) -> Callable[[], dict]:
    """Fetch and parse ``/metrics``."""

    def _scrape() -> dict:
        r = http.get("/metrics")
        assert r.status_code == 200, r.text
        return parse_metrics(r.text)

    return _scrape


@pytest.fixture(scope="session")
def wait_idle(scrape) -> Callable[[float], dict]:
    """Poll ``/metrics`` until nothing runs or waits; returns the last scrape (fails after ``timeout``)."""

    def _wait(timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            m = scrape()
            busy = (metric_value(m, "xllm:num_requests_running", missing_ok=True)
                    + metric_value(m, "xllm:num_requests_waiting", missing_ok=True))
            if busy == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy after {timeout} s: running+waiting={busy}")
            time.sleep(0.25)

    return _wait


# ---- cluster mode: etcd, a tiny model, engine processes ------------------------------------------

ETCD_STARTUP_TIMEOUT = 30.0
ENGINE_STARTUP_TIMEOUT = 120.0


@dataclass
class Etcd:
    proc: subprocess.Popen
    client_port: int
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def stop(self) -> None:
        stop_process_group(self.proc, STOP_TIMEOUT)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory) -> Iterator[Etcd]:
    """A real single-node etcd on free loopback ports (data in a temp dir), stopped by PID."""
    binary = ensure_etcd()
    work = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    log_path = work / "etcd.log"
    cmd = [binary, "--name", "xllm-test", "--data-dir", str(work / "data"),
           "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
           "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
           "--initial-cluster", f"xllm-test=http://127.0.0.1:{peer}"]
    server = Etcd(spawn(cmd, log_path), client, log_path)
    try:
        wait_healthy(server.proc, f"http://{server.endpoint}/health", ETCD_STARTUP_TIMEOUT, "etcd",
                     lambda: log_path.read_text()[-3000:], interval=0.1, probe_timeout=2)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer (fast to load in every engine process).

    Initialised wider than HF's default (0.5, not 0.02) so that its greedy text varies from token
    to token with clear top-2 margins: with the default it repeats one token forever, and a lost or
    repeated token in a moved stream would not show in the text (built by
    ``xllm.testing.models.save_tiny_llama``, which the reliability benchmark uses too)."""
    from xllm.testing.models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


# --block-size: the tiny Llama's smallest page-aligned block (2 KV heads x 16 x fp32), not xTensor's 128-token default,
# so that the tests' prompts of tens of tokens span several blocks (prefix routing, hand-offs)
TINY_ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "0.05", "--threads", "1", "--max-num-seqs", "16",
                     "--block-size", "32")


@pytest.fixture(scope="session")
def tiny_engine_flags() -> tuple[str, ...]:
    """:data:`TINY_ENGINE_FLAGS`, for tests that start engines their own way (``xllm serve`` spawning them)."""
    return TINY_ENGINE_FLAGS


@dataclass
class Engine:
    """An ``xllm engine`` process (its own process group)."""

    proc: subprocess.Popen
    instance_id: str
    log_path: Path

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        stop_process_group(self.proc, timeout=60.0)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[Callable[..., Engine]]:
    """``engines(instance_id, *flags)`` starts an ``xllm engine``; all are stopped (by PID) at the end."""
    log_dir = tmp_path_factory.mktemp("engines")
    started: list[Engine] = []

    def _start(instance_id: str, *flags: str) -> Engine:
        log_path = log_dir / f"{instance_id}-{len(started)}.log"
        cmd = [sys.executable, "-m", "xllm.gateway", "engine", "--instance-id", instance_id, "--no-progress",
               *TINY_ENGINE_FLAGS, *flags]
        engine = Engine(spawn(cmd, log_path, CLUSTER_ENV), instance_id, log_path)
        started.append(engine)
        return engine

    yield _start
    for engine in started:
        engine.terminate()  # all at once: they drain in parallel
    for engine in started:
        engine.stop()

"""What the reliability benchmark runs against and how it watches it: an ``xllm serve --instances N``
cluster, an etcd cluster (``xllm engine --etcd`` processes behind ``xllm serve --etcd`` gateways),
a streaming client that records everything a client sees, and the gateway's ``/metrics`` read as
per-instance load. Every process is started in its own session and stopped by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.metrics import scrape, total
from benchmarks.peers.venv import ServerProcess, free_port
from xllm.testing import hostile
from xllm.testing.processes import healthy_instances, wait_for
from xllm.testing.sse import CompletionStream as Stream
from xllm.testing.sse import busiest_instance, stream_completion, stream_many

MODEL = hostile.MODEL
API_KEY = "sk-reliability-bench-0123456789"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ETCD_PREFIX = "/xllm-reliability"
WATCH_TIMEOUT = 2.0   # the etcd gateways' --etcd-watch-timeout
LEASE_TTL = 3.0
DRAIN_TIMEOUT = 1.0   # the etcd engines' --drain-timeout
WAIT = 120.0          # failure guard of every wait on a state


@dataclass(frozen=True)
class Settings:
    model_dir: pathlib.Path
    out: pathlib.Path
    dtype: str
    kv_cache_memory: float
    streams: int
    seed: int

    @property
    def logs(self) -> pathlib.Path:
        return self.out / "logs"

    def engine_flags(self) -> list[str]:
        return ["--model", str(self.model_dir), "--dtype", self.dtype, "--threads", "1",
                "--kv-cache-memory", str(self.kv_cache_memory), "--no-progress"]


def share_cluster_token() -> None:
    """Give the engines and gateways this process starts one cluster token (through the environment they
    inherit): ``--etcd`` refuses to start without one."""
    import secrets

    os.environ.setdefault("XLLM_CLUSTER_TOKEN", secrets.token_urlsafe(32))


def build_tiny_model(path: pathlib.Path) -> pathlib.Path:
    """The integration tests' tiny model (2-layer random Llama, SmolLM2's tokenizer) in ``path``."""
    from xllm.models import resolve_model
    from xllm.testing.models import save_tiny_llama

    return save_tiny_llama(path, resolve_model(progress=False))


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """:func:`xllm.testing.processes.wait_for`, with a server that is not answering yet (connection
    refused, a body without the expected keys) counting as "not yet"."""
    return wait_for(predicate, timeout, what, interval, ignore=(OSError, ValueError, KeyError))


# ---- a gateway, seen from outside -----------------------------------------------------------------

healthy = healthy_instances


def watch_up(base_url: str) -> bool:
    return total(scrape(base_url), "xllm:registry_watch_up") == 1


@dataclass
class Load:
    running: float
    waiting: float
    kv_usage: float


def loads(base_url: str, instances: set[str]) -> dict[str, Load]:
    """Per-instance running/waiting/KV usage as the gateway's ``/metrics`` reports them (heartbeats)."""
    m = scrape(base_url)
    return {i: Load(total(m, "xllm:num_requests_running", instance=i), total(m, "xllm:num_requests_waiting",
                                                                               instance=i),
                    total(m, "xllm:kv_cache_usage_perc", instance=i)) for i in instances}


def wait_idle(base_url: str, instances: set[str], blocks: dict[str, int], baseline: dict[str, float],
              timeout: float = 20.0) -> tuple[float | None, int]:
    """Wait until every instance reports nothing running or waiting and its KV usage back at
    ``baseline``: (seconds it took, None if it never did; KV blocks still in use above the baseline
    at the end, from usage x the instance's block count)."""
    t0 = time.monotonic()
    last: dict[str, Load] = {}
    while True:
        with contextlib.suppress(OSError, ValueError):
            last = loads(base_url, instances)
            if all(ld.running == 0 and ld.waiting == 0 and ld.kv_usage <= baseline.get(i, 0.0) + 1e-9
                   for i, ld in last.items()):
                return time.monotonic() - t0, 0
        if time.monotonic() - t0 > timeout:
            leaked = sum(max(0, round((ld.kv_usage - baseline.get(i, 0.0)) * blocks.get(i, 0)))
                         for i, ld in last.items())
            return None, leaked
        time.sleep(0.1)


def kv_baseline(base_url: str, instances: set[str]) -> dict[str, float]:
    return {i: ld.kv_usage for i, ld in loads(base_url, instances).items()}


def counter(base_url: str, name: str) -> float:
    return total(scrape(base_url), name)


BLOCKS_LINE = re.compile(r"engine (\S+): .*? blocks=(\d+) x")


def kv_blocks(*logs: pathlib.Path) -> dict[str, int]:
    """Instance id -> KV blocks, from the engines' start-up line in their logs."""
    out: dict[str, int] = {}
    for path in logs:
        with contextlib.suppress(OSError):
            for m in BLOCKS_LINE.finditer(path.read_text(errors="replace")):
                out[m.group(1)] = int(m.group(2))
    return out


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM: the peak) of process ``pid`` in MiB (Linux ``/proc``)."""
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


class Watch:
    """Polls ``predicate`` on a thread every ``interval`` s from ``start`` (``time.monotonic()``) on:
    ``seconds`` until it first held (None while it does not; gives up after ``timeout``)."""

    def __init__(self, predicate: Callable[[], bool], start: float, timeout: float = 60.0,
                 interval: float = 0.05) -> None:
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._poll, args=(predicate, start, timeout, interval), daemon=True)
        self._thread.start()

    def _poll(self, predicate: Callable[[], bool], start: float, timeout: float, interval: float) -> None:
        while time.monotonic() - start < timeout:
            if predicate():
                self.seconds = time.monotonic() - start
                return
            time.sleep(interval)

    def join(self) -> float | None:
        self._thread.join()
        return self.seconds


def gone_watch(base_url: str, instance: str, start: float) -> Watch:
    """Seconds from ``start`` until the gateway at ``base_url`` no longer lists ``instance`` as healthy."""
    return Watch(lambda: instance not in healthy(base_url), start)


# ---- the client ---------------------------------------------------------------------------------

def body(i: int, prompt: str, max_tokens: int, sampled: bool = False, seed: int = 1000,
         logprobs: bool = True) -> dict:
    """A streaming completion of exactly ``max_tokens`` tokens: greedy, or sampled with its own seed."""
    out = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True}}
    if logprobs:
        out["logprobs"] = 2
    if sampled:
        out.update(temperature=0.9, seed=seed + i)
    else:
        out["temperature"] = 0
    return out


def client(base_url: str, timeout: float = 300):
    import httpx

    return httpx.AsyncClient(base_url=base_url, timeout=timeout, trust_env=False, headers=HEADERS,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def stream(c, payload: dict, first: asyncio.Event | None = None, out: Stream | None = None,
                 read_chunks: int | None = None, leave: asyncio.Event | None = None) -> Stream:
    """POST ``payload`` to ``/v1/completions`` and read the answer into ``out`` (an HTTP error of the
    connection is recorded, not raised; see :func:`xllm.testing.sse.stream_completion`)."""
    return await stream_completion(c, payload, first, out, record_http_errors=True, read_chunks=read_chunks,
                                   leave=leave)


async def run_streams(base_url: str, bodies: list[dict], action: Callable[[list[Stream]], None] | None = None,
                      timeout: float = 300) -> list[Stream]:
    """Stream every body at once (with the API key; a failed connection is recorded, not raised);
    once each has its first chunk, ``action(streams so far)``."""
    return await stream_many(base_url, bodies, action, timeout, headers=HEADERS, record_http_errors=True,
                             first_timeout=WAIT)


most_streams = busiest_instance


# ---- clusters -----------------------------------------------------------------------------------

class LocalCluster:
    """``xllm serve --instances N`` (or ``extra`` flags) with the API key and the hostile table's limits."""

    def __init__(self, s: Settings, name: str, extra: list[str]) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "xllm.gateway", "serve", *s.engine_flags(), *hostile.SERVE_FLAGS,
               "--port", str(port), "--api-key", API_KEY, *extra]
        self.log = s.logs / f"{name}.log"
        self.server = ServerProcess(f"xllm-{name}", cmd, port, self.log, health_path="/health")
        self.instances: set[str] = set()
        self.blocks: dict[str, int] = {}

    @property
    def url(self) -> str:
        return self.server.base_url

    def start(self, n: int) -> LocalCluster:
        self.server.start(timeout=WAIT)
        self.instances = wait_until(lambda: (h := healthy(self.url)) and len(h) >= n and h, WAIT,
                                    f"{n} healthy instances")
        self.blocks = wait_until(lambda: (b := kv_blocks(self.log)) and set(b) >= self.instances and b, WAIT,
                                 "the engines' KV block counts in the log")
        return self

    def engine_pid(self, instance: str) -> int:
        from xllm.testing.processes import child_processes

        for pid, argv in child_processes(self.server.pid).items():
            if instance in argv:
                return pid
        raise RuntimeError(f"no engine process {instance} under the gateway")

    def stop(self) -> None:
        self.server.stop()


@dataclass
class EtcdCluster:
    """One etcd, two ``xllm engine --etcd`` processes (e0, e1) and two ``xllm serve --etcd`` gateways."""

    s: Settings
    etcd: object = None                                        # xllm.testing.processes.EtcdServer
    engines: dict[str, subprocess.Popen] = field(default_factory=dict)
    gateways: list[ServerProcess] = field(default_factory=list)
    blocks: dict[str, int] = field(default_factory=dict)

    def start(self) -> EtcdCluster:
        import shutil

        from xllm.testing.processes import EtcdServer, spawn

        if not shutil.which("etcd"):
            raise RuntimeError("etcd is not installed (apt-get install etcd-server): the etcd scenarios need it")
        self.s.logs.mkdir(parents=True, exist_ok=True)
        share_cluster_token()
        self.etcd = EtcdServer(self.s.out / "etcd", extra=("--experimental-watch-progress-notify-interval", "500ms"))
        self.etcd.work.mkdir(parents=True, exist_ok=True)
        self.etcd.start()
        for iid in ("e0", "e1"):
            cmd = [sys.executable, "-m", "xllm.gateway", "engine", "--instance-id", iid, *self.s.engine_flags(),
                   "--served-model-name", MODEL, "--etcd", self.etcd.endpoint, "--etcd-prefix", ETCD_PREFIX,
                   "--lease-ttl", str(LEASE_TTL), "--drain-timeout", str(DRAIN_TIMEOUT), "--max-num-seqs", "32"]
            self.engines[iid] = spawn(cmd, self.s.logs / f"engine-{iid}.log")
        self.gateways = [self.gateway(i) for i in range(2)]
        for gw in self.gateways:
            gw.start(timeout=WAIT)
            wait_until(lambda gw=gw: healthy(gw.base_url) == {"e0", "e1"}, WAIT, "both engines in the gateway's view")
        self.blocks = kv_blocks(*(self.s.logs / f"engine-{i}.log" for i in self.engines))
        return self

    def gateway(self, i: int, port: int | None = None) -> ServerProcess:
        port = port or free_port()
        cmd = [sys.executable, "-m", "xllm.gateway", "serve", "--model", str(self.s.model_dir), *hostile.SERVE_FLAGS,
               "--port", str(port), "--api-key", API_KEY, "--etcd", self.etcd.endpoint, "--etcd-prefix", ETCD_PREFIX,
               "--etcd-watch-timeout", str(WATCH_TIMEOUT), "--routing", "round_robin", "--no-progress"]
        return ServerProcess(f"gateway-{i}", cmd, port, self.s.logs / f"gateway-{i}-{port}.log", health_path="/health")

    def stop(self) -> None:
        from xllm.testing.processes import stop_process_group

        for gw in self.gateways:
            with contextlib.suppress(Exception):
                gw.stop()
        for proc in self.engines.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # all at once: they drain in parallel
        for proc in self.engines.values():
            with contextlib.suppress(Exception):
                stop_process_group(proc, 30.0)
        if self.etcd is not None:
            with contextlib.suppress(Exception):
                self.etcd.stop()

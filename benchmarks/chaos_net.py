"""The chaos soak's network: an engine moved into a network namespace the benchmark makes itself, joined to
the host by a veth pair, so that a fault can cut it off (``partition``: the host end of the link down).

Needs root and iproute2 (``ip netns``). The loopback-only etcd is reached from the namespace through a
TCP relay on the host end's address (:class:`Relay`); the gateways dial the engine at its namespace
address (``--host``). Delay and loss (``tc netem``) are probed apart: many containers' kernels lack
``sch_netem``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
from dataclasses import dataclass, field

SUBNET = "10.77.{k}.{h}"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` (10 s bound); ``check``: raise with its stderr when it fails."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()[:300]}")
    return out


def probe() -> tuple[str | None, str | None]:
    """(why network namespaces cannot be used here, why ``tc netem`` cannot; None: it can)."""
    name = "xllm-chaos-probe"
    try:
        made = sh("ip", "netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        reason = f"`ip` not usable ({exc}): needs iproute2"
        return reason, reason
    if made.returncode:
        reason = f"`ip netns add` failed: {made.stderr.strip()[:200]} (needs root)"
        return reason, reason
    try:
        sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up", check=False)
        netem = sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                   check=False)
    finally:
        sh("ip", "netns", "del", name, check=False)
    if netem.returncode:
        return None, f"`tc qdisc ... netem` failed: {netem.stderr.strip()[:200]} (the kernel has no sch_netem)"
    return None, None


@dataclass
class Namespace:
    """Namespace ``xllm-chaos-<k>`` with ``vc<k>n`` (``10.77.k.2``) inside, ``vc<k>h`` (``10.77.k.1``) on the host."""

    k: int
    name: str = ""
    host_ip: str = ""
    inner_ip: str = ""

    def __post_init__(self) -> None:
        self.name = f"xllm-chaos-{self.k}"
        self.host_ip, self.inner_ip = SUBNET.format(k=self.k, h=1), SUBNET.format(k=self.k, h=2)
        self.host_if, self.inner_if = f"vc{self.k}h", f"vc{self.k}n"

    def create(self) -> Namespace:
        sh("ip", "netns", "del", self.name, check=False)  # a leftover of an interrupted run
        sh("ip", "netns", "add", self.name)
        sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.inner_if)
        sh("ip", "link", "set", self.inner_if, "netns", self.name)
        sh("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        sh("ip", "link", "set", self.host_if, "up")
        inside = ("ip", "netns", "exec", self.name)
        sh(*inside, "ip", "addr", "add", f"{self.inner_ip}/30", "dev", self.inner_if)
        sh(*inside, "ip", "link", "set", self.inner_if, "up")
        sh(*inside, "ip", "link", "set", "lo", "up")
        return self

    def prefix(self) -> list[str]:
        """What a command line starts with to run inside."""
        return ["ip", "netns", "exec", self.name]

    def cut(self, down: bool) -> None:
        """The partition: the host end of the link down (``down``) or up again."""
        sh("ip", "link", "set", self.host_if, "down" if down else "up")

    def delete(self) -> None:
        sh("ip", "netns", "del", self.name, check=False)  # takes its veth pair with it


@dataclass
class Relay:
    """TCP relay ``listen_host:port`` -> ``127.0.0.1:port`` (etcd, which listens on loopback only), on a
    thread of its own with its own event loop."""

    listen_host: str
    port: int
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _thread: threading.Thread | None = None
    _server: asyncio.AbstractServer | None = None

    def start(self) -> Relay:
        ready = threading.Event()

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            with contextlib.suppress(OSError, ConnectionError):
                w.close()

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                ur, uw = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                w.close()
                return
            await asyncio.gather(pipe(r, uw), pipe(ur, w))

        async def serve() -> None:
            self._server = await asyncio.start_server(handle, self.listen_host, self.port)
            ready.set()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(serve())
            self._loop.run_forever()
            if self._server is not None:
                self._server.close()
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name="chaos-etcd-relay")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"the etcd relay on {self.listen_host}:{self.port} did not start")
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


def move_engine(ec, iid: str, ns: Namespace, relay_port: int, wait: float) -> None:
    """Replace engine ``iid`` of ``ec`` (a :class:`benchmarks.clusters.EtcdCluster`, started) by the same
    engine inside ``ns``: binding its namespace address, registering through the relay; returns once
    every gateway lists it again."""
    from benchmarks.clusters import healthy, wait_until
    from xllm.testing.processes import spawn

    old = ec.engines[iid]
    cmd = list(old.args)
    old.send_signal(signal.SIGTERM)
    old.wait(wait)
    etcd = cmd.index("--etcd")
    cmd[etcd + 1] = f"{ns.host_ip}:{relay_port}"
    cmd += ["--host", ns.inner_ip]  # --port 0: a free one, registered
    ec.engines[iid] = spawn(ns.prefix() + cmd, ec.s.logs / f"engine-{iid}-netns.log")
    for gw in ec.gateways:
        wait_until(lambda gw=gw: iid in healthy(gw.base_url), wait, f"{iid} (in {ns.name}) listed by {gw.name}")

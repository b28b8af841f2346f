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
import threading
from dataclasses import dataclass, field

from xllm.testing.netns import Namespace


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

"""Processes the integration tests start on loopback and stop by PID: servers, engines, etcd
(:class:`EtcdServer` to kill, freeze and restart one)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from xllm.kvstore.mooncake_local import LocalMooncake


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving_in_thread(server, timeout: float) -> Iterator[int]:
    """Run ``server`` (a ``uvicorn.Server``) on a thread of this process for the ``with`` block (a test that
    reaches into the app, or blocks its tokenizer, needs it in-process); yields the port it listens on (give
    the config port 0 for a free one). Stopped, and checked stopped, when the block ends."""
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), timeout, "the server to start", interval=0.01)
    assert server.started, "the server failed to start"
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout)
        assert not thread.is_alive(), "the server did not stop"


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (so its whole process group can be stopped), output to ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str, log_tail: Callable[[], str],
                 interval: float, probe_timeout: float = 5.0) -> None:
    """Poll ``url`` until it answers 200; fail with the log tail if ``proc`` exits or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(url, timeout=probe_timeout, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy after {timeout:.0f} s:\n{log_tail()}")
        time.sleep(interval)


async def until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.01):
    """:func:`wait_for` inside an event loop: for state another thread changes (an engine's step
    loop) that offers no event to await. Fails with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


def child_processes(pid: int) -> dict[int, list[str]]:
    """The direct children of process ``pid``: ``{pid: argv}`` (Linux ``/proc``)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # the name may hold spaces and parentheses
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    return out


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the process group ``proc`` leads (started by :func:`spawn`), SIGKILL after ``timeout``;
    reap it and check that nothing of the group is left."""
    pgid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)  # stragglers of the group
    proc.wait(timeout)
    deadline = time.monotonic() + timeout
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_alive(pgid), f"processes of group {pgid} survived"


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1,
             ignore: tuple[type[BaseException], ...] = ()):
    """Poll ``predicate`` until it returns something truthy (returned) or fail after ``timeout`` s.
    ``ignore``: exceptions of ``predicate`` that count as "not yet" (a process still starting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


_APT_LOCK = Path("/tmp/xllm-testing-apt.lock")


def apt_install(packages: list[str], installed: Callable[[], bool], why: str) -> None:
    """Install Debian ``packages`` unless ``installed()`` already holds; skips the test where that is
    impossible (not root, no apt-get). Test workers run in parallel: one installs at a time (a lock file;
    each re-checks ``installed()`` once it holds it), and apt waits for dpkg's own lock instead of failing
    when another apt holds it."""
    if installed():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"{why} (needs root and apt-get to install {' '.join(packages)})")
    import fcntl

    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", "DPkg::Lock::Timeout=600"]
    with _APT_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed():  # another worker did it while this one waited
            return
        for cmd in (["apt-get", *wait, "update", "-qq"], ["apt-get", *wait, "install", "-y", "-qq", *packages]):
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")


def ensure_etcd() -> str:
    """Path of the ``etcd`` binary, installing Debian's etcd-server when it is missing (CI runs as root)."""
    apt_install(["etcd-server", "etcd-client"], lambda: shutil.which("etcd") is not None, "etcd is not installed")
    found = shutil.which("etcd")
    if not found:
        raise RuntimeError("etcd-server installed but no etcd binary on PATH")
    return found


@dataclass
class EtcdServer:
    """A single-node etcd on fixed loopback ports (its own process group) that a test can kill,
    freeze, thaw and start again, on the same data dir or a fresh one, at the same endpoint.

    ``extra``: more etcd flags (e.g. ``--experimental-watch-progress-notify-interval``)."""

    work: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    data_dirs: int = 0  # data dirs used so far: data-0, data-1, ...
    starts: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def data_dir(self) -> Path:
        return self.work / f"data-{max(self.data_dirs - 1, 0)}"

    @property
    def log_path(self) -> Path:
        return self.work / "etcd.log"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "<no log>"

    def start(self, fresh: bool = False, timeout: float = 30.0) -> None:
        """Start etcd (``fresh``: on a new, empty data dir; the first start always is) and wait until
        it answers ``/health``."""
        assert self.proc is None or self.proc.poll() is not None, "etcd is running"
        if fresh or not self.data_dirs:
            self.data_dirs += 1
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [ensure_etcd(), "--name", "xllm-test", "--data-dir", str(self.data_dir),
               "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"xllm-test={peer}", *self.extra]
        with open(self.log_path, "ab") as log:  # appended: one log across restarts
            log.write(f"---- start {self.starts} on {self.data_dir}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.starts += 1
        try:
            wait_healthy(self.proc, f"http://{self.endpoint}/health", timeout, "etcd", self.log_tail, interval=0.1,
                         probe_timeout=2)
        except BaseException:
            self.stop()
            raise

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, reaped: its clients see their connections reset."""
        self._signal(signal.SIGKILL)
        self.proc.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: connections stay open (the kernel even accepts new ones) and nothing answers."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.thaw()  # a frozen process would not act on SIGTERM
            stop_process_group(self.proc, 20.0)


def mapped_libraries(pid: int) -> set[str]:
    """File names of the shared libraries mapped into process ``pid`` (Linux ``/proc``)."""
    out = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and ".so" in parts[5]:
            out.add(Path(parts[5]).name)
    return out


def ensure_mooncake() -> str:
    """Path of ``mooncake_master``, installing Debian's libibverbs1 (which the PyPI wheel
    ``mooncake-transfer-engine-non-cuda`` needs to import) when it is missing; skips the test
    when the wheel is not installed."""
    try:
        importlib.import_module("mooncake.store")
    except ImportError as exc:
        if "libibverbs" not in str(exc):
            pytest.skip(f"mooncake is not installed: {exc}")
        import ctypes.util

        apt_install(["libibverbs1"], lambda: ctypes.util.find_library("ibverbs") is not None,
                    "mooncake needs libibverbs1")
        importlib.import_module("mooncake.store")
    import sys

    found = shutil.which("mooncake_master") or str(Path(sys.executable).with_name("mooncake_master"))
    if not Path(found).is_file():
        pytest.skip("mooncake_master is not installed")
    return found


def start_mooncake_master(log_dir: Path) -> LocalMooncake:
    """A Mooncake store on loopback for a test (:func:`xllm.kvstore.mooncake_local.start_local_mooncake`,
    what ``xllm serve --kv-store local-mooncake`` runs); skips the test when Mooncake is not installed.
    Stop it with its ``stop()`` (by PID)."""
    ensure_mooncake()
    from xllm.kvstore.mooncake_local import start_local_mooncake

    return start_local_mooncake(log_dir)


def healthy_instances(base_url: str, timeout: float = 5.0) -> set[str]:
    """The instances a gateway's ``/health`` lists as healthy (empty while it does not answer)."""
    try:
        body = httpx.get(base_url + "/health", timeout=timeout, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return set()
    return {k for k, v in body.get("instances", {}).items() if v.get("healthy")}


def engine_pid(gateway_pid: int, instance_id: str) -> int:
    """The pid of the engine process ``instance_id`` started by the gateway ``gateway_pid``."""
    for pid, argv in child_processes(gateway_pid).items():
        if instance_id in argv:
            return pid
    raise LookupError(f"no engine process {instance_id} under the gateway {gateway_pid}")


@contextlib.contextmanager
def frozen(pids: list[int]):
    """Hold ``pids`` stopped (SIGSTOP) for the body, then let them run on (SIGCONT; a pid the body
    killed is skipped). A fault test freezes the engines the moment its streams are in flight, so a
    fast tiny model cannot finish them before the fault lands: the fault then hits running requests
    whatever the machine's speed, with no sleep and no race."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

"""A Mooncake store on this machine: its master and metadata server as child processes, on loopback.

``xllm serve --kv-store local-mooncake`` starts one (:func:`start_local_mooncake`) before its engines
and gives them ``--kv-store mooncake://127.0.0.1:PORT --mooncake-metadata URL``; tests and benchmarks
start theirs the same way. Everything binds 127.0.0.1: the master's RPC and metrics ports (it is
told so), and the metadata server, which runs as Mooncake's own Python HTTP server
(``mooncake.http_metadata_server``) rather than the master's embedded one because that one binds
every interface whatever it is told. Each process runs in a session of its own and is stopped by
PID with :meth:`LocalMooncake.stop`.

Needs PyPI ``mooncake-transfer-engine-non-cuda`` (the ``mooncake`` extra of ``xllm-kvstore``), which
ships ``mooncake_master``; :class:`MooncakeUnavailableError` says what is missing otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOCAL = "local-mooncake"  # the --kv-store value that asks for a store on this machine


class MooncakeUnavailableError(RuntimeError):
    """The Mooncake binaries or Python package are not installed, or the store did not start."""


@dataclass
class LocalMooncake:
    """A running local store: its processes, the master's ``HOST:PORT`` and the metadata URL."""

    master: subprocess.Popen
    metadata: subprocess.Popen
    address: str
    metadata_url: str

    @property
    def url(self) -> str:
        """The ``--kv-store`` value naming this store."""
        return f"mooncake://{self.address}"

    @property
    def pids(self) -> tuple[int, int]:
        return self.master.pid, self.metadata.pid

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM both process groups, SIGKILL what is left after ``timeout`` seconds."""
        for proc in (self.master, self.metadata):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in (self.master, self.metadata):
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def master_binary() -> str:
    """Path of ``mooncake_master`` (beside this Python or on PATH)."""
    beside = Path(sys.executable).with_name("mooncake_master")
    found = str(beside) if beside.is_file() else shutil.which("mooncake_master")
    if not found:
        raise MooncakeUnavailableError("mooncake_master is not installed: pip install "
                                       "'xllm-kvstore[mooncake]' (PyPI mooncake-transfer-engine-non-cuda)")
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def start_local_mooncake(log_dir: str | os.PathLike, timeout: float = 30.0) -> LocalMooncake:
    """Start a master and a metadata server on free loopback ports, logging into ``log_dir``; returns
    once both accept connections (:class:`MooncakeUnavailableError` if either exits or ``timeout``
    passes first, with the log's tail)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    binary = master_binary()
    rpc, meta, metrics = _free_port(), _free_port(), _free_port()
    master = _spawn([binary, "-rpc_address=127.0.0.1", f"-rpc_port={rpc}", "-enable_http_metadata_server=false",
                     "-metrics_host=127.0.0.1", f"-metrics_port={metrics}"], log_dir / "mooncake-master.log")
    metadata = _spawn([sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
                       "--port", str(meta), "--log-level", "WARNING"], log_dir / "mooncake-metadata.log")
    store = LocalMooncake(master, metadata, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{meta}/metadata")
    deadline = time.monotonic() + timeout
    pending = {"mooncake-master": (master, rpc), "mooncake-metadata": (metadata, meta)}
    while pending:
        for name, (proc, port) in list(pending.items()):
            if proc.poll() is not None:
                store.stop()
                tail = (log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise MooncakeUnavailableError(f"{name} exited with {proc.returncode}:\n{tail}")
            if _listening(port):
                del pending[name]
        if pending and time.monotonic() > deadline:
            store.stop()
            raise MooncakeUnavailableError(f"{', '.join(pending)} did not start in {timeout:.0f} s (logs in {log_dir})")
        if pending:
            time.sleep(0.05)
    return store

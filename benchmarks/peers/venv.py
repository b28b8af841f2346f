"""Per-peer virtual environments under the cache dir, and the peers' server processes.

Each peer lives in ``<cache>/bench/venvs/<name>``: created with ``python -m venv``, torch==2.13.0
installed first and alone (the CPU wheel; a fresh resolver would otherwise fetch CUDA builds), then
the peer's own packages. A ``.installed.json`` marker records the steps, so a venv whose steps
changed is rebuilt. Servers start in their own session and are stopped by PID (process group).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

TORCH = "torch==2.13.0"


def cache_root() -> pathlib.Path:
    """``$XLLM_CACHE_DIR/bench`` (default ``~/.cache/xllm/bench``), the harness's own cache."""
    env = os.environ.get("XLLM_CACHE_DIR")
    base = pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "xllm"
    return base / "bench"


class PeerVenv:
    """A venv for one peer; ``ensure(steps)`` makes it exist with exactly those pip steps done."""

    def __init__(self, name: str, root: pathlib.Path | None = None) -> None:
        self.name = name
        self.path = (root or cache_root() / "venvs") / name
        self.marker = self.path / ".installed.json"

    @property
    def python(self) -> pathlib.Path:
        return self.path / "bin" / "python"

    def installed(self, steps: Sequence[Sequence[str]]) -> bool:
        if not (self.marker.is_file() and self.python.exists()):
            return False
        try:
            return json.loads(self.marker.read_text()).get("steps") == [list(s) for s in steps]
        except (OSError, ValueError):
            return False

    def ensure(self, steps: Sequence[Sequence[str]], env: dict[str, str] | None = None,
               log: pathlib.Path | None = None) -> None:
        """Create the venv and run ``python -m pip <step>`` for each step (skipped when already done).

        A step starting with ``!`` is run as a command inside the venv's ``bin`` instead of pip
        (e.g. ``["!python", "-c", "..."]``).
        """
        if self.installed(steps):
            return
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        log = log or self.path.parent / f"{self.name}.install.log"
        base = getattr(sys, "_base_executable", sys.executable)
        with open(log, "w") as out:
            _run([base, "-m", "venv", str(self.path)], out, env)
            for step in steps:
                if step and step[0].startswith("!"):
                    cmd = [str(self.path / "bin" / step[0][1:]), *step[1:]]
                else:
                    cmd = [str(self.python), "-m", "pip", *step]
                _run(cmd, out, env)
        self.marker.write_text(json.dumps({"steps": [list(s) for s in steps], "time": time.time()}))

    def run(self, args: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.python), *args], check=True, **kw)

    def versions(self, dists: Sequence[str]) -> dict[str, str]:
        """Installed versions of ``dists`` in this venv (missing ones are left out)."""
        code = ("import importlib.metadata as m, json, sys\n"
                "out = {}\n"
                "for d in sys.argv[1:]:\n"
                "    try: out[d] = m.version(d)\n"
                "    except m.PackageNotFoundError: pass\n"
                "print(json.dumps(out))")
        res = subprocess.run([str(self.python), "-c", code, *dists], capture_output=True, text=True, check=True)
        return json.loads(res.stdout)


def _run(cmd: Sequence[str], out, env: dict[str, str] | None) -> None:
    out.write(f"$ {' '.join(map(str, cmd))}\n")
    out.flush()
    full_env = {**os.environ, **(env or {})}
    res = subprocess.run(list(map(str, cmd)), stdout=out, stderr=subprocess.STDOUT, env=full_env)
    if res.returncode != 0:
        raise RuntimeError(f"command failed ({res.returncode}): {' '.join(map(str, cmd))}; see {out.name}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started in its own session, waited on until healthy, stopped by its PID."""

    def __init__(self, name: str, cmd: Sequence[str], port: int, log_path: pathlib.Path,
                 env: dict[str, str] | None = None, health_path: str = "/v1/models") -> None:
        self.name = name
        self.cmd = [str(c) for c in cmd]
        self.port = port
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.health_path = health_path
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout: float = 600.0) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self._log = log
        log.write(f"$ {' '.join(self.cmd)}\n")
        log.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._close_log()
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode} during start-up; "
                                   f"log: {self.log_path}\n{_tail(self.log_path)}")
            if _healthy(self.base_url + self.health_path):
                self.startup_seconds = time.monotonic() - t0
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} server not healthy after {timeout:.0f}s; log: {self.log_path}")

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the server's process group (by its PID), SIGKILL after ``grace`` seconds."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _tail(path: pathlib.Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""

"""A real Prometheus (Debian ``prometheus``) on loopback for the integration tests: it scrapes the
targets a test names and answers PromQL through its HTTP query API; stopped by PID."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from xllm.testing.processes import apt_install, free_port, spawn, stop_process_group, wait_healthy


def ensure_prometheus() -> str:
    """Path of the ``prometheus`` binary, installing Debian's package when it is missing (CI runs as root)."""
    apt_install(["prometheus"], lambda: shutil.which("prometheus") is not None, "prometheus is not installed")
    found = shutil.which("prometheus")
    if not found:
        raise RuntimeError("prometheus installed but no prometheus binary on PATH")
    return found


@dataclass
class Prometheus:
    """Prometheus scraping ``targets`` (job name -> ``host:port`` list) every ``interval_s``, its data and
    log under ``work``. :meth:`query` runs an instant query; PromQL errors raise ``AssertionError``.

    The jobs honour the scraped labels (``honor_labels: true``, as ``docs/observability.md`` tells
    operators to): the gateway's series carry the engine instance in their own ``instance`` label, which
    Prometheus would otherwise rename ``exported_instance`` under the target's address."""

    work: Path
    targets: dict[str, list[str]]
    interval_s: float = 0.5
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.work / "prometheus.log").read_text(errors="replace")[-n:]
        except OSError:
            return "<no log>"

    def start(self, timeout: float = 60.0) -> Prometheus:
        interval = f"{int(self.interval_s * 1000)}ms"
        jobs = "\n".join(f"  - job_name: {job}\n    scrape_interval: {interval}\n    scrape_timeout: {interval}\n"
                         f"    honor_labels: true\n    static_configs:\n"
                         f"      - targets: [{', '.join(repr(t) for t in hosts)}]"
                         for job, hosts in self.targets.items())
        config = self.work / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
                          f"scrape_configs:\n{jobs}\n")
        cmd = [ensure_prometheus(), f"--config.file={config}", f"--storage.tsdb.path={self.work / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.proc = spawn(cmd, self.work / "prometheus.log")
        try:
            wait_healthy(self.proc, f"{self.url}/-/ready", timeout, "prometheus", self.log_tail, interval=0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def query(self, expr: str) -> list[dict]:
        """The result vector (or matrix) of an instant query of ``expr``."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10, trust_env=False)
        body = r.json()
        assert r.status_code == 200 and body.get("status") == "success", f"{expr}: {r.status_code} {body}"
        return body["data"]["result"]

    def targets_health(self) -> dict[str, str]:
        """``scrapeUrl`` -> ``health`` (``up``, ``down``, ``unknown``) of every active target."""
        r = httpx.get(f"{self.url}/api/v1/targets", timeout=10, trust_env=False)
        return {t["scrapeUrl"]: t["health"] for t in r.json()["data"]["activeTargets"]}

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, 20.0)

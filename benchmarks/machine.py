"""Facts about the machine and the code under test, recorded in every report."""

from __future__ import annotations

import os
import platform
import subprocess
import sys


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": sys.version.split()[0], "logical_cpus": os.cpu_count(),
            "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
        for line in cpuinfo.splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
        info["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["ram_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def git_commit(repo: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_busy_fraction(seconds: float = 2.0) -> float | None:
    """Fraction of all CPUs' time spent busy (not idle/iowait) over ``seconds``, from /proc/stat.

    Measured while the harness itself sleeps, so it is what other processes (or neighbours sharing the
    cores) take: benchmarks on a busy machine are not comparable, and OpenMP runs with as many threads as
    cores slow down many times over when a core is taken.
    """
    import time

    def snap():
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return idle, sum(vals)

    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / (t1 - t0) if t1 > t0 else None

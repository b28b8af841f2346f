"""Hosts of their own on one machine: a network namespace joined to the host by a veth pair (iproute2
``ip netns``; needs root), for tests and benchmarks that need processes on different addresses (ranks
on two hosts, an engine a partition cuts off). Only namespaces made here are ever touched.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

SUBNET = "10.77.{k}.{h}"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` (10 s bound); ``check``: raise with its stderr when it fails."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()[:300]}")
    return out


def probe() -> tuple[str | None, str | None]:
    """(why network namespaces cannot be used here, why ``tc netem`` cannot; None: it can)."""
    name = "xllm-netns-probe"
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
    """Namespace ``<tag>-<k>`` with ``vc<k>n`` (``10.77.k.2``) inside, ``vc<k>h`` (``10.77.k.1``) on the host."""

    k: int
    tag: str = "xllm-chaos"
    name: str = ""
    host_ip: str = ""
    inner_ip: str = ""

    def __post_init__(self) -> None:
        self.name = f"{self.tag}-{self.k}"
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

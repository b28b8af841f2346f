"""What the chaos soak runs: an etcd cluster (:class:`benchmarks.clusters.EtcdCluster`: etcd, engines e0
and e1, two gateways), steady streaming load through both gateways, and a schedule of faults on a thread
beside it. Every request and every fault window is recorded with ``time.monotonic()`` times relative to
the load's start; the accounting (:func:`benchmarks.chaos.account`) reads them afterwards.

Faults (each a function ``(cluster, plan, victim) -> details``, run on the fault thread, its window from
just before the fault until the cluster is whole again):

- ``sigstop``: SIGSTOP of an engine's process group for ``plan.fault_s``, then SIGCONT; back when every
  gateway lists it healthy;
- ``sigkill``: SIGKILL of an engine, restarted with the same command line; back when every gateway
  lists it healthy;
- ``etcd``: etcd SIGKILLed, down ``plan.fault_s``, restarted on its data dir; back when both
  gateways' watches are up and both engines listed;
- ``partition``: the link of the engine in a network namespace (:mod:`benchmarks.chaos_net`) down for
  ``plan.fault_s``; back when every gateway lists it healthy;
- ``hostile``: the malformed requests of :mod:`xllm.testing.hostile` sent for ``plan.fault_s`` (at
  least once each) beside the load: each must get its own 4xx with an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from benchmarks.clusters import HEADERS, WAIT, EtcdCluster, body, client, healthy, stream, wait_until, watch_up
from benchmarks.streamcheck import send_hostile
from xllm.testing import hostile
from xllm.testing.sse import CompletionStream as Stream

ENGINES = ("e0", "e1")


@dataclass(frozen=True)
class Plan:
    """The soak's shape: how long, how much load, which faults, how long each lasts."""

    duration: float          # seconds of load after the reference run (faults repeat until it is spent)
    faults: tuple[str, ...]  # in schedule order
    concurrency: int         # streams open at once (workers, alternating between the gateways)
    pool: int                # distinct requests (half greedy, half seeded), each with a reference text
    tokens: int              # output tokens per request (ignore_eos)
    fault_s: float           # how long a fault lasts (SIGSTOP, etcd down, hostile requests)
    gap_s: float             # quiet load between faults (and before the first, after the last)
    request_timeout: float   # a request not done in this long is lost
    seed: int = 0


@dataclass
class Window:
    """One fault as it ran: ``at``/``until`` seconds from the load's start (``until``: the cluster whole)."""

    fault: str
    victim: str
    at: float
    until: float | None = None
    details: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass
class Request:
    """One request of the load as the client saw it (times in seconds from the load's start)."""

    index: int       # into the pool (its reference)
    gateway: int
    start: float
    stream: Stream


def bodies(plan: Plan) -> tuple[list[dict], list[bool]]:
    """The pool: even requests greedy, odd ones sampled with their own seed; and which are greedy."""
    tag = uuid.uuid4().hex[:6]
    out = [body(i, f"{tag} chaos {i}: once upon a time", plan.tokens, sampled=bool(i % 2), seed=1000 + plan.seed)
           for i in range(plan.pool)]
    return out, [i % 2 == 0 for i in range(plan.pool)]


# ---- faults -------------------------------------------------------------------------------------

def _all_listed(ec: EtcdCluster) -> None:
    for gw in ec.gateways:
        wait_until(lambda gw=gw: healthy(gw.base_url) == set(ENGINES), WAIT, f"both engines listed by {gw.name}")


def sigstop(ec: EtcdCluster, plan: Plan, victim: str) -> dict:
    pgid = ec.engines[victim].pid
    os.killpg(pgid, signal.SIGSTOP)
    try:
        time.sleep(plan.fault_s)
    finally:
        os.killpg(pgid, signal.SIGCONT)
    _all_listed(ec)
    return {"stopped_s": plan.fault_s}


def sigkill(ec: EtcdCluster, plan: Plan, victim: str) -> dict:
    from xllm.testing.processes import spawn

    proc = ec.engines[victim]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(WAIT)
    t0 = time.monotonic()
    restarts = sum(1 for p in ec.s.logs.glob(f"engine-{victim}*.log"))
    ec.engines[victim] = spawn(list(proc.args), ec.s.logs / f"engine-{victim}-{restarts}.log")
    _all_listed(ec)
    return {"restart_to_listed_s": time.monotonic() - t0}


def etcd(ec: EtcdCluster, plan: Plan, victim: str) -> dict:
    ec.etcd.kill()
    time.sleep(plan.fault_s)
    t0 = time.monotonic()
    ec.etcd.start()
    for gw in ec.gateways:
        wait_until(lambda gw=gw: watch_up(gw.base_url), WAIT, f"{gw.name}'s registry watch up")
    _all_listed(ec)
    return {"down_s": plan.fault_s, "start_to_whole_s": time.monotonic() - t0}


def partition(ec: EtcdCluster, plan: Plan, victim: str) -> dict:
    ns = ec.netns  # set by benchmarks.chaos when it moved the victim into a namespace
    ns.cut(True)
    try:
        time.sleep(plan.fault_s)
    finally:
        ns.cut(False)
    t0 = time.monotonic()
    _all_listed(ec)
    return {"cut_s": plan.fault_s, "heal_to_listed_s": time.monotonic() - t0, "namespace": ns.name}


def hostile_clients(ec: EtcdCluster, plan: Plan, victim: str) -> dict:
    sent, wrong, c5xx = 0, [], 0
    deadline = time.monotonic() + plan.fault_s
    with httpx.Client(base_url=ec.gateways[0].base_url, timeout=60, trust_env=False, headers=HEADERS) as h:
        while sent < len(hostile.CASES) or time.monotonic() < deadline:
            case = hostile.CASES[sent % len(hostile.CASES)]
            status, problem = send_hostile(h, case)
            sent += 1
            c5xx += status >= 500
            if problem is not None and len(wrong) < 5:
                wrong.append(f"{case.name}: {problem}")
    return {"sent": sent, "wrong_answers": wrong, "c5xx": c5xx}


FAULTS: dict[str, Callable[[EtcdCluster, Plan, str], dict]] = {
    "sigstop": sigstop, "sigkill": sigkill, "etcd": etcd, "hostile": hostile_clients, "partition": partition}
NETNS_ENGINE = "e1"  # the engine the partition fault cuts off (moved into a namespace)


def schedule(ec: EtcdCluster, plan: Plan, t0: float, windows: list[Window], stop: threading.Event) -> None:
    """Run the faults in turn (the engines' victims alternate), a gap of quiet load before each, until
    ``plan.duration`` is spent (every fault at least once); sets ``stop`` when the last gap is over."""
    try:
        k = 0
        while True:
            time.sleep(plan.gap_s)
            elapsed = time.monotonic() - t0
            if k >= len(plan.faults) and elapsed + plan.fault_s + plan.gap_s > plan.duration:
                return
            name = plan.faults[k % len(plan.faults)]
            victim = ENGINES[k % len(ENGINES)] if name.startswith("sig") else ""
            victim = NETNS_ENGINE if name == "partition" else victim
            w = Window(name, victim, elapsed)
            windows.append(w)
            print(f"[chaos] {elapsed:6.1f} s: {name} {w.victim}", flush=True)
            try:
                w.details = FAULTS[name](ec, plan, w.victim)
                if w.details.get("wrong_answers") or w.details.get("c5xx"):
                    w.problems.append(f"hostile answers not as expected: {w.details['wrong_answers']}, "
                                      f"{w.details['c5xx']} 5xx")
            except Exception as exc:  # the fault itself failed: recorded, the soak goes on
                w.problems.append(f"{type(exc).__name__}: {exc}"[:500])
            w.until = time.monotonic() - t0
            k += 1
    finally:
        time.sleep(plan.gap_s if windows else 0)
        stop.set()


# ---- load ---------------------------------------------------------------------------------------

async def load(urls: list[str], pool: list[dict], plan: Plan, t0: float, stop: threading.Event) -> list[Request]:
    """``plan.concurrency`` workers stream requests of the pool one after another (worker ``k`` through
    ``urls[k % len(urls)]``) until ``stop`` is set; every request is recorded, a timeout as an error."""
    done: list[Request] = []

    async def worker(k: int) -> None:
        g = k % len(urls)
        async with client(urls[g], timeout=plan.request_timeout) as c:
            j = 0
            while not stop.is_set():
                i = (k + j * plan.concurrency) % len(pool)
                req = Request(i, g, time.monotonic() - t0, Stream())
                try:
                    await asyncio.wait_for(stream(c, pool[i], out=req.stream), plan.request_timeout)
                except TimeoutError:
                    req.stream.errors.append(f"no end within {plan.request_timeout:g} s")
                    req.stream.done_at = time.monotonic()
                done.append(req)
                j += 1

    await asyncio.gather(*(worker(k) for k in range(plan.concurrency)))
    return done


async def reference(url: str, pool: list[dict], plan: Plan) -> list[Stream]:
    """The uninterrupted run: the pool streamed ``plan.concurrency`` at a time before any fault."""
    out: list[Stream] = []
    async with client(url, timeout=plan.request_timeout) as c:
        for k in range(0, len(pool), plan.concurrency):
            out += await asyncio.gather(*(stream(c, b) for b in pool[k:k + plan.concurrency]))
    return out


def soak(ec: EtcdCluster, plan: Plan) -> tuple[list[Stream], list[Request], list[Window], float]:
    """Reference run, then load with the fault schedule beside it: (reference, requests, windows, t0)."""
    pool, _ = bodies(plan)
    urls = [gw.base_url for gw in ec.gateways]
    ref = asyncio.run(reference(urls[0], pool, plan))
    windows: list[Window] = []
    stop = threading.Event()

    async def main(t0: float) -> list[Request]:
        faults = threading.Thread(target=schedule, args=(ec, plan, t0, windows, stop), daemon=True)
        faults.start()
        try:
            return await load(urls, pool, plan, t0, stop)
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(faults.join)

    t0 = time.monotonic()
    requests = asyncio.run(main(t0))
    return ref, requests, windows, t0

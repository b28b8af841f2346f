"""A tensor-parallel instance in a cluster: etcd, a gateway (``xllm serve --etcd``) and two ``xllm engine``
processes of one tiny random Llama (9 query / 3 KV heads: split unevenly over two ranks), instance ``tp2``
with ``--tensor-parallel-size 2`` (its rank 1 a child process of the engine process) and ``tp1`` with one
rank.

Oracle: the one-rank instance. Greedy and seeded completions through the gateway on ``tp2`` equal those on
``tp1``. Then ``tp2``'s worker rank is SIGKILLed (not the engine process) while streams run on it: rank 0
fails the instance at once (``RankFailed``), the engine process deregisters and exits with status 1, it is
gone from the gateway's ``/health`` within the lease TTL, nothing of it is left running, and the gateway
resumes every stream on ``tp1``, each ending as the uninterrupted run of the same request did (text,
tokens, finish reason, usage).

Requests go to one instance by session (``session_id`` sticks to the instance it was first routed to)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import uuid

import httpx
import pytest

from xllm.testing.models import save_llama_9q3kv
from xllm.testing.processes import child_processes, frozen, group_alive, healthy_instances, wait_for
from xllm.testing.sse import CompletionStream, assert_same_streams, stream_many

MODEL = "tiny-tp"
LEASE_TTL = 3.0
TP, ONE = "tp2", "tp1"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return save_llama_9q3kv(tmp_path_factory.mktemp("tp-cluster") / "llama_9q3kv", smollm2_dir)


def _listed(gw) -> set[str]:
    """Every instance the gateway's ``/health`` lists, healthy or not."""
    return set(httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json().get("instances", {}))


def _bodies(session: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """One streaming completion per prompt, the first half greedy, the rest seeded sampling; ``ignore_eos``,
    top-2 logprobs (:func:`~xllm.testing.sse.assert_same_streams` reads them)."""
    half = len(prompts) // 2
    return [{"model": MODEL, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True}, "logprobs": 2, "session_id": session,
             **({"temperature": 0} if i < half else {"temperature": 0.9, "top_p": 0.95, "seed": 7 + i})}
            for i, p in enumerate(prompts)]


def _greedy(prompts: list[str]) -> list[bool]:
    return [i < len(prompts) // 2 for i in range(len(prompts))]


def _prompts(n: int) -> list[str]:
    return [f"Story {i} ({uuid.uuid4().hex[:8]}): once upon a time" for i in range(n)]


def _session_on(gw, instance: str) -> str:
    """A session id the gateway routes to ``instance``: the router keeps a session where it went first, and
    places a new one in turn over instances it predicts equally fast (idle ones before both measured their
    steps: call this before other traffic)."""
    def probe() -> str | None:
        session = f"s-{uuid.uuid4().hex[:8]}"
        r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                           "session_id": session}, timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        return session if r.headers["x-xllm-instance"] == instance else None

    return wait_for(probe, 60, f"a session routed to {instance}", interval=0)


def _worker_pid(engine) -> int:
    """The pid of the worker rank of ``engine`` (a TP=2 instance): the one its log names, a child of it."""
    found = re.search(r"this host's worker pids \[(\d+)\]", engine.log_path.read_text(errors="replace"))
    assert found, engine.log_tail()
    pid = int(found.group(1))
    children = child_processes(engine.proc.pid)
    assert pid in children and "--multiprocessing-fork" in children[pid], children
    return pid


def _gone(pid: int) -> bool:
    """Whether process ``pid`` is gone (or a zombie: dead, waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


@pytest.fixture(scope="module")
def cluster(etcd, engines, model_dir, launch_server):
    prefix = f"/xllm-it-tp-{uuid.uuid4().hex[:8]}"
    # --block-size 64: whole OS pages of K/V for 3 KV heads of 16 (fp32) and for a rank's 2 or 1 of them
    common = ("--model", str(model_dir), "--served-model-name", MODEL, "--etcd", etcd.endpoint,
              "--etcd-prefix", prefix, "--lease-ttl", str(LEASE_TTL), "--drain-timeout", "1", "--block-size", "64")
    tp = engines(TP, *common, "--tensor-parallel-size", "2")
    one = engines(ONE, *common)
    for engine in (tp, one):  # serving (or failed: its log says why) before the gateway waits for them
        wait_for(lambda e=engine: e.proc.poll() is not None or " serving " in e.log_path.read_text(errors="replace"),
                 120, f"{engine.instance_id} to serve")
        assert engine.proc.poll() is None, engine.log_tail()
    # sessions stay on their instance however much slower it is predicted (the TP=2 instance's eager steps on a
    # CPU without the fused kernels): the tests send each session's streams together and compare per instance
    gw = launch_server("--model", str(model_dir), "--served-model-name", MODEL, "--etcd", etcd.endpoint,
                       "--etcd-prefix", prefix, "--routing-fallback-ratio", "1000")
    try:
        wait_for(lambda: healthy_instances(gw.url) == {TP, ONE}, 120, "both engines registered")
    except AssertionError:
        gw.stop()
        raise AssertionError(f"engines did not register:\n{tp.log_tail()}\n{one.log_tail()}") from None
    try:
        sessions = {TP: _session_on(gw, TP), ONE: _session_on(gw, ONE)}
    except BaseException:
        gw.stop()
        raise
    yield {"gw": gw, "engines": {TP: tp, ONE: one}, "sessions": sessions}
    gw.stop()


def test_two_ranks_serve_through_the_gateway_what_one_rank_does(cluster):
    gw, sessions = cluster["gw"], cluster["sessions"]
    prompts = _prompts(4)
    got = asyncio.run(stream_many(gw.url, _bodies(sessions[TP], prompts, 48)))
    want = asyncio.run(stream_many(gw.url, _bodies(sessions[ONE], prompts, 48)))
    assert {s.instance for s in got} == {TP} and {s.instance for s in want} == {ONE}
    assert all(s.complete(48) for s in want), want
    assert_same_streams(got, want, _greedy(prompts))


def test_a_killed_worker_rank_fails_the_instance_and_its_streams_finish_on_the_other(cluster):
    gw, tp = cluster["gw"], cluster["engines"][TP]
    worker = _worker_pid(tp)
    session, max_tokens = cluster["sessions"][TP], 160
    prompts = _prompts(4)
    bodies = _bodies(session, prompts, max_tokens)
    reference = asyncio.run(stream_many(gw.url, bodies))  # uninterrupted, on tp2
    assert {s.instance for s in reference} == {TP} and all(s.complete(max_tokens) for s in reference)
    killed_at: list[float] = []
    left_at: list[float] = []  # when tp2 left the gateway's /health (a thread polls it from the kill on)

    def watch() -> None:
        wait_for(lambda: TP not in _listed(gw), 60, f"{TP} gone from the gateway", interval=0.02,
                 ignore=(httpx.HTTPError,))
        left_at.append(time.monotonic())

    watcher = threading.Thread(target=watch, name="watch-health", daemon=True)

    def kill_worker(streams: list[CompletionStream]) -> None:
        """Every stream has its first tokens from tp2: hold rank 0 still (so none can finish first), kill
        rank 1, let rank 0 run on into its next collective. Each stream is unfinished: the rest of it can
        only come from tp1."""
        assert {s.instance for s in streams} == {TP}, [s.instance for s in streams]
        with frozen([tp.proc.pid]):
            assert all(len(s.tokens) < max_tokens and not s.finish for s in streams)
            os.kill(worker, signal.SIGKILL)
            killed_at.append(time.monotonic())
            watcher.start()

    results = asyncio.run(stream_many(gw.url, bodies, action=kill_worker))
    # the instance failed at once and clearly: rank 0 saw the rank fail, the process deregistered and exited 1
    assert tp.wait(2 * LEASE_TTL) == 1, tp.log_tail()
    log = tp.log_path.read_text(errors="replace")
    assert "engine loop is dead" in log and "RankFailed" in log and f"instance {TP} deregistered" in log, \
        tp.log_tail()
    watcher.join(60)
    assert left_at and left_at[0] - killed_at[0] < LEASE_TTL, (killed_at, left_at)
    print(f"{TP} left the gateway {left_at[0] - killed_at[0]:.2f} s after its worker rank was killed")
    # every stream was resumed on tp1 and ended as the uninterrupted run did
    assert_same_streams(results, reference, _greedy(prompts))
    assert all(s.instance == TP for s in results)  # (where each started)
    # nothing of the instance is left: the worker, the engine process, anything else of its group
    assert _gone(worker)
    wait_for(lambda: not group_alive(tp.proc.pid), 10, f"{TP}'s process group to be gone")
    assert healthy_instances(gw.url) == {ONE}

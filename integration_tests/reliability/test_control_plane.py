"""Control-plane faults on a real etcd: one etcd, two ``xllm engine`` processes (tiny model) and two
gateways (``xllm serve --etcd``) for the module, all on loopback.

- both gateways see every instance and serve;
- etcd frozen (SIGSTOP): each gateway's watch goes silent, counts as dead after the watch timeout
  (``xllm:registry_watch_restarts_total{reason="timeout"}``) and is re-established after SIGCONT
  (``xllm:registry_watch_up``); requests are served throughout;
- etcd killed (SIGKILL): the gateways keep serving on their last view; etcd restarted on its data
  dir and then on a fresh one: the engines are registered again (the fresh etcd gets new leases),
  the gateways resync without dropping an instance, KV events flow again, a new engine is seen;
- one gateway killed mid-stream and started again: the other one's streams complete exactly as an
  uninterrupted run, the engines let go of the dead gateway's requests, the new one serves.

The times to detect and recover are printed (``-s``) and stated in docs/architecture.md, never
asserted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest

from xllm.engine_api.registration.etcd_client import EtcdClient, EtcdWatchTimeout
from xllm.testing.metrics import metric_value, parse_metrics
from xllm.testing.processes import EtcdServer, ensure_etcd, wait_for
from xllm.testing.sse import CompletionStream, assert_same_streams, stream_completion

MODEL = "tiny"
PREFIX = "/xllm-cp"
LEASE_TTL = 3.0
WATCH_TIMEOUT = 2.0  # the gateways' --etcd-watch-timeout
PROGRESS_INTERVAL = "500ms"  # etcd's progress notifications on idle watches
SYSTEM = "You are the support assistant of a bicycle shop. Answer briefly and politely. " * 4


# ---- observing a gateway ------------------------------------------------------------------------

def _get(gw, path: str) -> httpx.Response:
    return httpx.get(f"{gw.url}{path}", timeout=10, trust_env=False)


def _healthy(gw) -> set[str]:
    try:
        return {k for k, v in _get(gw, "/health").json().get("instances", {}).items() if v["healthy"]}
    except httpx.HTTPError:
        return set()


def _metrics(gw) -> dict:
    return parse_metrics(_get(gw, "/metrics").text)


def _restarts(gw, reason: str) -> float:
    return metric_value(_metrics(gw), "xllm:registry_watch_restarts_total", missing_ok=True, reason=reason)


def _watch_up(gw) -> bool:
    return metric_value(_metrics(gw), "xllm:registry_watch_up") == 1


def _index_blocks(gw) -> float:
    return metric_value(_metrics(gw), "xllm:cluster_kv_index_blocks")


def _left(gw) -> int:
    """How often the gateway logged an instance leaving its view."""
    text = gw.log_path.read_text(errors="replace")
    return sum(text.count(f"instance {iid} left") for iid in ("e0", "e1"))


def _complete(gw, prompt: str, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0}, timeout=60, trust_env=False)


def _served(gw, what: str) -> str:
    r = _complete(gw, f"{what} {uuid.uuid4().hex}")
    assert r.status_code == 200, (what, r.status_code, r.text)
    return r.headers["x-xllm-instance"]


def _failed_reads(gw) -> int:
    """How often the gateway logged that it could not read etcd (first failures of each outage)."""
    return gw.log_path.read_text(errors="replace").count("(retrying; the view stays as it is)")


def _kv_reaches(src, dst, what: str, retry_unavailable: bool = False) -> None:
    """A new prompt served through ``src`` shows up in ``dst``'s global KV index: the instance's
    heartbeat went through etcd and ``dst``'s watch (``dst`` never saw the request).
    ``retry_unavailable``: send again while ``src`` answers 503 (instances leaving and joining)."""
    before = _index_blocks(dst)

    def send() -> bool:
        r = httpx.post(f"{src.url}/v1/chat/completions", timeout=60, trust_env=False, json={
            "model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": f"{uuid.uuid4().hex} {SYSTEM}"},
                         {"role": "user", "content": "hi"}]})
        if r.status_code == 503 and retry_unavailable:
            return False
        assert r.status_code == 200, (what, r.text)
        return True

    wait_for(send, 30, f"{what}: a request served")
    wait_for(lambda: _index_blocks(dst) > before, 30, f"{what}: the prompt's blocks in the other gateway's index")


def _live_registrations(endpoint: str) -> set[str]:
    """Instances whose key in etcd hangs on a lease with time left (not one that expired while etcd
    was frozen and is about to be revoked)."""
    live = set()
    for iid, lease in _registered(endpoint).items():
        r = httpx.post(f"http://{endpoint}/v3/lease/timetolive", json={"ID": str(lease)}, timeout=5,
                       trust_env=False)
        if r.status_code == 200 and int(r.json().get("TTL", -1)) > 0:
            live.add(iid)
    return live


async def _etcd_instances(endpoint: str) -> dict[str, int]:
    """Instance id -> lease of the instance keys in etcd."""
    client = EtcdClient(endpoint)
    try:
        _, kvs = await client.get_prefix(f"{PREFIX}/instances/")
        return {kv.key.rsplit("/", 1)[-1]: kv.lease for kv in kvs}
    finally:
        await client.close()


def _registered(endpoint: str) -> dict[str, int]:
    try:
        return asyncio.run(_etcd_instances(endpoint))
    except Exception:
        return {}


# ---- streams ------------------------------------------------------------------------------------

async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                  first: asyncio.Event | None = None) -> CompletionStream:
    """One streaming greedy completion: its instance, text, tokens, top-two logprobs, finish reasons
    and errors (an HTTP error of the connection itself is recorded, not raised)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 2}
    return await stream_completion(client, body, first, record_http_errors=True)


# ---- the module's cluster -----------------------------------------------------------------------

@dataclass
class Plane:
    etcd: EtcdServer
    gateways: list  # conftest's Server objects
    gateway_args: tuple[str, ...]
    engine_args: tuple[str, ...]
    engines: list  # conftest's Engine objects: e0, e1


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    ensure_etcd()
    server = EtcdServer(tmp_path_factory.mktemp("etcd-control-plane"),
                        extra=("--experimental-watch-progress-notify-interval", PROGRESS_INTERVAL))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plane(etcd_server, engines, tiny_model_dir, launch_server):
    engine_args = ("--model", str(tiny_model_dir), "--served-model-name", MODEL, "--etcd", etcd_server.endpoint,
                   "--etcd-prefix", PREFIX, "--lease-ttl", str(LEASE_TTL), "--drain-timeout", "1")
    e0, e1 = engines("e0", *engine_args), engines("e1", *engine_args)
    gateway_args = ("--model", str(tiny_model_dir), "--served-model-name", MODEL, "--etcd", etcd_server.endpoint,
                    "--etcd-prefix", PREFIX, "--etcd-watch-timeout", str(WATCH_TIMEOUT),
                    "--routing", "round_robin")  # every instance gets requests: what a gateway sees shows
    state = Plane(etcd_server, [], gateway_args, engine_args, [e0, e1])
    try:
        state.gateways = [launch_server(*gateway_args), launch_server(*gateway_args)]
        for gw in state.gateways:
            wait_for(lambda gw=gw: _healthy(gw) == {"e0", "e1"}, 120, "both engines in both gateways' views")
    except BaseException:
        for gw in state.gateways:
            gw.stop()
        print(e0.log_tail(), e1.log_tail(), etcd_server.log_tail(), sep="\n")
        raise
    yield state
    for gw in state.gateways:
        gw.stop()


def test_two_gateways_on_one_etcd_both_see_every_instance_and_serve(plane):
    ga, gb = plane.gateways
    for gw in (ga, gb):
        assert [m["id"] for m in _get(gw, "/v1/models").json()["data"]] == [MODEL]
        assert _watch_up(gw)
        # round robin: each gateway routes to both instances
        seen: set[str] = set()

        def both_reached(gw=gw, seen=seen) -> bool:
            seen.add(_served(gw, "spread"))
            return seen == {"e0", "e1"}

        wait_for(both_reached, 60, "requests through one gateway on both instances", interval=0)
    _kv_reaches(ga, gb, "a -> b")
    _kv_reaches(gb, ga, "b -> a")


def test_an_idle_watch_is_kept_alive_by_progress_notifications(plane):
    """etcd sends progress notifications on a silent watch when asked (progress_notify): a watch of an
    empty prefix outlives its idle timeout many times over, without a single event."""

    async def watch() -> int:
        client = EtcdClient(plane.etcd.endpoint, watch_timeout=WATCH_TIMEOUT)
        progress = 0
        try:
            revision, _ = await client.get_prefix("/nothing-here/")
            async for resp in client.watch_prefix("/nothing-here/", revision + 1):
                assert not resp.events
                progress += resp.progress
                if progress == 8:  # 8 x 500 ms: twice the idle timeout
                    return progress
        except EtcdWatchTimeout as exc:
            raise AssertionError(f"the idle watch timed out after {progress} progress notifications") from exc
        finally:
            await client.close()

    assert asyncio.run(watch()) == 8


def test_a_frozen_etcd_is_detected_by_the_watch_timeout_and_the_gateways_reconnect(plane):
    gateways, etcd = plane.gateways, plane.etcd
    before = [_restarts(gw, "timeout") for gw in gateways]
    failed_reads = [_failed_reads(gw) for gw in gateways]
    leases = _registered(etcd.endpoint)
    assert set(leases) == {"e0", "e1"}
    frozen_at = time.monotonic()
    etcd.freeze()
    try:
        for gw, n in zip(gateways, before, strict=True):
            wait_for(lambda gw=gw, n=n: _restarts(gw, "timeout") > n and not _watch_up(gw), 60,
                     "the silent watch to count as dead")
        detected = time.monotonic() - frozen_at
        for gw in gateways:  # routing goes on with the last view
            assert _healthy(gw) == {"e0", "e1"}
            _served(gw, "while etcd is frozen")
        # frozen until the gateways' re-reads have timed out too: longer than the lease TTL
        for gw, n in zip(gateways, failed_reads, strict=True):
            wait_for(lambda gw=gw, n=n: _failed_reads(gw) > n, 60, "a re-read to time out")
    finally:
        etcd.thaw()
    thawed_at = time.monotonic()
    frozen_for = thawed_at - frozen_at
    for gw in gateways:
        wait_for(lambda gw=gw: _watch_up(gw), 60, "the watch re-established after SIGCONT")
    reconnected = time.monotonic() - thawed_at
    # a freeze longer than the lease TTL expires the leases as etcd resumes (the gateways then see the
    # instances leave): the engines register again, under new leases
    wait_for(lambda: _live_registrations(etcd.endpoint) == {"e0", "e1"}, 30, "both engines on live leases")
    renewed = _registered(etcd.endpoint)
    assert all(renewed[iid] != leases[iid] for iid in leases), (leases, renewed)
    for gw in gateways:
        wait_for(lambda gw=gw: _healthy(gw) == {"e0", "e1"}, 60, "both engines in the view again")
    _kv_reaches(gateways[0], gateways[1], "after the freeze", retry_unavailable=True)
    print(f"\nfrozen etcd ({frozen_for:.1f} s): watch declared dead {detected:.1f} s after SIGSTOP (watch timeout "
          f"{WATCH_TIMEOUT:g} s); watches up again {reconnected:.1f} s after SIGCONT; KV events through etcd again "
          f"{time.monotonic() - thawed_at:.1f} s after SIGCONT")


def test_etcd_killed_then_restarted_on_its_data_and_on_a_fresh_one(plane, engines):
    gateways, etcd = plane.gateways, plane.etcd

    # 1) killed: the watches break, the gateways keep routing on their last view
    leases = _registered(etcd.endpoint)
    before = [_restarts(gw, "error") for gw in gateways]
    etcd.kill()
    for gw, n in zip(gateways, before, strict=True):
        wait_for(lambda gw=gw, n=n: _restarts(gw, "error") > n and not _watch_up(gw), 30, "the broken watch")
    for gw in gateways:
        assert _healthy(gw) == {"e0", "e1"}
        assert [m["id"] for m in _get(gw, "/v1/models").json()["data"]] == [MODEL]
        for _ in range(3):
            _served(gw, "while etcd is down")

    # 2) restarted on its data dir: the instances' keys and leases are still there
    started = time.monotonic()
    etcd.start()
    for gw in gateways:
        wait_for(lambda gw=gw: _watch_up(gw), 30, "the watch after etcd's restart")
    resynced = time.monotonic() - started
    wait_for(lambda: set(_registered(etcd.endpoint)) == {"e0", "e1"}, 30, "both engines registered")
    kept = _registered(etcd.endpoint) == leases
    for gw in gateways:
        assert _healthy(gw) == {"e0", "e1"}
    _kv_reaches(gateways[0], gateways[1], "after a restart on the same data")
    print(f"\netcd restarted on its data: watches up {resynced:.1f} s after the start; leases kept: {kept}")

    # 3) killed again and restarted without its data: the engines register again under new leases; the
    #    gateways see etcd's revision go back and give them time, so nobody leaves their view. The engines
    #    are held (SIGSTOP) until both gateways have read the empty etcd: the order that needs the grace
    left = [_left(gw) for gw in gateways]
    etcd.kill()
    for gw in gateways:
        wait_for(lambda gw=gw: not _watch_up(gw), 30, "the broken watch")
    for engine in plane.engines:
        os.killpg(engine.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        etcd.start(fresh=True)
        assert not _registered(etcd.endpoint)
        for gw in gateways:
            wait_for(lambda gw=gw: _watch_up(gw), 30, "the watch on the fresh etcd")
        resynced = time.monotonic() - started
        for gw in gateways:  # what /v1/models lists comes from the view (no call to the held engines)
            assert [m["id"] for m in _get(gw, "/v1/models").json()["data"]] == [MODEL]
    finally:
        for engine in plane.engines:
            os.killpg(engine.proc.pid, signal.SIGCONT)
    released = time.monotonic()
    wait_for(lambda: set(_registered(etcd.endpoint)) == {"e0", "e1"}, 30, "both engines registered again")
    registered = time.monotonic() - released
    for gw, n in zip(gateways, left, strict=True):
        assert _healthy(gw) == {"e0", "e1"}
        assert _left(gw) == n, "an instance left a gateway's view because etcd lost its data"
        _served(gw, "after a fresh etcd")
    _kv_reaches(gateways[1], gateways[0], "after a restart on a fresh data dir")  # snapshots after re-registering
    print(f"etcd restarted on a fresh data dir: watches up {resynced:.1f} s after the start; the engines "
          f"registered again {registered:.1f} s after they were let go")

    # 4) an engine started now is seen by both gateways, and leaves both when stopped
    e2 = engines("e2", *plane.engine_args)
    for gw in gateways:
        wait_for(lambda gw=gw: _healthy(gw) == {"e0", "e1", "e2"}, 120, "the new engine in every view")
    e2.terminate()
    assert e2.wait(60) == 0
    for gw in gateways:
        wait_for(lambda gw=gw: _healthy(gw) == {"e0", "e1"}, 2 * LEASE_TTL, "the stopped engine to leave")


def test_a_gateway_killed_mid_stream_and_restarted_loses_only_its_own_streams(plane, launch_server):
    ga, gb = plane.gateways
    max_tokens = 300
    prompts = [f"Story {i} ({uuid.uuid4().hex}): once upon a time" for i in range(3)]

    async def uninterrupted() -> list[CompletionStream]:
        async with httpx.AsyncClient(base_url=ga.url, timeout=180, trust_env=False) as client:
            return list(await asyncio.gather(*(_stream(client, p, max_tokens) for p in prompts)))

    async def with_b_killed() -> tuple[list[CompletionStream], list[CompletionStream]]:
        async with (httpx.AsyncClient(base_url=ga.url, timeout=180, trust_env=False) as ca,
                    httpx.AsyncClient(base_url=gb.url, timeout=180, trust_env=False) as cb):
            firsts = [asyncio.Event() for _ in range(2 * len(prompts))]
            on_a = [asyncio.ensure_future(_stream(ca, p, max_tokens, firsts[i])) for i, p in enumerate(prompts)]
            # B's streams are long enough (the tiny model has 2,048 positions) that none can end before the
            # kill, however long the last stream's first token took on a busy machine: 300 tokens of the
            # tiny model take a second or two, and a B stream did end before the kill in CI once
            on_b = [asyncio.ensure_future(_stream(cb, f"other {p}", 1800, firsts[len(prompts) + i]))
                    for i, p in enumerate(prompts)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            os.killpg(gb.proc.pid, signal.SIGKILL)
            return list(await asyncio.gather(*on_a)), list(await asyncio.gather(*on_b))

    reference = asyncio.run(uninterrupted())
    got_a, got_b = asyncio.run(with_b_killed())
    gb.proc.wait(30)
    # the other gateway's streams: as if nothing happened (their batches were composed differently
    # from the reference run's, so a greedy stream may part from it at a float near-tie, nowhere else)
    assert all(ref.complete(max_tokens) and len(ref.tokens) == max_tokens for ref in reference)
    assert_same_streams(got_a, reference, greedy=[True] * len(prompts))
    # the killed gateway's own streams broke
    assert all(r.errors and not r.finish for r in got_b), [(len(r.tokens), r.finish, r.errors) for r in got_b]
    # the engines let go of the dead gateway's requests (their load, as heartbeats report it, drops to 0)
    wait_for(lambda: metric_value(_metrics(ga), "xllm:cluster_num_requests_running") == 0, 30,
             "the engines to abort the dead gateway's requests")
    assert _healthy(ga) == {"e0", "e1"}

    started = time.monotonic()
    restarted = launch_server(*plane.gateway_args)  # rebuilds its view from etcd
    plane.gateways[1] = restarted
    wait_for(lambda: _healthy(restarted) == {"e0", "e1"}, 60, "the restarted gateway's view")
    print(f"\nrestarted gateway: both instances in its view {time.monotonic() - started:.1f} s after its start "
          f"(process start and tokenizer load included)")
    for _ in range(3):
        _served(restarted, "after its restart")
    _kv_reaches(restarted, ga, "restarted -> a")


async def _sse_until_text(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> list[tuple[str, str]]:
    """A stream's ``(id, data)`` events as read until its connection breaks (or it ends); sets
    ``started`` once an event with text arrived."""
    events, eid = [], ""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        async with client.stream("POST", path, json=body, headers={"accept": "text/event-stream"}) as r:
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    eid = line[4:]
                elif line.startswith("data: "):
                    events.append((eid, line[6:]))
                    if line != "data: [DONE]" and any(_piece(c) for c in json.loads(line[6:])["choices"]):
                        started.set()
    except httpx.HTTPError:
        pass  # the gateway died
    return events


def _piece(choice: dict) -> str:
    """The text of a choice of a completion or chat chunk."""
    return choice["text"] if "text" in choice else choice["delta"].get("content", "")


def _summary(events: list[tuple[str, str]]) -> tuple[str, list, dict | None]:
    """The text, finish reasons and final usage of a stream's events."""
    chunks = [json.loads(d) for _, d in events if d != "[DONE]" and "choices" in json.loads(d)]
    text = "".join(_piece(c) for ch in chunks for c in ch["choices"])
    return text, [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]], \
        (chunks[-1].get("usage") if chunks else None)


COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def test_a_gateway_killed_mid_stream_its_clients_resume_through_the_other_gateway(plane, launch_server):
    """SIGKILL of a real gateway process with a greedy completion and a seeded chat stream in flight: each client
    reconnects to the other gateway with its stream id and ``Last-Event-ID`` and gets the rest, the
    concatenation equal to an uninterrupted run (text, finish reason, usage), every character once."""
    ga, gb = plane.gateways
    max_tokens = 500  # (a tiny-model stream cannot end between its first text and the kill: seconds apart)
    story = f"Story ({uuid.uuid4().hex}): once upon a time"
    bodies = [{"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True},
               **({"temperature": 0.9, "seed": 77, "messages": [{"role": "user", "content": story}]} if i
                  else {"temperature": 0.0, "prompt": story})} for i in range(2)]

    async def run() -> tuple[list, list, list, list[httpx.Response]]:
        async with (httpx.AsyncClient(base_url=ga.url, timeout=180, trust_env=False) as ca,
                    httpx.AsyncClient(base_url=gb.url, timeout=180, trust_env=False) as cb):
            never = asyncio.Event()
            reference = await asyncio.gather(*(_sse_until_text(ca, b, never) for b in bodies))
            started = [asyncio.Event() for _ in bodies]
            on_b = [asyncio.ensure_future(_sse_until_text(cb, b, s)) for b, s in zip(bodies, started, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
            os.killpg(gb.proc.pid, signal.SIGKILL)
            broken = await asyncio.gather(*on_b)
            resumed = [await ca.get(f"/v1/streams/{json.loads(ev[0][1])['id']}", headers={"Last-Event-ID": ev[-1][0]})
                       for ev in broken]
            rest = [[("", ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")] for r in resumed]
            return reference, broken, rest, resumed

    try:
        reference, broken, rest, resumed = asyncio.run(run())
    finally:
        gb.proc.wait(30)
        plane.gateways[1] = launch_server(*plane.gateway_args)
    for ref, first, more, r in zip(reference, broken, rest, resumed, strict=True):
        assert r.status_code == 200, r.text
        assert first[-1][1] != "[DONE]" and more[-1][1] == "[DONE]"  # broken off, then finished through A
        text = _summary(first)[0]
        rest_text, rest_finish, rest_usage = _summary(more)
        ref_text, ref_finish, ref_usage = _summary(ref)
        assert text and text + rest_text == ref_text  # every character once
        assert rest_finish == ref_finish == ["length"]
        # (the reference run put the prompt in the prefix cache: cached_tokens differ, not the counts)
        assert {k: rest_usage[k] for k in COUNTS} == {k: ref_usage[k] for k in COUNTS}
        assert ref_usage["completion_tokens"] == max_tokens
    wait_for(lambda: _healthy(plane.gateways[1]) == {"e0", "e1"}, 60, "the restarted gateway's view")

"""The registry view, embedded leases, heartbeats into the global KV index, and the router."""

from __future__ import annotations

import asyncio

import pytest

from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.registry import EmbeddedRegistry, NoInstanceError
from xllm.gateway.router import Router
from xllm.kvstore import KVEventLog, block_hashes
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class StubClient:
    """A remote-looking client: records kv_events resync calls, answers from a KVEventLog."""

    def __init__(self, info: instance_pb2.InstanceInfo) -> None:
        self.info = info
        self.closed = False
        self.log: KVEventLog | None = None
        self.resyncs: list[tuple[int, int, bool]] = []

    async def kv_events(self, since_version: int, epoch: int, snapshot: bool = False):
        self.resyncs.append((since_version, epoch, snapshot))
        if self.log is None:
            raise InstanceUnavailableError("gone", self.info.instance_id)
        return self.log.delta(None if snapshot else since_version, epoch)

    healthy = True  # what a Health probe answers

    async def health(self) -> engine_pb2.HealthResponse:
        return engine_pb2.HealthResponse(healthy=self.healthy, status="ok" if self.healthy else "sick")

    async def close(self) -> None:
        self.closed = True


def info(iid: str, model: str = "m", block_size: int = 4) -> instance_pb2.InstanceInfo:
    return instance_pb2.InstanceInfo(instance_id=iid, address=f"127.0.0.1:{len(iid)}",
                                     model=instance_pb2.ModelInfo(served_name=model, block_size=block_size,
                                                                  max_model_len=128))


def heartbeat(iid: str, log: KVEventLog | None = None, since: int | None = None, **load) -> instance_pb2.Heartbeat:
    hb = instance_pb2.Heartbeat(instance_id=iid, load=instance_pb2.LoadReport(instance_id=iid, **load),
                                counters=instance_pb2.EngineCounters(prompt_tokens=7))
    if log is not None:
        hb.kv_events.CopyFrom(log.delta(since))
    return hb


def test_leases_expire_without_heartbeats_and_renew_with_them():
    clock = Clock()
    reg = EmbeddedRegistry(client_factory=StubClient, clock=clock)
    events = []
    reg.add_listener(lambda ev, st: events.append((ev, st.instance_id)))
    lease_a, ttl = reg.grant(info("a"), 3.0)
    lease_b, _ = reg.grant(info("b"), 3.0)
    assert ttl == 3.0 and reg.served_models() == ["m"] and len(reg.instances("m")) == 2
    clock.t += 2.0
    assert reg.keepalive(lease_a, heartbeat("a", num_running=2))
    clock.t += 2.0  # b: 4 s without a heartbeat
    assert reg.expire() == ["b"]
    assert [s.instance_id for s in reg.states()] == ["a"]
    assert reg.get("a").load.num_running == 2 and reg.get("a").counters.prompt_tokens == 7
    assert not reg.keepalive(lease_b)  # its lease is gone: the instance must register again
    reg.revoke(lease_a)
    assert reg.states() == []
    assert events == [("added", "a"), ("added", "b"), ("removed", "b"), ("removed", "a")]


def test_re_registration_replaces_the_old_instance_and_closes_its_client():
    async def run():
        clock = Clock()
        reg = EmbeddedRegistry(client_factory=StubClient, clock=clock)
        old_lease, _ = reg.grant(info("a"), 3.0)
        old = reg.get("a").client
        moved = info("a")
        moved.address = "127.0.0.1:9999"
        clock.t += 4.0  # a live lease of another address keeps the id (test_cluster_security.py); an expired one not
        reg.grant(moved, 3.0)
        await asyncio.wait_for(reg.settled(), 10)  # the old client is closed in the background
        assert reg.get("a").client is not old and old.closed
        assert not reg.keepalive(old_lease)

    asyncio.run(run())


def test_heartbeat_with_another_instance_id_is_refused():
    reg = EmbeddedRegistry(client_factory=StubClient)
    lease, _ = reg.grant(info("a"), 3.0)
    assert not reg.keepalive(lease, heartbeat("b"))


def test_heartbeats_feed_the_global_kv_index_and_gaps_resync_from_the_instance():
    async def run():
        reg = EmbeddedRegistry(client_factory=StubClient)
        lease, _ = reg.grant(info("a"), 3.0)
        client = reg.get("a").client
        log = client.log = KVEventLog("a", 4)
        prompt = list(range(12))
        hashes = block_hashes(prompt, 4)
        log.record([(True, h) for h in hashes[:2]])
        assert reg.keepalive(lease, heartbeat("a", log))  # first: a snapshot
        assert reg.kv_index.match(hashes) == {"a": 2}
        v = log.version
        log.record([(True, hashes[2])])
        lost = log.version
        log.record([(False, hashes[0])])
        assert reg.keepalive(lease, heartbeat("a", log, since=lost))  # the delta up to `lost` never arrived
        await reg.settled()  # the resync task asked the instance
        assert client.resyncs and client.resyncs[0][:2] == (v, log.epoch)
        assert reg.kv_index.match(hashes) == {} and reg.kv_index.holders(hashes[2]) == {"a"}
        reg.revoke(lease)
        assert reg.kv_index.num_blocks() == 0

    asyncio.run(run())


def test_routable_skips_draining_unhealthy_and_failed_instances_until_a_probe_passes():
    """A failure opens an instance's circuit breaker: nothing is routed there (not even when it is
    the last one) until its backoff is over and a Health probe passes; a failed probe reopens it for
    twice as long. A heartbeat reporting an unhealthy engine keeps it out until one says healthy."""

    async def run():
        clock = Clock()
        reg = EmbeddedRegistry(client_factory=StubClient, clock=clock)
        la, _ = reg.grant(info("a"), 3.0)
        lb, _ = reg.grant(info("b"), 3.0)
        reg.keepalive(la, instance_pb2.Heartbeat(instance_id="a", draining=True))
        assert [s.instance_id for s in reg.routable("m")] == ["b"]
        router = Router(reg, "round_robin")
        b = reg.get("b")
        router.failed(b)
        assert reg.routable("m") == []  # never reselected while open
        with pytest.raises(NoInstanceError):
            router.route("m", [1])
        reg.keepalive(la, instance_pb2.Heartbeat(instance_id="a"))
        assert [s.instance_id for s in reg.routable("m")] == ["a"]
        b.client.healthy = False
        clock.t += b.breaker.backoff
        assert [s.instance_id for s in reg.routable("m")] == ["a"]  # the probe started (half-open): not yet
        await reg.settled()
        assert b.breaker.state.value == "open" and b.breaker.backoff == 2 * b.breaker.base_backoff
        b.client.healthy = True
        clock.t += b.breaker.backoff
        reg.routable("m")
        await reg.settled()
        assert {s.instance_id for s in reg.routable("m")} == {"a", "b"} and b.breaker.trips == 2
        reg.keepalive(lb, instance_pb2.Heartbeat(instance_id="b", unhealthy_reason="engine loop crashed"))
        assert [s.instance_id for s in reg.routable("m")] == ["a"]
        reg.keepalive(lb, instance_pb2.Heartbeat(instance_id="b"))
        assert {s.instance_id for s in reg.routable("m")} == {"a", "b"}
        with pytest.raises(NoInstanceError):
            router.route("other", [1])

    asyncio.run(run())


def test_router_matches_prefixes_and_accounts_for_dispatched_work():
    reg = EmbeddedRegistry(client_factory=StubClient)
    la, _ = reg.grant(info("a"), 3.0)
    lb, _ = reg.grant(info("b"), 3.0)
    prompt = list(range(40))
    log = KVEventLog("b", 4)
    log.record([(True, h) for h in block_hashes(prompt, 4)[:8]])
    reg.keepalive(lb, heartbeat("b", log, prefill_tokens_per_s=1000.0))
    reg.keepalive(la, heartbeat("a", prefill_tokens_per_s=1000.0))
    router = Router(reg, "kv_aware")
    t = router.route("m", prompt)
    assert (t.state.instance_id, t.decision.reason, t.matched_tokens, t.uncached_tokens) == ("b", "kv_cache", 32, 8)
    router.dispatched(t, 2)
    assert (t.state.inflight, t.state.pending_prefill, t.state.pending_prompt) == (2, 16, 80)
    # the engine reports whole prompts queued: ours (80) are replaced by their uncached part (16)
    reg.get("b").load.pending_prefill_tokens = 80 + 100
    assert router.snapshot(reg.get("b"), 0).pending_prefill_tokens == 16 + 100
    router.first_token(t)
    router.finished(t)
    router.finished(t, got_first_token=False)
    assert (t.state.inflight, t.state.pending_prefill, t.state.pending_prompt) == (0, 0, 0)
    router.finished(t)  # more finishes than requests change nothing
    assert t.state.inflight == 0
    # a new prefix routed to `a` is expected there before any heartbeat says so
    other = [7] * 40
    t2 = router.route("m", other)
    router.dispatched(t2, 1)
    assert router.route("m", other).state.instance_id == t2.state.instance_id
    assert router.route("m", other, exclude={t2.state.instance_id}).state.instance_id != t2.state.instance_id
    with pytest.raises(NoInstanceError):
        router.route("m", other, exclude={"a", "b"})


def test_single_instance_needs_no_policy_and_no_prefix_matching():
    reg = EmbeddedRegistry(client_factory=StubClient)
    la, _ = reg.grant(info("a"), 3.0)
    prompt = list(range(40))
    log = KVEventLog("a", 4)
    log.record([(True, h) for h in block_hashes(prompt, 4)])
    reg.keepalive(la, heartbeat("a", log))
    t = Router(reg, "kv_aware").route("m", prompt)
    # nothing to choose between: the prompt is not hashed nor matched against the index
    assert (t.state.instance_id, t.decision.reason, t.matched_tokens, t.hashes) == ("a", "only", 0, [])


class FlakyClient:
    """Refuses (unavailable) or streams one-token chunks up to ``max_tokens`` (a resumed request's
    earlier output counted, as an engine counts it), breaking off after ``break_after`` chunks
    (``crash``: as an instance that vanished mid-stream, the request a suspect)."""

    def __init__(self, iid: str, refuse: bool = False, break_after: int | None = None, crash: bool = False) -> None:
        self.info = info(iid)
        self.refuse = refuse
        self.break_after = break_after
        self.crash = crash
        self.submitted: list[engine_pb2.GenerateRequest] = []

    async def submit(self, req, trace=None):
        if self.refuse:
            raise InstanceUnavailableError("draining", self.info.instance_id)
        self.submitted.append(req)
        return self._stream(req)

    async def _stream(self, req):
        n = req.sampling.max_tokens
        earlier = req.resumed_output_tokens
        for k in range(earlier, n):
            if self.break_after is not None and k - earlier == self.break_after:
                raise InstanceUnavailableError("socket closed", self.info.instance_id, crashed=self.crash,
                                               suspect=self.crash)
            chunk = engine_pb2.GenerateResponse(request_id=req.request_id, token_ids=[100 + k], text=f"<{k}>")
            if k == n - 1:
                chunk.finish_reason = engine_pb2.FINISH_REASON_LENGTH
                chunk.usage.prompt_tokens = len(req.prompt_token_ids) - earlier
                chunk.usage.completion_tokens = n
            yield chunk

    async def abort(self, request_id):
        pass


def _dispatch(clients, policy="round_robin", **kw):
    from xllm.gateway.dispatch import Dispatcher

    reg = EmbeddedRegistry()
    for c in clients:
        reg.register(c)
    return Dispatcher(reg, "m", Router(reg, policy), **kw)


def _gen(rid="r", prompt=(1, 2, 3), max_tokens=6):
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=list(prompt),
                                      sampling=engine_pb2.SamplingParams(max_tokens=max_tokens))


def test_a_refusing_instance_is_skipped_and_avoided():
    from xllm.gateway.openai.errors import APIError

    async def run():
        bad, good = FlakyClient("a", refuse=True), FlakyClient("b")
        d = _dispatch([bad, good])
        for _ in range(3):
            client, streams = await d.submit_all("m", [_gen()])
            assert client is good
            assert len([c async for c in streams[0]]) == 6
        assert not d.registry.get("a").breaker.closed and d.registry.get("a").breaker.trips == 1
        d2 = _dispatch([FlakyClient("a", refuse=True), FlakyClient("b", refuse=True)])
        with pytest.raises(APIError) as err:
            await d2.submit_all("m", [_gen()])
        assert err.value.status == 503

    asyncio.run(run())


def test_a_broken_stream_resumes_with_the_tokens_so_far():
    async def run():
        first, second = FlakyClient("a", break_after=2), FlakyClient("b")
        d = _dispatch([first, second])
        d.router.policy._counter = iter([0, 1, 2, 3])  # start on "a"
        client, streams = await d.submit_all("m", [_gen(max_tokens=6)])
        assert client is first
        chunks = [c async for c in streams[0]]
        resumed = second.submitted[0]
        # the continuation carries the prompt plus the 2 tokens already streamed as earlier output, the
        # characters of their text the client has, and the request's own budget
        assert list(resumed.prompt_token_ids) == [1, 2, 3, 100, 101] and resumed.sampling.max_tokens == 6
        assert resumed.resumed_output_tokens == 2 and resumed.resumed_sent_chars == len("<0><1>")
        # under its own id (the broken instance may still hold the first attempt), shown to the client as one
        assert resumed.request_id == "r#1" and {c.request_id for c in chunks} == {"r"}
        assert [t for c in chunks for t in c.token_ids] == [100, 101, 102, 103, 104, 105]
        assert "".join(c.text for c in chunks) == "<0><1><2><3><4><5>"
        assert streams[0].resumes == 1
        st = {s.instance_id: s for s in d.registry.states()}
        assert st["a"].inflight == 0 and st["b"].inflight == 0 and st["a"].pending_prefill == 0

    asyncio.run(run())


def test_a_request_running_through_two_crashes_is_failed_not_replayed():
    """Instances that vanish mid-stream make the request a suspect each time: after the second it
    is failed (an internal error, counted) instead of going to the third instance; a request that
    was a bystander of a crash (the engine said so) is resumed like any other."""
    from xllm.engine_api.wire import RequestFailedError

    async def run():
        crashing = [FlakyClient(i, break_after=1, crash=True) for i in "abc"]
        d = _dispatch(crashing, max_resumes=5)
        _, streams = await d.submit_all("m", [_gen(max_tokens=6)])
        with pytest.raises(RequestFailedError):
            async for _ in streams[0]:
                pass
        assert streams[0].crash_strikes == 2 and streams[0].resumes == 1
        assert sum(len(c.submitted) for c in crashing) == 2  # the third instance never saw it

        bystander = [FlakyClient(i, break_after=1) for i in "abc"]  # broken off, but not suspected
        d = _dispatch(bystander, max_resumes=2)
        _, streams = await d.submit_all("m", [_gen(max_tokens=6)])
        with pytest.raises(InstanceUnavailableError):  # only the resume bound stops it
            async for _ in streams[0]:
                pass
        assert streams[0].resumes == 2 and streams[0].crash_strikes == 0

    asyncio.run(run())


def test_resumes_are_bounded():
    async def run():
        d = _dispatch([FlakyClient("a", break_after=1), FlakyClient("b", break_after=1), FlakyClient("c",
                                                                                                  break_after=1)])
        _, streams = await d.submit_all("m", [_gen(max_tokens=6)])
        with pytest.raises(InstanceUnavailableError):
            async for _ in streams[0]:
                pass

    asyncio.run(run())


def test_every_sampled_request_gets_a_seed_so_a_resume_draws_the_same_tokens():
    async def run():
        client = FlakyClient("a")
        d = _dispatch([client])
        sampled, greedy, seeded = _gen("s"), _gen("g"), _gen("k")
        greedy.sampling.temperature = 0.0
        seeded.sampling.seed = 5
        for r in (sampled, greedy, seeded):
            _, streams = await d.submit_all("m", [r])
            [c async for c in streams[0]]
        got = {r.request_id: r.sampling for r in client.submitted}
        assert got["s"].HasField("seed") and not got["g"].HasField("seed") and got["k"].seed == 5

    asyncio.run(run())


def test_request_progress_names_each_continuation_once_and_times_the_pause():
    """What a stream keeps of its request: chunks shown under the request's id, the pause a move
    makes (its last chunk on the old instance to its first on the new), each ``<id>#<n>`` once."""
    from xllm.gateway.progress import RequestProgress

    p = RequestProgress(_gen())
    first = engine_pb2.GenerateResponse(request_id="r#1", token_ids=[7], text="<7>")
    assert p.sent(first, 1.0) is None and first.request_id == "r"
    p.left("migrated")
    assert p.sent(engine_pb2.GenerateResponse(token_ids=[8], text="x"), 1.5) == ("migrated", 0.5)
    a, b = p.next_continuation(), p.next_continuation()
    assert (a.request_id, b.request_id) == ("r#1", "r#2") and list(b.prompt_token_ids) == [1, 2, 3, 7, 8]
    assert b.resumed_output_tokens == 2 and b.resumed_sent_chars == 4 and p.num_tokens == 5

"""The live cluster page's data (``/dashboard``, :mod:`xllm.gateway.dashboard`) over scripted engines:
the page and its assets (shipped files, a strict CSP, no way out of the assets folder), the snapshot's
content (instances, roles, a flip under way with its reason, pools, load, KV tiers, prefix hits,
latency percentiles and SLO attainment, moves in flight), the events the role controller and the mover
publish, the Server-Sent Events framing of the stream (and what a slow page loses), the API key on the
data routes exactly as on ``/v1/*``, and the request timelines panel (a test double of the tracing's
``RequestTimelines``)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from xllm.gateway.access import AccessPolicy
from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.dashboard.hub import EventHub, RequestTimelines, SnapshotSources, build_snapshot, sse_message
from xllm.gateway.dashboard.routes import DashboardOptions, add_dashboard_routes, event_stream
from xllm.gateway.guard import ApiGuard
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.moves import MoveOptions, Mover
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.roles import PDRoleOptions
from xllm.gateway.router import Router, Ticket
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.enums import role_from_name
from xllm.proto.registry.v1 import instance_pb2
from xllm.sched import RoleFlip, RouteDecision
from xllm.testing.fakes import FAKE_MAX_LEN, FAKE_MODEL, FakeEngineClient, make_info

ROLES = {"p0": "prefill", "d0": "decode", "d1": "decode"}
KEY = "sk-dashboard-test"


def _registry(tokenizer, tokens) -> EmbeddedRegistry:
    registry = EmbeddedRegistry()
    for iid, role in ROLES.items():
        info = make_info(iid)
        info.role = role_from_name(role)
        registry.register(FakeEngineClient(tokenizer, tokens, info))
    return registry


def _state(tokenizer, tokens, **kw) -> GatewayState:
    return GatewayState(registry=_registry(tokenizer, tokens), tokenizer=tokenizer, metrics=EngineMetrics(),
                        default_model=FAKE_MODEL, max_model_len=FAKE_MAX_LEN,
                        pd_roles=PDRoleOptions("static", slo_ttft_s=0.5, slo_tpot_s=0.05, interval=3600.0), **kw)


class Timelines:
    """A test double of the tracing's :class:`RequestTimelines`: two requests, spans nested by parent."""

    def recent(self, limit: int = 50) -> list[dict]:
        spans = [{"name": "gateway.request", "span_id": "a", "parent_id": None, "start_unix": 100.0,
                  "end_unix": 100.5, "attributes": {"model": FAKE_MODEL}},
                 {"name": "engine.prefill", "span_id": "b", "parent_id": "a", "start_unix": 100.05,
                  "end_unix": 100.2, "attributes": {}}]
        reqs = [{"trace_id": f"t{i}", "request_id": f"cmpl-{i}", "name": "POST /v1/completions",
                 "start_unix": 100.0, "duration_s": 0.5, "status": "ok", "spans": spans} for i in range(2)]
        return reqs[:limit]


def test_the_test_double_satisfies_the_protocol():
    timelines: RequestTimelines = Timelines()
    assert timelines.recent(1)[0]["spans"][1]["parent_id"] == "a"


def test_the_page_and_its_assets_are_served_from_the_package_with_a_strict_csp(smollm2_tokenizer, fake_tokens):
    with TestClient(create_app(_state(smollm2_tokenizer, fake_tokens))) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
        for name in ("dashboard.js", "render.js", "replay.js", "dashboard.css"):
            assert f"/dashboard/static/{name}" in page.text
            r = client.get(f"/dashboard/static/{name}")
            assert r.status_code == 200 and len(r.content) > 1000, name
            assert "http://" not in r.text and "https://" not in r.text, f"{name} loads nothing from elsewhere"
        assert client.get("/dashboard/static/dashboard.js").headers["content-type"].startswith("text/javascript")
        for bad in ("nope.js", "..%2F__init__.py", "index.html", "%2E%2E%2Fapp.py"):
            r = client.get(f"/dashboard/static/{bad}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", bad
        assert "/dashboard" not in client.get("/openapi.json").json()["paths"]


def test_the_snapshot_shows_instances_roles_a_flip_with_its_reason_load_kv_and_latencies(smollm2_tokenizer,
                                                                                        fake_tokens):
    state = _state(smollm2_tokenizer, fake_tokens)
    with TestClient(create_app(state)) as client:
        reg = state.registry
        d1 = reg.get("d1")
        d1.client.load_report = instance_pb2.LoadReport(instance_id="d1", num_running=3, num_waiting=2,
                                                        kv_usage=0.42, kv_free_tokens=1234)
        d1.counters = instance_pb2.EngineCounters(prefix_cache_queries=200, prefix_cache_hits=50,
                                                  kv_transfer_bytes=4096, kv_handoffs_installed=2)
        d1.kv_tiers = [instance_pb2.KVTierStats(tier="host", queries=10, hits=4, used_bytes=100,
                                                capacity_bytes=1000, up=True)]
        d1.inflight = 1
        roles = client.app.state.roles
        assert roles.begin(RoleFlip("d1", "decode", "prefill", "TTFT pressure: 3.1x its SLO", "ttft_pressure"))
        router = roles.router
        for v in (0.1, 0.2, 0.3, 0.9):
            router.recent.add("ttft", v)
        for v in (0.01, 0.02, 0.1):
            router.recent.add("tpot", v)
        body = client.get("/dashboard/api/snapshot").json()
        snap = body["snapshot"]
        by_id = {i["id"]: i for i in snap["instances"]}
        assert set(by_id) == set(ROLES) and all(i["model"] == FAKE_MODEL for i in by_id.values())
        assert {i: v["role"] for i, v in by_id.items()} == ROLES
        d = by_id["d1"]
        assert d["flip"]["from"] == "decode" and d["flip"]["to"] == "prefill"
        assert d["flip"]["trigger"] == "ttft_pressure" and d["flip"]["reason"] == "TTFT pressure: 3.1x its SLO"
        assert (d["running"], d["waiting"], d["inflight"], d["kv_free_tokens"]) == (3, 2, 1, 1234)
        assert d["kv_usage"] == pytest.approx(0.42) and d["prefix_hit_rate"] == pytest.approx(0.25)
        assert d["tiers"] == [{"tier": "host", "used_bytes": 100, "capacity_bytes": 1000, "queries": 10, "hits": 4,
                               "up": True}]
        assert d["counters"]["kv_transfer_bytes"] == 4096 and d["health"] == "healthy"
        assert by_id["p0"]["flip"] is None and by_id["p0"]["prefix_hit_rate"] is None
        assert snap["pools"] == {FAKE_MODEL: {"prefill": 1, "decode": 1, "decode_to_prefill": 1}}
        ttft, tpot = snap["latency"]["ttft"], snap["latency"]["tpot"]
        assert ttft["n"] == 4 and ttft["p50"] == pytest.approx(0.25) and ttft["slo"] == 0.5
        assert ttft["attainment"] == pytest.approx(0.75) and tpot["attainment"] == pytest.approx(2 / 3)
        assert snap["latency"]["e2e"] == {"n": 0, "p50": None, "p90": None, "p99": None, "slo": None,
                                          "attainment": None}
        assert snap["latency_series"][-1]["ttft_n"] == 4 and snap["latency_series"][-1]["t"] == 0
        assert snap["window_s"] == 300.0 and snap["requests"] is None and "--otlp-traces-endpoint" in snap[
            "tracing_hint"]
        assert [e["kind"] for e in body["events"]] == ["role_flip_started"]
        d1.inflight = 0
        d1.draining = True
        roles.tick()
        snap = client.get("/dashboard/api/snapshot").json()
        d = next(i for i in snap["snapshot"]["instances"] if i["id"] == "d1")
        assert d["role"] == "prefill" and d["registered_role"] == "decode" and d["flip"] is None
        assert d["health"] == "draining"
        finished = snap["events"][-1]
        assert finished["kind"] == "role_flip_finished" and finished["data"]["outcome"] == "done"
        assert finished["data"]["ended"] >= finished["data"]["started"]
        assert [(r.instance, r.outcome) for r in roles.history] == [("d1", "done")]


def test_moves_are_recorded_in_flight_and_published_when_they_end(smollm2_tokenizer, fake_tokens):
    registry = _registry(smollm2_tokenizer, fake_tokens)
    router = Router(registry, "round_robin")
    hub = EventHub()
    mover = Mover(router, MoveOptions("recompute"), events=hub)
    source = registry.get("d0")
    ticket = Ticket(source, RouteDecision("d0", "test"), 8, 0)
    cont = engine_pb2.GenerateRequest(request_id="cmpl-1#1", prompt_token_ids=list(range(40)))
    plan = mover.offer(FAKE_MODEL, ticket, "cmpl-1", cont, engine_pb2.MoveOffer(num_tokens=40, kv_bytes=9000))
    record = mover.in_flight["cmpl-1#1"]
    assert (record.source, record.destination, record.how, record.tokens, record.outcome) == (
        "d0", "d1", "recompute", 40, "")
    assert [e.kind for e in hub.recent()] == ["move_started"]
    plan.release()
    plan.release()  # once
    assert mover.in_flight == {} and [e.kind for e in hub.recent()] == ["move_started", "move_finished"]
    done = hub.recent()[-1].data
    assert done["outcome"] == "done" and done["ended"] >= done["started"] and mover.history[-1] is record


def test_the_hub_keeps_a_bounded_ring_and_a_slow_subscriber_loses_its_oldest_events():
    async def run():
        hub = EventHub(ring_size=3, queue_size=2)
        sub = hub.subscribe()
        for i in range(5):
            hub.publish("move_started", {"i": i})
        assert [e.seq for e in hub.recent()] == [3, 4, 5] and [e.seq for e in hub.recent(4)] == [5]
        assert sub.dropped == 3 and [sub.queue.get_nowait().seq for _ in range(2)] == [4, 5]
        hub.unsubscribe(sub)
        hub.publish("move_started", {})
        assert sub.queue.empty()
    asyncio.run(run())


def parse_sse(raw: bytes) -> list[dict]:
    """Messages of an SSE byte stream: {"event", "data" (parsed JSON), "id"} or {"retry"}."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        msg: dict = {}
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            msg[field] = json.loads(value) if field == "data" else value
        out.append(msg)
    return out


def test_sse_framing_backlog_then_snapshots_and_live_events_each_once(smollm2_tokenizer, fake_tokens):
    async def run() -> list[dict]:
        registry = _registry(smollm2_tokenizer, fake_tokens)
        hub = EventHub()
        hub.publish("role_flip_started", {"instance": "d1", "reason": "line one\nline two"})
        hub.publish("move_started", {"request_id": "r1"})
        src = SnapshotSources(registry, hub=hub)
        stop = asyncio.Event()
        chunks: list[bytes] = []
        stream = event_stream(hub, src, 1, DashboardOptions(interval_s=0.05, max_stream_s=30), stop.is_set)
        async for chunk in stream:
            chunks.append(chunk)
            text = b"".join(chunks)
            if text.count(b"event: snapshot") == 1 and b"move_finished" not in text:
                hub.publish("move_finished", {"request_id": "r1", "outcome": "done"})
            if text.count(b"event: snapshot") >= 3:
                stop.set()
        assert hub.subscribers == set()  # unsubscribed when the stream ends
        return parse_sse(b"".join(chunks))

    messages = asyncio.run(run())
    assert messages[0] == {"retry": "50"}
    assert messages[1]["event"] == "hello" and messages[1]["data"]["seq"] == 2
    events = [m for m in messages if m.get("event") not in ("hello", "snapshot", None)]
    assert [(m["event"], m["id"], m["data"]["seq"]) for m in events] == [("move_started", "2", 2),
                                                                         ("move_finished", "3", 3)]
    snaps = [m["data"] for m in messages if m.get("event") == "snapshot"]
    assert len(snaps) >= 3 and {i["id"] for i in snaps[0]["instances"]} == set(ROLES)
    assert messages[2]["event"] == "move_started"  # the backlog (after id 1) comes before the first snapshot
    assert sse_message("x", {"a": "b\nc"}, 7) == b'id: 7\nevent: x\ndata: {"a":"b\\nc"}\n\n'


def _short_app(state: GatewayState) -> FastAPI:
    """The page's routes alone behind the gateway's guard, with streams that end after 0.3 s."""
    app = FastAPI()
    app.add_middleware(ApiGuard, access=state.access)
    add_dashboard_routes(app, state, options=DashboardOptions(interval_s=0.05, max_stream_s=0.3))
    return app


def test_the_stream_ends_by_itself_and_the_route_honours_last_event_id(smollm2_tokenizer, fake_tokens):
    app = _short_app(_state(smollm2_tokenizer, fake_tokens))
    hub: EventHub = app.state.dashboard
    hub.publish("move_started", {"request_id": "x"})
    hub.publish("move_started", {"request_id": "y"})
    with TestClient(app) as client:
        r = client.get("/dashboard/api/events", headers={"Last-Event-ID": "1"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert [m["id"] for m in parse_sse(r.content) if "id" in m] == ["2"]
        r = client.get("/dashboard/api/events?after=0")
        assert [m["id"] for m in parse_sse(r.content) if "id" in m] == ["1", "2"]
        assert client.get("/dashboard/api/events?after=-1").status_code == 422


@pytest.mark.parametrize("path", ["/dashboard/api/snapshot", "/dashboard/api/events", "/dashboard/api/requests"])
def test_with_api_keys_the_data_needs_the_key_as_v1_does_and_the_page_does_not(smollm2_tokenizer, fake_tokens,
                                                                               path):
    state = _state(smollm2_tokenizer, fake_tokens, access=AccessPolicy(api_keys=frozenset({KEY})))
    with TestClient(create_app(state)) as client:
        assert client.get("/dashboard").status_code == 200
        assert client.get("/dashboard/static/dashboard.js").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + KEY}):
            r = client.get(path, headers=headers)
            expected = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 == expected.status_code, headers
            assert r.json() == expected.json() and r.json()["error"]["type"] == "authentication_error"
    with TestClient(_short_app(state)) as client:
        assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_requests_panel_shows_tracing_off_or_the_timelines(smollm2_tokenizer, fake_tokens):
    state = _state(smollm2_tokenizer, fake_tokens)
    app = create_app(state)
    with TestClient(app) as client:
        off = client.get("/dashboard/api/requests").json()
        assert off["enabled"] is False and "--otlp-traces-endpoint" in off["hint"]
    hub = EventHub()
    src = SnapshotSources(state.registry, hub=hub, timelines=Timelines(), request_limit=1)
    snap = asyncio.run(build_snapshot(src))
    assert [r["request_id"] for r in snap.requests] == ["cmpl-0"] and snap.tracing_hint == ""
    assert snap.requests[0]["spans"][1]["parent_id"] == "a"

    class Broken:
        def recent(self, limit: int = 50) -> list[dict]:
            raise RuntimeError("exporter gone")

    snap = asyncio.run(build_snapshot(SnapshotSources(state.registry, timelines=Broken())))
    assert snap.requests == [] and "exporter gone" in snap.tracing_hint


def test_streams_share_a_recent_snapshot(smollm2_tokenizer, fake_tokens):
    async def run():
        src = SnapshotSources(_registry(smollm2_tokenizer, fake_tokens), reuse_s=60.0)
        first = await src.snapshot()
        assert await src.snapshot() is first
        src.reuse_s = 0.0
        assert await src.snapshot() is not first
    asyncio.run(run())

"""Dynamic PD roles over real engine servers in this process (a tiny random Qwen3 in float32, one
prefill and two decode instances, KV over ``fd``): instances change role at run time, with no
restart and no reload, while requests keep being served.

- A decode instance flipped to prefill while it decodes a request hands that request over
  (migrated with its KV to the other decode instance, the client's stream unbroken), then takes
  prefills; the prefill instance flipped to decode takes decodes.
- With ``--pd-policy dynamic`` a burst of prompts (TTFT over its SLO) makes a decode instance flip
  to prefill; the next prompts are prefilled on it; once the burst is over (no TTFT measured
  lately, prefill capacity idle) it flips back.

Oracles: every request answered, its tokens Hugging Face transformers' greedy choice at every
position (teacher forced), its text that of one engine serving it whole; the flips as counted in the gateway's metrics
(``xllm:pd_role_flips_total``, ``xllm:pd_instances``) and the roles the router uses. Thresholds and
cool-downs are made small through the options; the test waits on metrics and state, never on time.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry

from xllm.core import EngineConfig, LLMEngine
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.metrics import MoveMetrics, PDMetrics, PDRoleMetrics, RouterMetrics
from xllm.gateway.moves import MoveOptions, Mover
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.roles import LatencyWindow, PDRoleOptions, RoleController
from xllm.gateway.router import Router
from xllm.proto.engine.v1 import engine_pb2
from xllm.sched import RoleFlip
from xllm.testing.engine import Collected, generate, make_request
from xllm.testing.processes import until
from xllm.testing.served import ServedEngines

transformers = pytest.importorskip("transformers")
models = pytest.importorskip("xllm.models")

from xllm.testing.models import IdTokenizer, save_random_hf_model, tiny_qwen3_config  # noqa: E402

MODEL = "tiny-qwen3"
ROLES = {"p0": "prefill", "d0": "decode", "d1": "decode"}
GREEDY = dict(max_tokens=64, ignore_eos=True)
FLIP_AFTER = 4  # chunks the client has read when its decode instance is flipped
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The checkpoint (random weights) and HF's model of it, and prompts of 24 to 68 tokens."""
    config = tiny_qwen3_config()
    path = tmp_path_factory.mktemp("qwen3")
    hf = save_random_hf_model(path, config, seed=3)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, config.vocab_size, (24 + 4 * i,), generator=g).tolist() for i in range(12)]
    return path, hf, prompts


def new_engine(path) -> LLMEngine:
    """An engine over its own copy of the model: the fused forward of a model object binds one KV
    cache at a time, so engines stepping on concurrent threads must not share one."""
    return LLMEngine(models.load_model(path, torch.float32, progress=False), IdTokenizer(),
                     EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=512, max_num_seqs=16,
                                  num_threads=1))


class Cluster:
    """The served instances, the gateway's dispatcher and its role controller, over one registry."""

    def __init__(self, path, options: PDRoleOptions, moves: str = "auto") -> None:
        self.registry = EmbeddedRegistry()
        self.served = ServedEngines(ROLES, lambda: new_engine(path), "fd", MODEL)
        self.nodes = self.served.nodes
        self.prom = CollectorRegistry()
        self.router = Router(self.registry, "kv_aware", metrics=RouterMetrics(self.prom))
        mover = Mover(self.router, MoveOptions(moves), MoveMetrics(self.prom))
        self.dispatcher = Dispatcher(self.registry, MODEL, self.router, pd_metrics=PDMetrics(self.prom), mover=mover)
        self.roles = RoleController(self.registry, self.router, options, PDRoleMetrics(self.prom))

    async def __aenter__(self) -> Cluster:
        await self.served.start(self.registry)
        await self.roles.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.roles.stop()
        await self.served.stop()
        await self.registry.close()

    def metric(self, name: str, **labels: str) -> float:
        return self.prom.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0

    def flips(self, from_role: str, to_role: str, reason: str) -> float:
        return self.metric("xllm:pd_role_flips_total", from_role=from_role, to_role=to_role, reason=reason)

    def pools(self) -> dict[str, float]:
        return {pool: self.metric("xllm:pd_instances", role=pool)
                for pool in ("prefill", "decode", "decode_to_prefill", "prefill_to_decode")}

    def role(self, iid: str) -> str:
        return self.registry.get(iid).role

    async def place(self, rid: str, prompt: list[int]):
        _, (stream,) = await self.dispatcher.submit_all(MODEL, [make_request(rid, prompt, **GREEDY)])
        return stream

    async def holds_nothing(self, iid: str) -> None:
        engine = self.nodes[iid].engine
        await until(lambda: not engine.requests and engine.kv.num_free_blocks == engine.layout.num_blocks, 10,
                    f"{iid} holding nothing")


async def collect(stream) -> Collected:
    got = Collected()
    async for chunk in stream:
        got.add([chunk])
    return got


def assert_hf_greedy(case, prompt: list[int], got: Collected, rid: str) -> None:
    path, hf, _ = case
    out = got.tokens[rid]
    assert len(out) == GREEDY["max_tokens"] and got.final[rid].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    with torch.inference_mode():
        hf_greedy = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:].argmax(-1).tolist()
    assert out == hf_greedy, f"{rid}: not HF's greedy tokens"
    whole = generate(new_engine(path), [make_request(rid, prompt, **GREEDY)])
    assert got.text[rid] == whole.text[rid] and got.tokens[rid] == whole.tokens[rid]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@pytest.mark.parametrize("moves", ["migrate", "recompute"])
def test_flipped_roles_hand_running_requests_over_and_serve_the_other_phase(case, moves):
    path, _, prompts = case

    async def main():
        async with Cluster(path, PDRoleOptions("static", interval=0.02), moves) as c:
            stream = await c.place("a", prompts[0])
            got, chunks, flipped = Collected(), 0, ""
            async for chunk in stream:
                got.add([chunk])
                chunks += 1
                if chunks == FLIP_AFTER:  # decoding now (the first chunk came from p0)
                    flipped = stream._stream.decode.state.instance_id
                    assert c.roles.begin(RoleFlip(flipped, "decode", "prefill", "test: hand over", "manual"))
                    assert c.router.pd_pools(MODEL)[0] == [c.registry.get("p0")]  # in neither pool meanwhile
                    assert flipped not in {s.instance_id for s in c.router.pd_pools(MODEL)[1]}
            await until(lambda: c.role(flipped) == "prefill" and c.registry.get(flipped).flip is None, 10,
                        f"{flipped} a prefill instance")
            await c.holds_nothing(flipped)
            other = "d1" if flipped == "d0" else "d0"
            handed = ({how: c.metric("xllm:request_moves_total", how=how) for how in ("migrated", "recomputed")},
                      c.nodes[flipped].server.counters().kv_migrations_sent,
                      c.nodes[other].server.counters().kv_migrations_installed)
            # and the other direction: p0 becomes a decode instance; the flipped one is the only prefill one now
            assert c.roles.begin(RoleFlip("p0", "prefill", "decode", "test: more decode", "manual"))
            await until(lambda: c.role("p0") == "decode", 10, "p0 a decode instance")
            prefills, decodes = c.router.pd_pools(MODEL)
            assert [s.instance_id for s in prefills] == [flipped] and {s.instance_id for s in decodes} == {"p0", other}
            second = await collect(await c.place("b", prompts[1]))
            return got, second, handed, c.nodes[flipped].server.counters().kv_handoffs_sent, \
                {k: c.flips(*k, "manual") for k in (("decode", "prefill"), ("prefill", "decode"))}, c.pools()

    got, second, handed, sent, flips, pools = run(main())
    assert_hf_greedy(case, prompts[0], got, "a")
    assert_hf_greedy(case, prompts[1], second, "b")
    migrated = moves == "migrate"        # request a left the flipped instance with its KV, or was recomputed
    assert handed == ({"migrated": migrated, "recomputed": not migrated}, migrated, migrated)
    assert sent == 1                     # request b was prefilled on it
    assert flips == {("decode", "prefill"): 1, ("prefill", "decode"): 1}
    assert pools == {"prefill": 1, "decode": 2, "decode_to_prefill": 0, "prefill_to_decode": 0}


def test_a_burst_of_prompts_flips_a_decode_instance_to_prefill_and_back(case):
    """TTFT SLO far below anything measurable (every first token is pressure), TPOT SLO far above
    (never pressure); no hysteresis window, short cool-downs, measured latencies kept 2 s."""
    path, _, prompts = case
    options = PDRoleOptions("dynamic", slo_ttft_s=1e-4, slo_tpot_s=100.0, window_s=0.0, cooldown_s=0.3,
                            cluster_cooldown_s=0.0, interval=0.02, latency_window_s=2.0)

    async def main():
        async with Cluster(path, options) as c:
            assert c.roles.tick() == []  # nothing measured yet: no pressure
            burst = await asyncio.gather(*(c.place(f"w1-{i}", p) for i, p in enumerate(prompts[:8])))
            first = await asyncio.gather(*(collect(s) for s in burst))
            await until(lambda: c.flips("decode", "prefill", "ttft_pressure") == 1, 30, "a decode instance flipped")
            flipped = next(iid for iid in ("d0", "d1") if c.role(iid) == "prefill")
            at_flip = c.pools()
            # the next prompts, placed one after another: each sees the prefill work queued before it
            streams = [await c.place(f"w2-{i}", p) for i, p in enumerate(prompts[8:])]
            second = await asyncio.gather(*(collect(s) for s in streams))
            prefilled_by_flipped = c.nodes[flipped].server.counters().kv_handoffs_sent
            await until(lambda: c.flips("prefill", "decode", "prefill_idle") == 1, 30, "the flip back")
            roles = {iid: c.role(iid) for iid in ROLES}
            settled = [c.roles.tick() for _ in range(3)]
            return first + second, at_flip, prefilled_by_flipped, roles, settled, c.pools()

    results, at_flip, prefilled_by_flipped, roles, settled, pools = run(main())
    for i, (got, prompt) in enumerate(zip(results, prompts)):
        rid = f"w1-{i}" if i < 8 else f"w2-{i - 8}"
        assert_hf_greedy(case, prompt, got, rid)
    assert at_flip == {"prefill": 2, "decode": 1, "decode_to_prefill": 0, "prefill_to_decode": 0}
    assert prefilled_by_flipped >= 1
    assert roles == ROLES            # the instance that flipped is the one that flipped back
    assert settled == [[], [], []]   # one of each role left: nothing more can flip
    assert pools == {"prefill": 1, "decode": 2, "decode_to_prefill": 0, "prefill_to_decode": 0}


def test_health_and_metrics_show_a_flip_under_way_and_done(smollm2_tokenizer, fake_tokens):
    """Through the app (scripted engines): ``/health`` shows each PD instance's role and a flip under
    way (holding a request), ``/metrics`` the pools, the flips counted by direction and reason, and
    the instance's role label moved."""
    from fastapi.testclient import TestClient

    from xllm.gateway.app import GatewayState, create_app
    from xllm.gateway.metrics import EngineMetrics
    from xllm.proto.enums import role_from_name
    from xllm.testing.fakes import FAKE_MAX_LEN, FAKE_MODEL, FakeEngineClient, make_info
    from xllm.testing.metrics import metric_value, parse_metrics

    registry = EmbeddedRegistry()
    for iid, role in ROLES.items():
        info = make_info(iid)
        info.role = role_from_name(role)
        registry.register(FakeEngineClient(smollm2_tokenizer, fake_tokens, info))
    state = GatewayState(registry=registry, tokenizer=smollm2_tokenizer, metrics=EngineMetrics(),
                         default_model=FAKE_MODEL, max_model_len=FAKE_MAX_LEN,
                         pd_roles=PDRoleOptions("static", interval=3600.0))  # no background tick meanwhile
    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        roles: RoleController = client.app.state.roles
        registry.get("d1").inflight = 1  # a request still decoding there
        assert roles.begin(RoleFlip("d1", "decode", "prefill", "operator asked", "manual"))
        health = client.get("/health").json()["instances"]
        assert health["p0"] == {"healthy": True, "status": "ok", "role": "prefill"}
        flip = health["d1"].pop("flip")
        assert health["d1"] == {"healthy": True, "status": "ok", "role": "decode"}
        assert (flip["to"], flip["trigger"], flip["reason"], flip["holding"]) == ("prefill", "manual",
                                                                                 "operator asked", 1)
        m = parse_metrics(client.get("/metrics").text)
        assert metric_value(m, "xllm:pd_instances", role="decode_to_prefill") == 1
        assert metric_value(m, "xllm:pd_instances", role="decode") == 1
        assert metric_value(m, "xllm:pd_role_flips_total", missing_ok=True) == 0
        registry.get("d1").inflight = 0  # it ended: the next round completes the flip
        roles.tick()
        health = client.get("/health").json()["instances"]
        assert health["d1"] == {"healthy": True, "status": "ok", "role": "prefill", "registered_role": "decode"}
        m = parse_metrics(client.get("/metrics").text)
        assert metric_value(m, "xllm:pd_role_flips_total", from_role="decode", to_role="prefill", reason="manual") == 1
        assert metric_value(m, "xllm:pd_instances", role="prefill") == 2
        assert metric_value(m, "xllm:instance_role", instance="d1", role="prefill") == 1
        assert metric_value(m, "xllm:instance_role", missing_ok=True, instance="d1", role="decode") == 0
        assert metric_value(m, "xllm:pd_role_flip_seconds_count", from_role="decode", to_role="prefill") == 1


def test_a_latency_window_nobody_reads_stays_bounded():
    """The gateway measures every streamed chunk, also where no role controller reads the window (no PD
    instances): samples past the horizon are dropped as new ones come, and the mean is unchanged."""
    window = LatencyWindow(horizon=10.0)
    for i in range(10_000):
        window.add(i * 0.5, 1.0 if i < 9_990 else 3.0)
    assert len(window) == 21  # t = 4990 .. 4999.5
    assert window.mean(4999.5) == (11 * 1.0 + 10 * 3.0) / 21

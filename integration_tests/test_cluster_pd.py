"""``xllm serve --prefill-instances 2 --decode-instances 1`` on the real model: the gateway starts
three engine processes by role and serves every request as a prefill/decode pair over the ``fd``
transport. The oracle is one in-process engine on the same weights (fp32): same text and finish
reason, greedy and seeded. The decode side's prefix cache shows in the usage, the roles and the
transfers in ``/metrics``; a prefill process killed (SIGKILL) mid-prefill is replaced by the other
one without the client noticing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid

import httpx
import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.engine_api.registration.etcd_client import EtcdClient
from xllm.models import Tokenizer, load_model
from xllm.proto.enums import role_name
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.engine import generate, make_request
from xllm.testing.metrics import metric_value, parse_metrics
from xllm.testing.processes import child_processes, wait_for

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
ROLES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}
SYSTEM = ("You are the help desk of a city library. Answer in two sentences, name the floor, and suggest one "
          "related book when you can.")


@pytest.fixture(scope="module")
def pd(launch_server):
    # --block-size 16: fp32 SmolLM2's smallest page-aligned block, so that the short shared system prompt
    # fills whole blocks (the 128-token default would leave it in a partial one, never shared)
    gw = launch_server("--prefill-instances", "2", "--decode-instances", "1", "--dtype", "float32",
                       "--threads", "1", "--kv-cache-memory", "0.2", "--block-size", "16")
    try:
        def all_up():
            body = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json()
            return {k for k, v in body["instances"].items() if v["healthy"]} == set(ROLES)

        wait_for(all_up, 120, "the prefill and decode engine processes registered")
        yield gw
    finally:
        gw.stop()  # the gateway stops its engines; stop() fails if any process of the group is left


@pytest.fixture(scope="module")
def reference(smollm2_fp32, smollm2_tokenizer):
    """``reference(prompt, **sampling)``: one in-process engine's whole answer (tokens, text, finish)."""
    engine = LLMEngine(smollm2_fp32, smollm2_tokenizer, EngineConfig(dtype=torch.float32, max_model_len=2048,
                                                                       kv_cache_memory_gib=0.2, num_threads=1))

    def _run(prompt: list[int], **sampling):
        got = generate(engine, [make_request("ref", prompt, **sampling)])
        return got.tokens["ref"], got.text["ref"], got.final["ref"].finish_reason

    return _run


def _complete(gw, prompt: list[int], model: str = MODEL, **sampling) -> dict:
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": model, "prompt": prompt, **sampling},
                   timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def _scrape(gw) -> dict:
    return parse_metrics(httpx.get(f"{gw.url}/metrics", timeout=10, trust_env=False).text)


def _chat(tok, question: str) -> list[int]:
    return tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=11)], ids=["greedy", "seeded"])
def test_pd_answers_equal_one_engine_and_reuse_the_decode_side_prefix(pd, reference, smollm2_tokenizer, sampling):
    tok = smollm2_tokenizer
    first, second = _chat(tok, "Where are the atlases?"), _chat(tok, "Do you lend e-readers?")
    for prompt in (first, second):
        body = _complete(pd, prompt, max_tokens=24, **sampling)
        _, text, finish = reference(prompt, max_tokens=24, **sampling)
        assert body["choices"][0]["text"] == text
        assert body["choices"][0]["finish_reason"] == {1: "stop", 2: "length"}[finish]
    # the second prompt shares the system prompt: its decode instance held those blocks already
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_metrics_show_the_roles_and_the_transfers(pd, smollm2_tokenizer):
    _complete(pd, _chat(smollm2_tokenizer, "What are the opening hours?"), max_tokens=4, temperature=0.0)
    m = _scrape(pd)
    for iid, role in ROLES.items():
        assert metric_value(m, "xllm:instance_role", instance=iid, role=role) == 1.0
    assert metric_value(m, "xllm:kv_transfer_bytes_total", transport="fd") > 0
    assert metric_value(m, "xllm:kv_transfer_seconds_count", transport="fd") >= 1
    for phase in ("queue", "prefill", "transfer", "first_decode"):
        assert metric_value(m, "xllm:pd_ttft_breakdown_seconds_count", phase=phase) >= 1
    assert metric_value(m, "xllm:kv_transfer_failures_total", missing_ok=True) == 0

    def counted_by_the_instances():  # the instances' own counters arrive with their next heartbeats
        s = _scrape(pd)
        return (metric_value(s, "xllm:kv_handoffs_total", missing_ok=True, instance="decode-0", outcome="installed")
                >= 1 and metric_value(s, "xllm:kv_handoffs_total", missing_ok=True, outcome="sent") >= 1)

    wait_for(counted_by_the_instances, 10, "the instances' hand-off counters")


def _stream(gw, prompt: list[int], out: dict) -> None:
    """A streaming completion; records the text, the finish reason and when the first token came."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "stream": True}
    text, out["finish"] = [], None
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=120, trust_env=False) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                out.setdefault("first_token_at", time.monotonic())
                text.append(choice["text"])
                out["finish"] = choice.get("finish_reason") or out["finish"]
            if "error" in event:
                out["error"] = event["error"]
    out["text"] = "".join(text)


def test_a_prefill_process_killed_mid_prefill_is_replaced(pd, reference, smollm2_tokenizer):
    """Runs last in the module: one prefill process is gone afterwards."""
    tok = smollm2_tokenizer
    story = " ".join(f"Shelf {i} of the east wing holds maps of region {i * 7 % 13} and river {i % 5}."
                     for i in range(60))
    prompt = tok.encode(story)  # ~1000 tokens: long enough a prefill to kill it in the middle
    assert len(prompt) > 800
    before = _scrape(pd)
    accepted = {iid: metric_value(before, "xllm:router_requests_total", missing_ok=True, instance=iid)
                for iid in ("prefill-0", "prefill-1")}
    pids = {argv[argv.index("--instance-id") + 1]: pid
            for pid, argv in child_processes(pd.proc.pid).items() if "--instance-id" in argv}
    out: dict = {}
    client = threading.Thread(target=_stream, args=(pd, prompt, out))
    client.start()

    def prefill_started():  # the gateway counts a prefill instance's request once it accepted it
        m = _scrape(pd)
        return next((iid for iid, n in accepted.items()
                     if metric_value(m, "xllm:router_requests_total", missing_ok=True, instance=iid) > n), None)

    victim = wait_for(prefill_started, 60, "a prefill instance accepting the request", interval=0.01)
    os.kill(pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    client.join(120)
    assert not client.is_alive()
    assert out["status"] == 200 and "error" not in out, out
    assert out["first_token_at"] > killed_at  # it really died before its first token
    _, text, _ = reference(prompt, max_tokens=16)
    assert out["text"] == text and out["finish"] == "length"
    m = _scrape(pd)
    assert metric_value(m, "xllm:pd_prefill_retries_total", instance=victim) == 1
    assert metric_value(m, "xllm:router_instance_failures_total", missing_ok=True, instance=victim) >= 1


def test_an_etcd_cluster_serves_pd_with_the_roles_it_finds(etcd, engines, tiny_model_dir, launch_server):
    """Engines started on their own (``xllm engine --role``) register their role in etcd; a gateway
    on the same etcd finds one of each and serves in PD mode, here over the ``grpc`` transport."""
    prefix = f"/xllm-pd-{uuid.uuid4().hex[:8]}"
    common = ("--model", str(tiny_model_dir), "--served-model-name", "tiny", "--etcd", etcd.endpoint,
              "--etcd-prefix", prefix, "--kv-transfer", "grpc")
    started = [engines("p0", *common, "--role", "prefill"), engines("d0", *common, "--role", "decode")]
    gw = launch_server("--model", str(tiny_model_dir), "--served-model-name", "tiny", "--etcd", etcd.endpoint,
                       "--etcd-prefix", prefix)
    try:
        def both_up():
            body = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json()
            return {k for k, v in body["instances"].items() if v["healthy"]} == {"p0", "d0"}

        wait_for(both_up, 120, "the prefill and decode engines registered in etcd")
        roles = asyncio.run(_roles_in_etcd(etcd.endpoint, prefix))
        assert roles == {"p0": "prefill", "d0": "decode"}
        prompt = list(range(300, 420))
        body = _complete(gw, prompt, max_tokens=12, temperature=0.0, ignore_eos=True, model="tiny")
        model = load_model(tiny_model_dir, torch.float32, progress=False)
        got = generate(LLMEngine(model, Tokenizer(tiny_model_dir), EngineConfig(dtype=torch.float32, num_threads=1,
                                                                               kv_cache_memory_gib=0.05)),
                       [make_request("ref", prompt, max_tokens=12, ignore_eos=True)])
        assert body["choices"][0]["text"] == got.text["ref"]
        m = _scrape(gw)
        assert metric_value(m, "xllm:kv_transfer_bytes_total", transport="grpc") > 0
        assert metric_value(m, "xllm:instance_role", instance="p0", role="prefill") == 1.0
    finally:
        gw.stop()
        for engine in started:
            engine.stop()


async def _roles_in_etcd(endpoint: str, prefix: str) -> dict[str, str]:
    client = EtcdClient(endpoint)
    try:
        _, kvs = await client.get_prefix(prefix + "/instances/")
    finally:
        await client.close()
    return {info.instance_id: role_name(info.role)
            for info in (instance_pb2.InstanceInfo.FromString(kv.value) for kv in kvs)}

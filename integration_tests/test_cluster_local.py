"""``xllm serve --instances 2``: the gateway starts two engine processes that register with its
embedded registry over gRPC, routes between them, reports their counters (beam search's among them,
equal to what an engine in this process counts for the same searches) and takes them down with it."""

from __future__ import annotations

import httpx
import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.metrics import metric_value, parse_metrics
from xllm.testing.processes import wait_for

MODEL = "tiny"
BEAM_PROMPT = [1000 + (i * 37) % 500 for i in range(24)]
BEAM_SERIES = {"xllm:beam_steps_total": "steps", "xllm:beam_rows_total": "rows",
               "xllm:beam_candidates_scanned_total": "candidates_scanned",
               "xllm:beam_early_terminations_total": "early_terminations"}


@pytest.fixture(scope="module")
def gw(tiny_model_dir, launch_server):
    """``xllm serve --instances 2`` (round robin), both engine processes registered; stopped by the module."""
    server = launch_server("--model", str(tiny_model_dir), "--served-model-name", MODEL, "--instances", "2",
                           "--routing", "round_robin", "--dtype", "float32", "--kv-cache-memory", "0.05",
                           "--threads", "1")
    try:
        def both_up():
            body = httpx.get(f"{server.url}/health", timeout=10, trust_env=False).json()
            return {k for k, v in body["instances"].items() if v["healthy"]} == {"engine-0", "engine-1"}

        wait_for(both_up, 120, "both engine processes registered")
        yield server
    finally:
        server.stop()  # SIGTERM: the gateway stops its engines; stop() fails if any process of the group is left
    assert "started engine-1" in server.log_tail(400)


def test_serve_instances_starts_engines_routes_and_stops_them(gw, tiny_model_dir):
    seen = []
    for i in range(4):
        r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 4},
                       timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        seen.append(r.headers["x-xllm-instance"])
    assert sorted(seen) == ["engine-0", "engine-0", "engine-1", "engine-1"]  # round robin over both
    models = httpx.get(f"{gw.url}/v1/models", timeout=10, trust_env=False).json()["data"]
    assert [m["id"] for m in models] == [MODEL]

    def metrics_of_both():  # per-instance counters arrive with the next heartbeats (every 0.5 s)
        text = httpx.get(f"{gw.url}/metrics", timeout=10, trust_env=False).text
        return 'xllm:cluster_instances{model_name="tiny"} 2.0' in text and all(
            f'xllm:generation_tokens_total{{instance="{iid}",model_name="tiny"}}' in text
            for iid in ("engine-0", "engine-1"))

    wait_for(metrics_of_both, 10, "per-instance and cluster metrics")
    _check_beam_metrics(gw.url, tiny_model_dir)


def _search(engine: LLMEngine, rid: str, **sampling) -> engine_pb2.GenerateResponse:
    engine.add_request(engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=BEAM_PROMPT,
                                                  sampling=engine_pb2.SamplingParams(beam_width=4, **sampling)))
    final = None
    while engine.has_work():
        final = next((c for c in engine.step() if c.finish_reason), final)
    return final


def _check_beam_metrics(url: str, model_dir) -> None:
    """Three beam searches through the gateway (to either engine process): their beam counters, which
    the engines report in their heartbeats, reach ``/metrics`` under the embedded mode's names, summed
    over the instances equal to an engine's in this process for the same searches: the four best first
    tokens (a search of one token), a search of six, and one that those tokens end (four hypotheses
    after its first token: early stopping ends it there)."""
    from xllm.models import Tokenizer, load_model

    local = LLMEngine(load_model(model_dir, torch.float32, progress=False), Tokenizer(model_dir),
                      EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, num_threads=1))
    stops = sorted(b.token_ids[0] for b in _search(local, "top", max_tokens=1).beams)
    _search(local, "six", max_tokens=6, ignore_eos=True)
    _search(local, "early", max_tokens=6, ignore_eos=True, stop_token_ids=stops, early_stopping="true")
    want = local.beams.counters
    assert want.early_terminations == 1 and want.steps == 5 and want.candidates_scanned > 0, want
    local.close()
    for body in ({"max_tokens": 1}, {"max_tokens": 6, "ignore_eos": True},
                 {"max_tokens": 6, "ignore_eos": True, "stop_token_ids": stops, "early_stopping": True}):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": BEAM_PROMPT, "n": 4,
                                                       "use_beam_search": True, **body}, timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 4

    def reported() -> dict[str, float]:
        m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text)
        return {name: metric_value(m, name, missing_ok=True, model_name=MODEL) for name in BEAM_SERIES}

    expected = {name: float(getattr(want, field)) for name, field in BEAM_SERIES.items()}
    wait_for(lambda: reported() == expected, 10, f"the engines' beam counters in /metrics: {expected}")


def test_a_gateway_whose_engines_all_fail_to_start_exits(tiny_model_dir, tmp_path):
    """An engine that cannot start (here: its weights are missing) is not waited on forever: each exit is logged,
    and once every engine process has exited the gateway stops with status 1, saying why."""
    import shutil
    import sys

    from xllm.testing.processes import free_port, spawn, stop_process_group

    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    log = tmp_path / "serve.log"
    proc = spawn([sys.executable, "-m", "xllm.gateway", "serve", "--model", str(broken), "--served-model-name", MODEL,
                  "--instances", "2", "--port", str(free_port()), "--no-progress", "--dtype", "float32",
                  "--kv-cache-memory", "0.05", "--threads", "1"], log)
    try:
        code = proc.wait(timeout=120)
    finally:
        stop_process_group(proc, 30)
    text = log.read_text(errors="replace")
    assert code == 1, text[-3000:]
    assert "engine process engine-0 exited with status" in text and "engine process engine-1 exited" in text
    assert "every engine process this gateway started has exited" in text

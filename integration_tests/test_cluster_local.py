"""``xllm serve --instances 2``: the gateway starts two engine processes that register with its
embedded registry over gRPC, routes between them, and takes them down with it."""

from __future__ import annotations

import httpx

from xllm.testing.processes import wait_for

MODEL = "tiny"


def test_serve_instances_starts_engines_routes_and_stops_them(tiny_model_dir, launch_server):
    gw = launch_server("--model", str(tiny_model_dir), "--served-model-name", MODEL, "--instances", "2",
                       "--routing", "round_robin", "--dtype", "float32", "--kv-cache-memory", "0.05",
                       "--threads", "1")
    try:
        def both_up():
            body = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json()
            return {k for k, v in body["instances"].items() if v["healthy"]} == {"engine-0", "engine-1"}

        wait_for(both_up, 120, "both engine processes registered")
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
    finally:
        gw.stop()  # SIGTERM: the gateway stops its engines; stop() fails if any process of the group is left
    assert "started engine-1" in gw.log_tail(400)

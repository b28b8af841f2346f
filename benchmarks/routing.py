"""Routing benchmark: round robin vs least load vs KV-cache-aware routing across engine instances.

    python -m benchmarks routing                      # 2 instances, the three policies, side by side
    python -m benchmarks routing --prefixes 8 --users 12 --rate 2 --kv-cache-memory 0.08

The workload is the one KV-aware routing exists for: several long system prompts (``--prefixes``,
``--prefix-len`` tokens each), many users each (``--users``), every request = one system prompt + the
user's own question (``--suffix-len`` tokens), shuffled, arriving as a Poisson process (``--rate``).
The engines' KV cache (``--kv-cache-memory``) is sized so one instance cannot keep every system prompt
cached (the default holds about 70 % of them): spreading every prompt over every instance makes them
evict each other, while routing each prompt to the instance that holds it lets the instances' caches
add up (RTP-LLM §5.2, xLLM §3.4).

For each policy the harness starts ``xllm serve --instances N --routing POLICY`` (fresh engine
processes, so caches start cold), waits for all N instances, warms them up with unrelated short
requests, replays the same workload, reads the engines' prefix-cache counters from the gateway's
``/metrics`` and stops the server. Per policy it reports the prefix-cache hit rate (cached prompt
tokens / prompt tokens, from each response's ``usage.prompt_tokens_details.cached_tokens``), the share
of requests that hit, TTFT p50/p95/p99 and E2E p50 (client side, streaming), throughput, and how the
requests spread over the instances. Results: ``results.json`` and ``summary.md`` in ``--out``
(default ``benchmarks/results/routing-<timestamp>``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import sys
import time
from dataclasses import asdict, dataclass

from benchmarks.client import stream_routed
from benchmarks.metrics import parse, router_reasons, total
from benchmarks.peers.xllm import model_dir as xllm_model_dir
from benchmarks.peers.xllm import wait_instances
from benchmarks.report import pct
from benchmarks.scenario import Output, Scenario, attempt
from benchmarks.stats import percentile

POLICIES = ("round_robin", "least_load", "kv_aware")


@dataclass(frozen=True)
class RoutingRequest:
    prefix: int                  # which system prompt
    user: int
    prompt_ids: tuple[int, ...]
    output_len: int
    arrival: float               # seconds after the run starts


@dataclass
class Result:
    prefix: int
    user: int
    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    instance: str | None = None
    error: str = ""


def build_workload(prefixes: list[tuple[int, ...]], suffixes: list[list[tuple[int, ...]]], output_len: int,
                   rate: float, seed: int = 0) -> list[RoutingRequest]:
    """Every (system prompt, user) pair once, shuffled, at Poisson arrivals of ``rate`` req/s."""
    from benchmarks.workload import poisson_arrivals

    pairs = [(p, u) for p in range(len(prefixes)) for u in range(len(suffixes[p]))]
    random.Random(seed).shuffle(pairs)
    arrivals = poisson_arrivals(rate, len(pairs), seed)
    return [RoutingRequest(p, u, prefixes[p] + suffixes[p][u], output_len, t) for (p, u), t in zip(pairs, arrivals)]


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if not r.error]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    e2e = [r.e2e * 1000 for r in ok if r.e2e is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    by_instance: dict[str, int] = {}
    for r in ok:
        by_instance[r.instance or "?"] = by_instance.get(r.instance or "?", 0) + 1
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "hit_rate": cached / prompt if prompt else 0.0,
        "requests_with_hit": sum(1 for r in ok if r.cached_tokens) / len(ok) if ok else 0.0,
        "ttft_ms": {f"p{q}": percentile(ttft, q) for q in (50, 95, 99)},
        "e2e_ms": {"p50": percentile(e2e, 50), "p95": percentile(e2e, 95)},
        "duration_s": duration, "req_per_s": len(ok) / duration if duration else 0.0,
        "by_instance": dict(sorted(by_instance.items())),
    }


def markdown(runs: dict[str, dict], meta: dict) -> str:
    lines = [
        f"# Routing: {meta['instances']} instances, {meta['prefixes']} system prompts x {meta['users']} users",
        "",
        f"Model {meta['model']} ({meta['dtype']}), prompts {meta['prefix_len']} + {meta['suffix_len']} tokens, "
        f"{meta['output_len']} output tokens, Poisson {meta['rate']} req/s, KV cache {meta['kv_cache_memory']} GiB "
        f"per instance, {meta['threads']} thread(s) per instance. CPU busy before/after: "
        f"{pct(meta.get('cpu_busy_before'))} / {pct(meta.get('cpu_busy_after'))}.",
        "",
        "| policy | prefix-cache hit rate | requests with a hit | engine hit rate (incl. warm-up) | TTFT p50 (ms) "
        "| TTFT p95 (ms) | TTFT p99 (ms) | E2E p50 (ms) | req/s | failed | requests per instance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy, run in runs.items():
        s = run["summary"]
        engine = run.get("engine_hit_rate")
        spread = ", ".join(f"{k}: {v}" for k, v in s["by_instance"].items())
        lines.append(
            f"| {policy} | {s['hit_rate']:.1%} | {s['requests_with_hit']:.0%} | "
            f"{'–' if engine is None else f'{engine:.1%}'} | {s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p95']:.0f} | "
            f"{s['ttft_ms']['p99']:.0f} | {s['e2e_ms']['p50']:.0f} | {s['req_per_s']:.2f} | {s['failed']} | {spread} |")
    return "\n".join(lines) + "\n"


# ---- running ------------------------------------------------------------------------------------

async def _send(client, url: str, model: str, req: RoutingRequest, t0: float) -> Result:
    delay = t0 + req.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": model, "prompt": list(req.prompt_ids), "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    got = await stream_routed(client, url, body)
    output = got.usage["completion_tokens"] if got.usage else 0
    return Result(req.prefix, req.user, len(req.prompt_ids), got.cached_tokens, output, got.ttft, got.e2e,
                  got.instance, got.error)


async def replay(base_url: str, model: str, workload: list[RoutingRequest]) -> tuple[list[Result], float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_send(client, base_url + "/v1/completions", model, r, t0)
                                         for r in workload))
        return list(results), time.perf_counter() - t0


def engine_hit_rate(metrics_text: str) -> float | None:
    """Prefix-cache hits / queries summed over the instances, from the gateway's /metrics."""
    samples = parse(metrics_text)
    queries = total(samples, "xllm:prefix_cache_queries_total")
    return total(samples, "xllm:prefix_cache_hits_total") / queries if queries else None


def run_policy(policy: str, args: argparse.Namespace, model_dir: pathlib.Path, workload: list[RoutingRequest],
               warmup: list[RoutingRequest], log_dir: pathlib.Path) -> dict:
    import httpx

    from benchmarks.peers.venv import ServerProcess, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "xllm.gateway", "serve", "--model", str(model_dir), "--port", str(port),
           "--instances", str(args.instances), "--routing", policy, "--dtype", args.dtype,
           "--threads", str(args.threads), "--kv-cache-memory", str(args.kv_cache_memory),
           "--max-num-seqs", str(args.max_num_seqs), "--no-progress", "--log-level", "warning"]
    server = ServerProcess(f"xllm-{policy}", cmd, port, log_dir / f"serve-{policy}.log", health_path="/health")
    with server:  # starts it (waits for /health) and stops it by PID
        wait_instances(server.base_url, args.instances)
        model = httpx.get(server.base_url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        asyncio.run(replay(server.base_url, model, warmup))
        print(f"[routing] {policy}: {len(workload)} requests ...", flush=True)
        results, duration = asyncio.run(replay(server.base_url, model, workload))
        metrics = httpx.get(server.base_url + "/metrics", timeout=10, trust_env=False).text
    summary = summarize(results, duration)
    print(f"[routing] {policy}: hit rate {summary['hit_rate']:.1%}, TTFT p50 {summary['ttft_ms']['p50']:.0f} ms, "
          f"p95 {summary['ttft_ms']['p95']:.0f} ms, failed {summary['failed']}, reasons {router_reasons(metrics)}",
          flush=True)
    return {"summary": summary, "engine_hit_rate": engine_hit_rate(metrics), "reasons": router_reasons(metrics),
            "startup_s": server.startup_seconds,
            "records": [asdict(r) for r in results]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated routing policies")
    p.add_argument("--instances", type=int, default=2, help="engine processes (2)")
    p.add_argument("--prefixes", type=int, default=6, help="distinct system prompts (6)")
    p.add_argument("--prefix-len", type=int, default=640, help="tokens per system prompt (640)")
    p.add_argument("--users", type=int, default=10, help="users (requests) per system prompt (10)")
    p.add_argument("--suffix-len", type=int, default=32, help="tokens of each user's own question (32)")
    p.add_argument("--output-len", type=int, default=16, help="output tokens per request (16)")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, req/s (1.0)")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="KV cache per instance (default: room for ~70%% of the system prompts, see above)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per instance (1)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=None)


def default_kv_memory_gib(model_dir: pathlib.Path, dtype: str, prefixes: int, prefix_len: int,
                          fraction: float = 0.7) -> float:
    """KV memory that holds ``fraction`` of all system prompts (plus a few requests' own tokens)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * (2 if dtype == "bfloat16"
                                                                                         else 4)
    tokens = fraction * prefixes * prefix_len + 4 * 64
    return round(tokens * per_token / 2**30, 4)


def summary(results: dict) -> str:
    return markdown(results["runs"], results["meta"])


def run(args: argparse.Namespace, output: Output) -> dict | int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    from xllm.sched import ROUTING_POLICIES

    bad = [p for p in policies if p not in ROUTING_POLICIES]
    if bad:
        print(f"python -m benchmarks routing: error: unknown policies {bad}", file=sys.stderr)
        return 2
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.prompts import PromptBank

    model_dir = xllm_model_dir(args.model)
    if args.kv_cache_memory is None:
        args.kv_cache_memory = default_kv_memory_gib(model_dir, args.dtype, args.prefixes, args.prefix_len)
    out = output.open()
    bank = PromptBank(model_dir)
    rng = random.Random(args.seed)
    prefixes = [bank.prompt(args.prefix_len, rng).ids for _ in range(args.prefixes)]
    suffixes = [[bank.prompt(args.suffix_len, rng).ids for _ in range(args.users)] for _ in range(args.prefixes)]
    workload = build_workload(prefixes, suffixes, args.output_len, args.rate, args.seed)
    warmup = [RoutingRequest(-1, i, bank.prompt(24, rng).ids, 2, 0.0) for i in range(2 * args.instances)]
    meta = output.meta(args, model=model_dir.name, model_dir=str(model_dir))
    print(f"[routing] {len(workload)} requests, {args.instances} instances, KV {args.kv_cache_memory} GiB each, "
          f"policies {', '.join(policies)}; results in {out}", flush=True)
    results: dict = {"meta": meta, "runs": {}, "errors": {}}
    for policy in policies:
        r = attempt(results["errors"], policy, "routing", run_policy, policy, args, model_dir, workload, warmup,
                    out / "logs")
        if r is not None:
            results["runs"][policy] = r
        output.save(results)
    meta["cpu_busy_after"] = cpu_busy_fraction()
    return results


SCENARIO = Scenario("routing", "round robin vs least load vs KV-aware routing, 2 instances", __doc__, add_arguments,
                    run, summary)

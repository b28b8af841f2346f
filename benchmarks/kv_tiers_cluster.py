"""KV tiers, the cluster part of ``python -m benchmarks kv_tiers``: tier-aware routing on two engines.

The chat trace every part of the benchmark replays is built here too (:func:`chat_trace`): multi-turn
chats on four shared system prompts, whose assistant turns are fixed texts (not the model's output), so
every configuration and policy sees exactly the same prompts.

The cluster: etcd, two ``xllm engine`` processes (one thread each) and an ``xllm serve --etcd`` gateway
with the routing policy under test. Each engine has a host tier (T1) of its own, as two machines
would (separate ``/dev/shm`` directories), and in the ``host+store`` variant both also join one Mooncake
store (T3, a master on loopback). The chats arrive staggered (4 s apart), each turn after the previous
answer and a think time (8 s on average): about a quarter of the two engines' capacity on a quiet
machine, so that TTFT shows hits and misses rather than queueing; no session ids are sent (an id
pins a chat to one instance under any ``kv_aware`` variant, which would hide what the index knows).
The engines' registration lease is 10 s (a CPU-starved engine's late heartbeat is no failure here).
Policies on the same trace:

- ``kv_aware``: tier-aware (the global index's lower-tier blocks, each tier's measured load speed);
- ``kv_aware_t0``: the same policy blind to the lower tiers (only engine memory counts);
- ``least_load``: fewest outstanding requests.

Before the trace each engine is warmed up over its own gRPC service so that both have measured their
tiers' load speeds (tier-aware routing counts a tier whose speed is unknown as recompute): two long
prompts in turn (the second evicts the first to T1, whose reload is timed) and, with the store, the
other engine's first prompt (loaded from T3).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import random
import sys
import time
from dataclasses import asdict, dataclass

from benchmarks.client import stream_routed
from benchmarks.clusters import share_cluster_token
from benchmarks.stats import percentile

POLICIES = ("kv_aware", "kv_aware_t0", "least_load")
VARIANTS = ("host", "host+store")
ETCD_PREFIX = "/xllm-kv-tiers"
MODEL_NAME = "smollm2"

SYSTEMS = [
    "You are a careful assistant for a hardware store. Answer in one short sentence, name the aisle, and never "
    "invent products the store does not sell. ",
    "You are a terse librarian. Recommend exactly one book per question, give its author, and say nothing about "
    "films or music. ",
    "You are a travel agent for rail journeys in Europe. Quote the train, the change stations and the duration. ",
    "You are a kitchen assistant. Give one recipe step at a time, metric quantities, and warn about allergens. ",
]
QUESTIONS = ["What should I do first?", "And after that?", "Is there a cheaper option?", "How long will it take?",
             "What if it rains?", "Can you say it differently?", "Which one do you recommend?", "Anything else?"]
ANSWERS = [
    "Start with the simplest option: it costs little, takes a few minutes and tells you whether the rest is needed.",
    "Then compare the two remaining choices side by side, and keep the one that fits your budget and your time.",
    "Yes, there is a cheaper way, but it takes longer and needs a little more care at every step along the way.",
    "Count on about an hour in total, a bit more the first time, and less once you know what to expect from it.",
    "If it rains, wait for a dry day: the result will be better and you will not have to start over next week.",
    "In other words: begin small, check the result, and only then move on to the bigger and costlier steps.",
    "I would recommend the second one: it is the most reliable, and the small extra cost pays for itself soon.",
    "Nothing else for now. Come back with the result of the first step and we will decide on the next one together.",
]


NOTES = [f"Item {i}: the {c} {t} on shelf {i % 7 + 1} costs {3 + i % 11} euros and weighs {i % 5 + 1} kilograms."
         for i, (c, t) in enumerate((c, t) for c in ("red", "blue", "green", "black", "white", "grey")
                                    for t in ("hammer", "drill", "saw", "ladder", "lamp", "pump", "brush"))]


def chat_trace(tok, sessions: int, turns: int, seed: int = 0, system_repeat: int = 6,
               notes: int = 0) -> list[list[list[int]]]:
    """Per session, per turn, the prompt's token ids: the chat so far (session ``s`` opens with system prompt
    ``s % 4``, repeated ``system_repeat`` times; with ``notes``, its first user message carries that many
    lines of notes of its own, about 20 tokens each: a long prefix no other chat shares) and a new user
    question, the assistant turns being fixed texts, so each turn's prompt extends the last one's and every
    run sees the same prompts."""
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        history = [{"role": "system", "content": SYSTEMS[s % len(SYSTEMS)] * system_repeat}]
        prompts = []
        for t in range(turns):
            question = rng.choice(QUESTIONS)
            if t == 0 and notes:
                question = "My notes:\n" + "\n".join(rng.sample(NOTES, notes)) + "\n" + question
            history.append({"role": "user", "content": question})
            prompts.append(list(tok.apply_chat_template(history)))
            history.append({"role": "assistant", "content": rng.choice(ANSWERS)})
        out.append(prompts)
    return out


def working_set_tokens(trace: list[list[list[int]]], block_size: int = 1) -> int:
    """Distinct prompt tokens of the trace (each session's last prompt; shared system prompts once), in
    whole blocks of ``block_size``: what the KV tiers would hold to serve every prefix again."""
    from xllm.kvstore import block_hashes

    blocks = {h for session in trace for h in block_hashes(session[-1], block_size)}
    return len(blocks) * block_size


# ---- the client ----------------------------------------------------------------------------------------

@dataclass
class TurnResult:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int = 0
    ttft: float | None = None
    instance: str | None = None
    error: str = ""


async def _turn(client, url: str, model: str, session: int, turn: int, prompt: list[int],
                max_tokens: int) -> TurnResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    got = await stream_routed(client, url, body)
    return TurnResult(session, turn, len(prompt), got.cached_tokens, got.ttft, got.instance, got.error)


async def run_chats(base_url: str, model: str, trace: list[list[list[int]]], start_gap: float, think_mean: float,
                    max_tokens: int, seed: int = 0) -> tuple[list[TurnResult], float]:
    """Replay ``trace``: chat ``s`` starts at ``s * start_gap`` seconds, each turn after the previous answer and
    an exponential think time (mean ``think_mean``; the same draws in every run). Returns every turn's result
    and the wall time."""
    import httpx

    rng = random.Random(seed)
    thinks = [[rng.expovariate(1 / think_mean) for _ in session] for session in trace]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as client:
        async def chat(s: int) -> list[TurnResult]:
            await asyncio.sleep(s * start_gap)
            out = []
            for t, prompt in enumerate(trace[s]):
                out.append(await _turn(client, base_url + "/v1/completions", model, s, t, prompt, max_tokens))
                await asyncio.sleep(thinks[s][t])
            return out

        began = time.perf_counter()
        per_chat = await asyncio.gather(*(chat(s) for s in range(len(trace))))
        return [r for rs in per_chat for r in rs], time.perf_counter() - began


def summarize(results: list[TurnResult], duration: float) -> dict:
    """Hit rate (cached prompt tokens, blocks loaded from lower tiers included, over prompt tokens), TTFT
    p50/p99 over all turns and over the turns after the first (a chat's first turn has nothing of its own
    to reuse), and the spread over the instances."""
    ok = [r for r in results if not r.error and r.ttft is not None]
    later = [r for r in ok if r.turn > 0]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    spread: dict[str, int] = {}
    for r in ok:
        spread[r.instance or "?"] = spread.get(r.instance or "?", 0) + 1
    return {"requests": len(results), "failed": len(results) - len(ok),
            "hit_rate": cached / prompt if prompt else 0.0,
            "later_turn_hit_rate": (sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later)
                                    if later else 0.0),
            "ttft_p50_ms": percentile([r.ttft * 1e3 for r in ok], 50),
            "ttft_p99_ms": percentile([r.ttft * 1e3 for r in ok], 99),
            "later_turn_ttft_p50_ms": percentile([r.ttft * 1e3 for r in later], 50),
            "later_turn_ttft_p99_ms": percentile([r.ttft * 1e3 for r in later], 99),
            "duration_s": round(duration, 1), "by_instance": dict(sorted(spread.items()))}


def tier_hits(metrics_text: str) -> dict[str, dict[str, float]]:
    """``xllm:kv_tier_hits_total`` per instance and tier, from the gateway's ``/metrics``."""
    from benchmarks.metrics import parse

    out: dict[str, dict[str, float]] = {}
    for labels, value in parse(metrics_text).get("xllm:kv_tier_hits_total", []):
        out.setdefault(labels.get("instance", "?"), {})[labels.get("tier", "?")] = value
    return out


# ---- the cluster ---------------------------------------------------------------------------------------

@dataclass
class ClusterSettings:
    model_dir: pathlib.Path
    out: pathlib.Path
    kv_gib: float            # each engine's KV memory (T0)
    host_gib: float          # each engine's own host tier (T1)
    store_segment_gib: float  # what each engine lends the Mooncake store (T3), host+store variant
    max_tokens: int = 8
    start_gap: float = 4.0   # seconds between chats' first turns
    think_mean: float = 8.0  # mean think time between a chat's turns (exponential)
    seed: int = 0
    lease_ttl: float = 10.0  # the engines' registration lease: a CPU-starved engine's late heartbeat is no failure


def _engine_cmd(s: ClusterSettings, iid: str, port: int, etcd: str, host_dir: pathlib.Path, store) -> list[str]:
    cmd = [sys.executable, "-m", "xllm.gateway", "engine", "--model", str(s.model_dir), "--served-model-name",
           MODEL_NAME, "--instance-id", iid, "--port", str(port), "--etcd", etcd, "--etcd-prefix", ETCD_PREFIX,
           "--dtype", "bfloat16", "--threads", "1", "--max-num-seqs", "8", "--kv-cache-memory", str(s.kv_gib),
           "--kv-host-memory", str(s.host_gib), "--kv-host-dir", str(host_dir), "--lease-ttl", str(s.lease_ttl),
           "--no-progress", "--log-level", "warning"]
    if store is not None:
        cmd += ["--kv-store", store.url, "--mooncake-metadata", store.metadata_url,
                "--kv-store-segment", str(s.store_segment_gib)]
    return cmd


async def _warm_up(ports: dict[str, int], prompts: dict[str, list[list[int]]], with_store: bool) -> None:
    """Over each engine's own gRPC service: its two prompts in turn, then its first again (evicted by the
    second: loaded from T1); with the store, then the other engine's first prompt (loaded from T3)."""
    from xllm.engine_api.client import GrpcEngineClient
    from xllm.engine_api.security import TOKEN_ENV, ClusterSecurity
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.proto.registry.v1 import instance_pb2

    security = ClusterSecurity(token=os.environ[TOKEN_ENV])  # the engines' (share_cluster_token)
    clients = {iid: GrpcEngineClient(instance_pb2.InstanceInfo(instance_id=iid, address=f"127.0.0.1:{port}"),
                                     security=security)
               for iid, port in ports.items()}
    ids = sorted(ports)
    plan = [(iid, prompts[iid][j]) for iid in ids for j in (0, 1, 0)]
    if with_store:
        plan += [(ids[1], prompts[ids[0]][0]), (ids[0], prompts[ids[1]][0])]
    try:
        for n, (iid, prompt) in enumerate(plan):
            req = engine_pb2.GenerateRequest(request_id=f"warm-{n}", prompt_token_ids=prompt,
                                             sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=2))
            async for _ in await clients[iid].submit(req):
                pass
            await asyncio.sleep(0.5)  # the write-down of what this request evicted
    finally:
        for client in clients.values():
            await client.close()


def run_policy(policy: str, variant: str, s: ClusterSettings, trace: list[list[list[int]]],
               warmup: dict[str, list[list[int]]]) -> dict:
    """One fresh cluster (etcd, engines, store, gateway), warmed up, replaying ``trace`` under ``policy``."""
    import tempfile

    import httpx

    from benchmarks.peers.venv import ServerProcess, free_port
    from benchmarks.peers.xllm import wait_instances
    from xllm.kvstore.mooncake_local import start_local_mooncake
    from xllm.testing.processes import EtcdServer, spawn, stop_process_group

    name = f"{variant}-{policy}"
    logs = s.out / "logs" / f"{name}-{time.strftime('%H%M%S')}"
    logs.mkdir(parents=True, exist_ok=True)
    etcd = EtcdServer(logs / "etcd")
    etcd.work.mkdir(parents=True, exist_ok=True)
    store = engines = gateway = None
    with tempfile.TemporaryDirectory(prefix="xllm-kvt-", dir="/dev/shm") as shm:
        try:
            share_cluster_token()
            etcd.start()
            store = start_local_mooncake(logs / "mooncake") if variant == "host+store" else None
            ports = {iid: free_port() for iid in ("e0", "e1")}
            engines = {iid: spawn(_engine_cmd(s, iid, port, etcd.endpoint, pathlib.Path(shm) / iid, store),
                                  logs / f"engine-{iid}.log") for iid, port in ports.items()}
            port = free_port()
            gateway = ServerProcess(f"gateway-{name}", [
                sys.executable, "-m", "xllm.gateway", "serve", "--model", str(s.model_dir), "--served-model-name",
                MODEL_NAME, "--port", str(port), "--etcd", etcd.endpoint, "--etcd-prefix", ETCD_PREFIX,
                "--routing", policy, "--no-progress", "--log-level", "warning"], port, logs / "gateway.log",
                health_path="/health")
            gateway.start(timeout=600)
            wait_instances(gateway.base_url, 2)
            asyncio.run(_warm_up(ports, warmup, store is not None))
            time.sleep(2.0)  # heartbeats carry the warm-up's blocks and tier speeds to the gateway
            before = httpx.get(gateway.base_url + "/metrics", timeout=10, trust_env=False).text
            print(f"[kv_tiers] cluster {name}: {sum(map(len, trace))} turns ...", flush=True)
            results, duration = asyncio.run(run_chats(gateway.base_url, MODEL_NAME, trace, s.start_gap,
                                                      s.think_mean, s.max_tokens, s.seed))
            time.sleep(1.5)
            after = httpx.get(gateway.base_url + "/metrics", timeout=10, trust_env=False).text
        finally:
            if gateway is not None:
                with contextlib.suppress(Exception):
                    gateway.stop()
            for proc in (engines or {}).values():
                with contextlib.suppress(Exception):
                    stop_process_group(proc, 30.0)
            if store is not None:
                store.stop()
            with contextlib.suppress(Exception):
                etcd.stop()
    from benchmarks.metrics import router_reasons

    hits_before, hits_after = tier_hits(before), tier_hits(after)
    hits = {iid: {t: v - hits_before.get(iid, {}).get(t, 0.0) for t, v in tiers.items()}
            for iid, tiers in hits_after.items()}
    summary = summarize(results, duration)
    print(f"[kv_tiers] cluster {name}: hit rate {summary['hit_rate']:.1%}, TTFT p50 {summary['ttft_p50_ms']:.0f} "
          f"ms, p99 {summary['ttft_p99_ms']:.0f} ms, spread {summary['by_instance']}, tier hits {hits}", flush=True)
    return {"summary": summary, "tier_hits": hits, "warmup_tier_hits": hits_before,
            "reasons": router_reasons(after), "turns": [asdict(r) for r in results]}


def run_cluster(s: ClusterSettings, trace: list[list[list[int]]], warmup: dict[str, list[list[int]]],
                variants: tuple[str, ...] = VARIANTS, policies: tuple[str, ...] = POLICIES,
                rounds: int = 1) -> dict[str, dict[str, list[dict]]]:
    """Every variant x policy, each on a fresh cluster, ``rounds`` times (every other round in the reverse
    order of policies: drift of the machine's load hits them alike); ``{variant: {policy: [run, ...]}}``.
    A failed run is recorded and the next one goes on."""
    runs: dict[str, dict[str, list[dict]]] = {}
    for rnd in range(rounds):
        for variant in variants:
            for policy in (policies if rnd % 2 == 0 else policies[::-1]):
                try:
                    run = run_policy(policy, variant, s, trace, warmup)
                except Exception as exc:
                    run = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                    print(f"[kv_tiers] cluster {variant}-{policy} failed: {exc}", flush=True)
                runs.setdefault(variant, {}).setdefault(policy, []).append(run)
    return runs

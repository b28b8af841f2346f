"""KV tiers below engine memory (issue 15): hit rate and TTFT of multi-turn chats whose working set is
several times the engine's KV memory with T0 only and with each lower tier added; the break-even prompt
length between loading a prefix from a tier and recomputing it on this CPU; and tier-aware routing on a
2-engine cluster against routing blind to the tiers.

    python -m benchmarks kv_tiers [--out DIR] [--quick] [--parts sessions,break_even,cluster]
    python -m benchmarks kv_tiers --report DIR      # rebuild summary.md and kv_tiers.png from DIR/results.json

1. **Sessions** (in-process engine on the real SmolLM2, bf16, xTensor, one request at a time, so TTFT is
   the engine's own: queueing, lookups, loads and prefill, no HTTP): ``--sessions`` chats on 4 shared
   system prompts take ``--turns`` turns round-robin (:func:`benchmarks.kv_tiers_cluster.chat_trace`: the
   assistant turns are fixed texts, so every configuration sees the same prompts), and a chat's history
   has usually left T0 by its next turn. Configurations, each tier added to the previous ones: T0 only;
   + T1 host (``/dev/shm``, 2x T0); + T2 disk (4x T0); + T3 Mooncake store (a master on loopback; left
   out without Mooncake). Reported: hit rate (prompt tokens not prefilled, loaded blocks included, over
   all prompt tokens), TTFT p50/p99, and the blocks each tier served.
2. **Break-even**: for prefixes of L tokens, TTFT when the prefix is recomputed versus loaded from each
   tier alone (written down and dropped from T0 first; the disk tier's pages dropped from the OS page
   cache, so T2 reads come from the disk).
3. **Cluster** (:mod:`benchmarks.kv_tiers_cluster`): two engine processes, each with a host tier of its
   own (and, in the ``host+store`` variant, one shared Mooncake store), behind a gateway routing with
   ``kv_aware`` (tier-aware), ``kv_aware_t0`` (blind to the tiers) or ``least_load``, on the same trace:
   the chats with notes of their own in their first message (``--cluster-notes``), so that most of a
   chat's prefix is its own and where its blocks are matters.

Writes ``results.json``, ``summary.md`` and ``kv_tiers.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import random
import statistics
import tempfile
import time

from benchmarks.kv_tiers_cluster import POLICIES, VARIANTS
from benchmarks.kv_tiers_report import break_even_fit, markdown, plot
from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario

HERE = pathlib.Path(__file__).resolve().parent
KV_GIB = 0.015  # T0: ten 64-token blocks of SmolLM2's bf16 KV
HOST_GIB, DISK_GIB, STORE_GIB = 2 * KV_GIB, 4 * KV_GIB, 1.0  # the lower tiers of the sessions part
CLUSTER_HOST_GIB = 0.1  # each cluster engine's own host tier (two hold about the cluster trace's working set)


def _engine(model, tok, threads: int, kv_gib: float, run: str = "", **tiers):
    """An engine over the lower tiers ``tiers``; ``run`` names a namespace of its own (blocks another run
    left in a shared store or directory are never found)."""
    import torch

    from xllm.core import EngineConfig, LLMEngine

    return LLMEngine(model, tok, EngineConfig(dtype=torch.bfloat16, num_threads=threads, max_model_len=2048,
                                              kv_cache_memory_gib=kv_gib, max_num_seqs=8,
                                              kv_model_identity=f"smollm2-bench{run}", **tiers))


def _ttft(eng, rid: str, prompt: list[int], max_tokens: int) -> float:
    """Run one request alone; its TTFT (from adding it to its first token)."""
    from xllm.proto.engine.v1 import engine_pb2

    began = time.perf_counter()
    sampling = engine_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)
    eng.add_request(engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
    ttft = None
    while eng.has_work():
        for c in eng.step():
            if c.request_id == rid and c.token_ids and ttft is None:
                ttft = time.perf_counter() - began
    return ttft


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# ---- 1. sessions ---------------------------------------------------------------------------------
def sessions(model, tok, threads: int, trace: list[list[list[int]]], tiers: dict, run: str) -> dict:
    """The chats on one engine over ``tiers``, which start empty (a namespace of its own: ``run``)."""
    from benchmarks.kv_tiers_cluster import working_set_tokens

    eng = _engine(model, tok, threads, KV_GIB, run, **tiers)
    ttfts, prompt_tokens = [], 0
    try:
        _ttft(eng, "warmup", tok.encode("Hello there, how are you today?"), 2)
        before = eng.kv.prefix_stats
        for turn in range(len(trace[0])):
            for s, chat in enumerate(trace):
                ttfts.append(_ttft(eng, f"s{s}-t{turn}", chat[turn], 4))
                prompt_tokens += len(chat[turn])
        if eng.kv.lower is not None:
            eng.kv.lower.store.flush(60)
        prefix = eng.kv.prefix_stats
        tier_stats = {name: {"hits": s.hits, "queries": s.queries, "corrupt": s.corrupt, "bytes_read": s.bytes_read,
                             "bytes_written": s.bytes_written, "load_seconds": round(s.load_seconds, 4),
                             "read_mb_per_s": round(s.bytes_read / s.load_seconds / 1e6, 1) if s.load_seconds else None}
                      for name, s in eng.kv.tier_stats().items()}
        return {"requests": len(ttfts), "prompt_tokens": prompt_tokens,
                "working_set_tokens": working_set_tokens(trace, eng.layout.block_size),
                "t0_capacity_tokens": eng.layout.num_blocks * eng.layout.block_size,
                "hit_rate": round((prefix.hits - before.hits) / max(1, prefix.queries - before.queries), 4),
                "ttft_p50_ms": round(_pct(ttfts, 0.5) * 1e3, 1), "ttft_p99_ms": round(_pct(ttfts, 0.99) * 1e3, 1),
                "ttft_mean_ms": round(statistics.fmean(ttfts) * 1e3, 1), "tiers": tier_stats}
    finally:
        eng.close()


def session_configs(tmp: pathlib.Path, shm: pathlib.Path, mooncake) -> dict[str, dict]:
    """T0 only, then each lower tier added to the previous ones."""
    host = {"kv_host_memory_gib": HOST_GIB, "kv_host_dir": str(shm / "host")}
    disk = {**host, "kv_disk_dir": str(tmp / "disk"), "kv_disk_size_gib": DISK_GIB}
    configs = {"t0": {}, "+host": host, "+host+disk": disk}
    if mooncake is not None:
        configs["+host+disk+store"] = {**disk, **_store(mooncake, STORE_GIB)}
    return configs


def _store(mooncake, gib: float) -> dict:
    return {"kv_store": mooncake.url, "kv_store_metadata": mooncake.metadata_url, "kv_store_segment_gib": gib}


# ---- 2. break-even ---------------------------------------------------------------------------------
def _drop_page_cache(directory: str) -> None:
    """Drop the disk tier's files from the OS page cache (posix_fadvise per file; nothing global)."""
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def break_even(model, tok, threads: int, lengths: list[int], reps: int, tier: str, tiers: dict) -> dict:
    eng = _engine(model, tok, threads, 0.25, f"-be-{tier}", **tiers)
    rng = random.Random(1)
    rows = []
    try:
        _ttft(eng, "warmup", [rng.randrange(100, 40000) for _ in range(300)], 1)
        for length in lengths:
            recompute, load = [], []
            for rep in range(reps):
                prompt = [rng.randrange(100, 40000) for _ in range(length + 1)]
                recompute.append(_ttft(eng, f"r{length}-{rep}", prompt, 1))  # computed: nothing cached yet
                eng.kv.evict_cached()  # written down, gone from T0
                eng.kv.lower.store.flush(60)
                if tier == "disk":
                    _drop_page_cache(tiers["kv_disk_dir"])
                load.append(_ttft(eng, f"l{length}-{rep}", prompt, 1))  # loaded from the tier
                eng.kv.evict_cached()
            rows.append({"prefix_tokens": length, "recompute_ms": round(statistics.median(recompute) * 1e3, 1),
                         "load_ms": round(statistics.median(load) * 1e3, 1)})
        stats = eng.kv.tier_stats()[tier]
        return {"rows": rows, "read_mb_per_s": round(stats.bytes_read / stats.load_seconds / 1e6, 1)
                if stats.load_seconds else None,
                "load_ms_per_block": round(stats.load_seconds / stats.hits * 1e3, 2) if stats.hits else None,
                "block_tokens": eng.layout.block_size, **break_even_fit(rows)}
    finally:
        eng.close()


def break_even_configs(tmp: pathlib.Path, shm: pathlib.Path, mooncake) -> dict[str, dict]:
    """Each tier alone, roomy."""
    configs = {"host": {"kv_host_memory_gib": 1.0, "kv_host_dir": str(shm / "be-host")},
               "disk": {"kv_disk_dir": str(tmp / "be-disk"), "kv_disk_size_gib": 2.0}}
    if mooncake is not None:
        configs["store"] = _store(mooncake, 1.0)
    return configs


# ---- driver ------------------------------------------------------------------------------------------
def _start_mooncake(tmp: pathlib.Path):
    try:
        from xllm.testing.processes import start_mooncake_master

        return start_mooncake_master(tmp)
    except BaseException as exc:  # (pytest.skip raises a BaseException when Mooncake is missing)
        print(f"no Mooncake store tier: {exc}")
        return None


def _warm_up(model, tok, threads: int) -> None:
    """Build and run an engine once on prompts of the sizes to come (native kernels, GEMM choices)."""
    eng = _engine(model, tok, threads, 0.25)
    rng = random.Random(2)
    try:
        for n in (40, 200, 500):
            _ttft(eng, f"w{n}", [rng.randrange(100, 40000) for _ in range(n)], 4)
    finally:
        eng.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_output_args(p, "kv-tiers")
    p.add_argument("--threads", type=int, default=2, help="engine threads (sessions and break-even parts)")
    p.add_argument("--quick", action="store_true", help="fewer chats, turns, lengths, repetitions and rounds")
    p.add_argument("--parts", default="sessions,break_even,cluster", help="comma-separated parts to run")
    p.add_argument("--sessions", type=int, default=None, help="chats (default 24; --quick 16)")
    p.add_argument("--turns", type=int, default=None, help="turns per chat (default 4; --quick 3)")
    p.add_argument("--policies", default=",".join(POLICIES), help="cluster part: routing policies")
    p.add_argument("--variants", default=",".join(VARIANTS), help="cluster part: tier variants (host, host+store)")
    p.add_argument("--cluster-rounds", type=int, default=1, help="cluster part: runs of every policy (1)")
    p.add_argument("--cluster-notes", type=int, default=12,
                   help="cluster part: lines of notes of its own in each chat's first message, ~20 tokens each "
                        "(12: most of a chat's prefix is its own, so where its blocks are matters; 0: the "
                        "sessions part's trace)")
    p.add_argument("--rounds", type=int, default=None,
                   help="runs of every session configuration, every other one in the reverse order (default: "
                        "2; --quick: 1)")


def run(args: argparse.Namespace, output: Output) -> dict:
    import torch

    from benchmarks.kv_tiers_cluster import ClusterSettings, chat_trace, run_cluster, working_set_tokens
    from benchmarks.machine import cpu_busy_fraction, git_commit, machine_info
    from xllm.models import Tokenizer, load_model, resolve_model

    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    model_dir = resolve_model(progress=False)
    model, tok = load_model(model_dir, torch.bfloat16, progress=False), Tokenizer(model_dir)
    out = output.open()
    n_sessions = args.sessions or (16 if args.quick else 24)
    turns = args.turns or (3 if args.quick else 4)
    lengths = [64, 128, 256, 512] if args.quick else [64, 128, 256, 512, 1024, 1536]  # (a block is 64 tokens)
    reps = 2 if args.quick else 3
    trace = chat_trace(tok, n_sessions, turns)
    result = {"date": output.stamp, "commit": git_commit(str(HERE.parent)), "machine": machine_info(),
              "model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "threads": args.threads, "quick": args.quick,
              "load_average_before": os.getloadavg(), "cpu_busy_before": cpu_busy_fraction(), "t0_kv_gib": KV_GIB,
              "tier_gib": {"host": HOST_GIB, "disk": DISK_GIB, "store": STORE_GIB}, "sessions_config":
              {"sessions": n_sessions, "turns": turns}, "sessions": {}, "break_even": {}, "cluster": {}}

    def save() -> None:
        output.save(result)

    with tempfile.TemporaryDirectory(prefix="xllm-kv-tiers-", dir="/dev/shm") as shm, \
            tempfile.TemporaryDirectory(prefix="xllm-kv-tiers-") as tmp:
        shm, tmp = pathlib.Path(shm), pathlib.Path(tmp)
        mooncake = _start_mooncake(tmp) if parts & {"sessions", "break_even"} else None
        try:
            if parts & {"sessions", "break_even"}:
                _warm_up(model, tok, args.threads)
            if "sessions" in parts:
                configs = session_configs(tmp, shm, mooncake)
                rounds = args.rounds or (1 if args.quick else 2)  # even rounds in the reverse order (drift)
                for rnd in range(rounds):
                    for name in (list(configs) if rnd % 2 == 0 else list(configs)[::-1]):
                        run = f"-{name}-{rnd}"  # every run starts on empty tiers (directories, store namespace)
                        tiers = {k: (f"{v}{run}" if k in ("kv_host_dir", "kv_disk_dir") else v)
                                 for k, v in configs[name].items()}
                        r = sessions(model, tok, args.threads, trace, tiers, run)
                        result["sessions"].setdefault(name, []).append(r)
                        print(f"sessions {name} (round {rnd + 1}): hit rate {r['hit_rate']:.1%}, TTFT p50 "
                              f"{r['ttft_p50_ms']} ms, p99 {r['ttft_p99_ms']} ms", flush=True)
                        save()
            if "break_even" in parts:
                for tier, tiers in break_even_configs(tmp, shm, mooncake).items():
                    result["break_even"][tier] = r = break_even(model, tok, args.threads, lengths, reps, tier, tiers)
                    print(f"break-even {tier}: {r['break_even_tokens']} tokens ({r['read_mb_per_s']} MB/s)",
                          flush=True)
                    save()
        finally:
            if mooncake is not None:
                mooncake.stop()
    if "cluster" in parts:
        del model
        settings = ClusterSettings(model_dir, out, KV_GIB, CLUSTER_HOST_GIB, 0.25)
        rng = random.Random(3)
        warmup = {iid: [[rng.randrange(100, 40000) for _ in range(448)] for _ in range(2)] for iid in ("e0", "e1")}
        cluster_trace = chat_trace(tok, n_sessions, turns, system_repeat=2 if args.cluster_notes else 6,
                                   notes=args.cluster_notes)
        result["cluster_config"] = {"engines": 2, "threads_per_engine": 1, "kv_gib": KV_GIB,
                                    "notes_per_chat": args.cluster_notes,
                                    "working_set_tokens": working_set_tokens(cluster_trace, 64),
                                    "host_gib": CLUSTER_HOST_GIB, "store_segment_gib": 0.25,
                                    "start_gap_s": settings.start_gap, "think_mean_s": settings.think_mean,
                                    "max_tokens": settings.max_tokens, "lease_ttl_s": settings.lease_ttl}
        result["cluster"] = run_cluster(settings, cluster_trace, warmup, _names(args.variants), _names(args.policies),
                                        args.cluster_rounds)
    result["load_average_after"] = os.getloadavg()
    result["cpu_busy_after"] = cpu_busy_fraction()
    return result


def _names(csv: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in csv.split(",") if x.strip())


def plot_png(result: dict, out: pathlib.Path) -> None:
    plot(result, out / "kv_tiers.png")


SCENARIO = Scenario("kv_tiers", "KV tiers: hit rates, TTFT, break-even lengths, a 2-engine cluster",
                    __doc__.split("\n\n")[0], add_arguments, run, markdown, plot_png, prefix="kv-tiers")

"""KV tiers below engine memory (issue 15): hit rate and TTFT of multi-turn chats whose working set is
several times the engine's KV memory, with T0 only and with each lower tier; and the break-even
prompt length between loading a prefix from a tier and recomputing it, on this CPU.

In-process engines on the real SmolLM2 (bf16, xTensor, the engine's own step loop), one request at
a time (TTFT is then the engine's own: queueing, lookups, loads and prefill, no HTTP):

1. **Sessions**: ``--sessions`` chats, each opening with one of 4 shared system prompts, take
   ``--turns`` turns round-robin (a user message, then the model's answer appended to the history),
   so a session's history has usually left T0 by its next turn. Configurations: T0 only; + T1 host;
   + T2 disk; + T3 Mooncake store (a master started on loopback; skipped without Mooncake). Per
   configuration: prompt tokens served without prefill (T0 prefix hits, which include blocks loaded
   from below) over all prompt tokens, per-tier block hits, and TTFT p50/p99.
2. **Break-even**: for prefixes of L tokens, TTFT when the prefix is recomputed versus when it is
   loaded from each tier (the prefix written down and dropped from T0 first; the disk tier's pages
   dropped from the OS page cache, so T2 reads come from the disk).

    python -m benchmarks kv_tiers [--out DIR] [--threads 2] [--quick]

Writes ``kv_tiers.json`` and ``kv_tiers.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import random
import statistics
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
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


def _engine(model, tok, threads: int, kv_gib: float, **tiers):
    from xllm.core import EngineConfig, LLMEngine

    return LLMEngine(model, tok, EngineConfig(dtype=torch.bfloat16, num_threads=threads, max_model_len=2048,
                                              kv_cache_memory_gib=kv_gib, max_num_seqs=8,
                                              kv_model_identity="smollm2-bench", **tiers))


def _ttft(eng, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Run one request alone: its TTFT (add to first token) and its output tokens."""
    from xllm.proto.engine.v1 import engine_pb2

    began = time.perf_counter()
    sampling = engine_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)
    eng.add_request(engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
    ttft, out = None, []
    while eng.has_work():
        for c in eng.step():
            if c.request_id == rid and c.token_ids:
                if ttft is None:
                    ttft = time.perf_counter() - began
                out += list(c.token_ids)
    return ttft, out


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# ---- 1. sessions ---------------------------------------------------------------------------------
def sessions(model, tok, threads: int, kv_gib: float, n_sessions: int, turns: int, tiers: dict,
             seed: int = 0) -> dict:
    rng = random.Random(seed)
    histories = [[{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)] * 6}] for i in range(n_sessions)]
    eng = _engine(model, tok, threads, kv_gib, **tiers)
    ttfts, prompt_tokens = [], 0
    try:
        _ttft(eng, "warmup", tok.encode("Hello there, how are you today?"), 2)
        before = eng.kv.prefix_stats
        for turn in range(turns):
            for s, history in enumerate(histories):
                history.append({"role": "user", "content": rng.choice(QUESTIONS)})
                prompt = tok.apply_chat_template(history)
                ttft, out = _ttft(eng, f"s{s}-t{turn}", prompt, 16)
                ttfts.append(ttft)
                prompt_tokens += len(prompt)
                history.append({"role": "assistant", "content": tok.decode(out)})
        if eng.kv.lower is not None:
            eng.kv.lower.store.flush(60)
        prefix = eng.kv.prefix_stats
        tier_stats = {name: {"hits": s.hits, "queries": s.queries, "corrupt": s.corrupt, "bytes_read": s.bytes_read,
                             "bytes_written": s.bytes_written, "load_seconds": round(s.load_seconds, 4),
                             "read_mb_per_s": round(s.bytes_read / s.load_seconds / 1e6, 1) if s.load_seconds else None}
                      for name, s in eng.kv.tier_stats().items()}
        return {"requests": len(ttfts), "prompt_tokens": prompt_tokens,
                "working_set_tokens": sum(len(tok.apply_chat_template(h)) for h in histories),
                "t0_capacity_tokens": eng.layout.capacity_tokens,
                "hit_rate": round((prefix.hits - before.hits) / max(1, prefix.queries - before.queries), 4),
                "ttft_p50_ms": round(_pct(ttfts, 0.5) * 1e3, 1), "ttft_p99_ms": round(_pct(ttfts, 0.99) * 1e3, 1),
                "ttft_mean_ms": round(statistics.fmean(ttfts) * 1e3, 1), "tiers": tier_stats}
    finally:
        eng.close()


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
    eng = _engine(model, tok, threads, 0.25, **tiers)
    rng = random.Random(1)
    rows = []
    try:
        _ttft(eng, "warmup", [rng.randrange(100, 40000) for _ in range(300)], 1)
        for length in lengths:
            recompute, load = [], []
            for rep in range(reps):
                prompt = [rng.randrange(100, 40000) for _ in range(length + 1)]
                t, _ = _ttft(eng, f"r{length}-{rep}", prompt, 1)  # computed: nothing cached yet
                recompute.append(t)
                eng.kv.evict_cached()  # written down, gone from T0
                eng.kv.lower.store.flush(60)
                if tier == "disk":
                    _drop_page_cache(tiers["kv_disk_dir"])
                t, _ = _ttft(eng, f"l{length}-{rep}", prompt, 1)  # loaded from the tier
                load.append(t)
                eng.kv.evict_cached()
            rows.append({"prefix_tokens": length, "recompute_ms": round(statistics.median(recompute) * 1e3, 1),
                         "load_ms": round(statistics.median(load) * 1e3, 1)})
        stats = eng.kv.tier_stats()[tier]
        return {"rows": rows, "read_mb_per_s": round(stats.bytes_read / stats.load_seconds / 1e6, 1)
                if stats.load_seconds else None,
                "break_even_tokens": next((r["prefix_tokens"] for r in rows if r["load_ms"] < r["recompute_ms"]),
                                          None)}
    finally:
        eng.close()


# ---- driver ------------------------------------------------------------------------------------------
def _tier_configs(tmp: pathlib.Path, mooncake) -> dict[str, dict]:
    configs = {"t0": {},
               "t0+host": {"kv_host_memory_gib": 2.0, "kv_host_dir": str(tmp / "host")},
               "t0+disk": {"kv_disk_dir": str(tmp / "disk"), "kv_disk_size_gib": 4.0}}
    if mooncake is not None:
        master, metadata = mooncake.address, mooncake.metadata_url
        configs["t0+store"] = {"kv_store": f"mooncake://{master}", "kv_store_metadata": metadata,
                               "kv_store_segment_gib": 1.0}
    return configs


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks kv_tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output directory (default: benchmarks/results/kv-tiers-<time>)")
    p.add_argument("--threads", type=int, default=2, help="engine threads")
    p.add_argument("--quick", action="store_true", help="fewer turns, lengths and repetitions")
    p.add_argument("--rounds", type=int, default=None,
                   help="runs of every session configuration, every other one in the reverse order (default: "
                        "2; --quick: 1)")
    args = p.parse_args(argv)
    from xllm.models import Tokenizer, load_model, resolve_model

    model_dir = resolve_model(progress=False)
    model, tok = load_model(model_dir, torch.bfloat16, progress=False), Tokenizer(model_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = pathlib.Path(args.out) if args.out else HERE / "results" / f"kv-tiers-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    n_sessions, turns = (12, 3) if args.quick else (12, 4)
    lengths = [64, 128, 256, 512] if args.quick else [32, 64, 128, 256, 512, 1024, 1536]
    reps = 2 if args.quick else 3
    kv_gib = 0.015  # T0: ~680 tokens of SmolLM2's bf16 KV (the sessions' working set: ~4-5x that)
    result = {"date": stamp, "model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "threads": args.threads,
              "load_average_before": os.getloadavg(), "t0_kv_gib": kv_gib, "sessions": {}, "break_even": {}}
    with tempfile.TemporaryDirectory(prefix="xllm-kv-tiers-", dir="/dev/shm") as shm, \
            tempfile.TemporaryDirectory(prefix="xllm-kv-tiers-") as tmp:
        mooncake = _start_mooncake(pathlib.Path(tmp))
        try:
            configs = _tier_configs(pathlib.Path(tmp), mooncake)
            configs.get("t0+host", {})["kv_host_dir"] = str(pathlib.Path(shm) / "host")
            _warm_up(model, tok, args.threads)
            rounds = args.rounds or (1 if args.quick else 2)  # even rounds in the reverse order (drift under load)
            for rnd in range(rounds):
                for name in (list(configs) if rnd % 2 == 0 else list(configs)[::-1]):
                    tiers = {k: (f"{v}-{rnd}" if k in ("kv_host_dir", "kv_disk_dir") else v)
                             for k, v in configs[name].items()}
                    r = sessions(model, tok, args.threads, kv_gib, n_sessions, turns, tiers)
                    result["sessions"].setdefault(name, []).append(r)
                    print(f"sessions {name} (round {rnd + 1}): hit rate {r['hit_rate']:.1%}, TTFT p50 "
                          f"{r['ttft_p50_ms']} ms, p99 {r['ttft_p99_ms']} ms", flush=True)
            for name, tiers in configs.items():
                if name == "t0":
                    continue
                tier = name.split("+")[1]
                fresh = {k: (v + "-be" if k in ("kv_host_dir", "kv_disk_dir") else v) for k, v in tiers.items()}
                result["break_even"][tier] = r = break_even(model, tok, args.threads, lengths, reps, tier, fresh)
                print(f"break-even {tier}: {r['break_even_tokens']} tokens ({r['read_mb_per_s']} MB/s)", flush=True)
        finally:
            if mooncake is not None:
                mooncake.stop()
    result["load_average_after"] = os.getloadavg()
    (out / "kv_tiers.json").write_text(json.dumps(result, indent=2))
    (out / "kv_tiers.md").write_text(_markdown(result))
    print(f"wrote {out}")
    return 0


def _markdown(r: dict) -> str:
    lines = [f"# KV tiers ({r['date']}, {r['model']} {r['dtype']}, {r['threads']} threads)", "",
             f"Load average before/after: {r['load_average_before']} / {r['load_average_after']}.", "",
             "| config | requests | working set / T0 | hit rate | TTFT p50 ms | TTFT p99 ms | tier hits (blocks) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, runs in r["sessions"].items():
        for s in runs:
            hits = ", ".join(f"{t}: {v['hits']}" for t, v in s["tiers"].items()) or "-"
            lines.append(f"| {name} | {s['requests']} | {s['working_set_tokens'] / s['t0_capacity_tokens']:.1f}x | "
                         f"{s['hit_rate']:.1%} | {s['ttft_p50_ms']} | {s['ttft_p99_ms']} | {hits} |")
    lines += ["", "| tier | prefix tokens | recompute TTFT ms | load TTFT ms |", "| --- | --- | --- | --- |"]
    for tier, b in r["break_even"].items():
        for row in b["rows"]:
            lines.append(f"| {tier} | {row['prefix_tokens']} | {row['recompute_ms']} | {row['load_ms']} |")
    lines += [""] + [f"- {tier}: loading beats recomputing from {b['break_even_tokens']} tokens "
                     f"(reads at {b['read_mb_per_s']} MB/s)" for tier, b in r["break_even"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

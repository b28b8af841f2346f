"""Expert parallelism and EPLB on a skewed MoE: ``python -m benchmarks moe [--quick]``.

**Live, on this machine** (one engine per configuration, in this process, the same workload): a random
DeepSeek-V3-shaped MoE (``--experts`` routed experts, top ``--top-k`` in 4 groups, 3 MoE layers) whose router is
skewed by its correction bias: expert ``e``'s bias is ``-skew * 0.1 * ln(1 + rank(e))`` for a random ranking
(``--skew``, stated in the report; the bias only chooses, the weights stay the router's). Configurations:

- ``tp1``: one process (the oracle of every output);
- ``tp2``: two ranks, every expert split channel-wise (tensor parallelism);
- ``ep2``: two ranks, whole experts in the default placement (``--redundant`` extra replicas), no EPLB;
- ``ep2_eplb``: the same with EPLB, a load window of ``--interval`` steps.

Reported per configuration: output tok/s and wall time, the outputs' equality with ``tp1`` (greedy, token for
token), and for the EP ones every load window's measured imbalance (max / mean of the tokens each rank's experts
computed, mean over layers) and the switches made. The straggler wait per step is modelled: the windows' rank
loads times the measured time of one (token, expert) pair of this model's experts (``us_per_pair``).

**Simulated** (:mod:`xllm.sim.moe`, the engine's policy code): a DeepSeek-V3-sized layer (256 experts, 8 groups,
top 8, 4,096 tokens a step, Zipf skew ``--sim-skew``, slowly drifting) at 8-64 ranks with one redundant expert per
rank, EPLB off and on; and the live ``ep2`` trace replayed at 2 ranks beside the live figures (the validation).
Goal (issue 46): EPLB brings max / mean to 1.2 or below and halves the straggler wait, with no change of output.
Results: ``results.json``, ``summary.md``, ``moe.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import tempfile
import time

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario, attempt

CONFIGS = ("tp1", "tp2", "ep2", "ep2_eplb")
SIM_RANKS = (8, 16, 32, 64)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (16)")
    p.add_argument("--top-k", type=int, default=4, help="experts per token (4)")
    p.add_argument("--skew", type=float, default=3.0, help="router skew: the correction-bias slope (3.0)")
    p.add_argument("--redundant", type=int, default=2, help="extra expert replicas with EP (2)")
    p.add_argument("--interval", type=int, default=8, help="EPLB load window, steps (8)")
    p.add_argument("--requests", type=int, default=16, help="concurrent requests (16)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (64)")
    p.add_argument("--output", type=int, default=96, help="output tokens per request, ignore_eos (96)")
    p.add_argument("--sim-skew", type=float, default=1.0, help="Zipf exponent of the simulated load (1.0)")
    p.add_argument("--quick", action="store_true", help="a small model, 4 requests of 16 tokens: the code path only")
    add_output_args(p, "moe")


def build_model(path: pathlib.Path, experts: int, top_k: int, skew: float, hidden: int, seed: int = 0) -> None:
    """The random skewed DeepSeek-V3-shaped MoE (module docstring) saved as transformers saves it."""
    import transformers
    from safetensors.torch import load_file, save_file

    from xllm.models import resolve_model
    from xllm.testing.models import TOKENIZER_FILES, save_random_hf_model

    cfg = transformers.DeepseekV3Config(
        vocab_size=49152, num_hidden_layers=4, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=2 * hidden,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=experts, num_experts_per_tok=top_k,
        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5)
    save_random_hf_model(path, cfg, seed=seed, std=0.3)
    tok = resolve_model(None, progress=False)
    for f in TOKENIZER_FILES:
        if (tok / f).is_file():
            (path / f).write_bytes((tok / f).read_bytes())
    rng = random.Random(seed)
    for file in sorted(path.glob("*.safetensors")):  # (a larger model is saved in shards)
        tensors = load_file(file)
        biased = False
        for name, t in tensors.items():
            if name.endswith("e_score_correction_bias"):
                order = list(range(experts))
                rng.shuffle(order)
                for rank, e in enumerate(order):
                    t[e] = -skew * 0.1 * math.log(1 + rank)
                biased = True
        if biased:
            save_file(tensors, file, metadata={"format": "pt"})


def engine_config(name: str, args: argparse.Namespace, threads: int):
    import torch

    from xllm.core.config import EngineConfig

    common = dict(dtype=torch.float32, quantization="none", max_num_seqs=max(16, args.requests),
                  max_num_batched_tokens=512, kv_cache_memory_gib=0.25, max_model_len=1024)
    if name == "tp1":
        return EngineConfig(num_threads=threads, **common)
    ep = name.startswith("ep")
    return EngineConfig(num_threads=max(1, threads // 2), tensor_parallel_size=2, enable_expert_parallel=ep,
                        num_redundant_experts=args.redundant if ep else 0, enable_eplb=name == "ep2_eplb",
                        eplb_step_interval=args.interval, **common)


def run_config(path: pathlib.Path, name: str, args: argparse.Namespace, threads: int) -> dict:
    """One configuration's run of the workload: speed, outputs, load windows."""
    from xllm.engine.loader import load_engine
    from xllm.testing.engine import drive_loaded, make_request

    windows: list = []

    class Observer:
        def on_step(self, s) -> None:
            if s.experts is not None:
                windows.append(s.experts)

    loaded = load_engine(str(path), "moe", engine_config(name, args, threads), name, progress=False,
                         observers=[Observer()])
    reqs = [make_request(f"r{i}", [(97 * i + 31 * j) % 40000 + 100 for j in range(args.prompt)],
                         max_tokens=args.output, ignore_eos=True) for i in range(args.requests)]
    try:
        drive_loaded(loaded, reqs[:1])  # warm-up (not timed)
        start = time.perf_counter()
        got = drive_loaded(loaded, reqs)
        wall = time.perf_counter() - start
        eplb = getattr(loaded.engine.runner, "eplb", None)
        tokens = sum(len(t) for t in got.tokens.values())
        return {"wall_s": wall, "tok_s": tokens / wall, "tokens": {k: v for k, v in sorted(got.tokens.items())},
                "windows": [{"imbalance": w.imbalance, "tokens": w.tokens, "layer_tokens": w.layer_tokens,
                             "switching": w.switching} for w in windows],
                "switches": eplb.rebalances if eplb is not None else 0,
                "switch_steps": list(eplb.switch_steps) if eplb is not None else []}
    finally:
        loaded.engine.close()
        loaded.compute.shutdown()


def us_per_pair(hidden: int, reps: int = 20) -> float:
    """Microseconds per (token, expert) pair of this model's experts (one expert, 64 tokens)."""
    import torch

    from xllm.kernels import moe_expert_pairs

    inter = 2 * hidden
    w13, w2 = torch.randn(1, 2 * inter, hidden), torch.randn(1, hidden, inter)
    x = torch.randn(64, hidden)
    tokens, experts, weights = torch.arange(64), torch.zeros(64, dtype=torch.int64), torch.ones(64)
    moe_expert_pairs(x, w13, w2, tokens, experts, weights)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        moe_expert_pairs(x, w13, w2, tokens, experts, weights)
        best = min(best, time.perf_counter() - t0)
    return best / 64 * 1e6


def simulate(args: argparse.Namespace, live: dict) -> dict:
    from xllm.sim.moe import simulate_ep, synthetic_trace

    windows = 6 if args.quick else 20
    trace = synthetic_trace(windows, layers=4, experts=256, tokens=4096, top_k=8, skew=args.sim_skew, drift=0.02)
    out: dict = {"synthetic": []}
    for ranks in SIM_RANKS:
        off = simulate_ep(trace, ranks, redundant=ranks, groups=8)
        on = simulate_ep(trace, ranks, redundant=ranks, eplb=True, groups=8)
        # EPLB's first window runs the default placement: both compared from the second window on
        out["synthetic"].append({"ranks": ranks, "off_imbalance": off.mean_imbalance(1),
                                 "on_imbalance": on.mean_imbalance(1), "off_wait": off.wait(1), "on_wait": on.wait(1),
                                 "off_wait_fraction": off.wait_fraction(1), "on_wait_fraction": on.wait_fraction(1)})
    ep = live.get("ep2")
    if ep and ep["windows"]:
        replay = [w["layer_tokens"] for w in ep["windows"]]
        sim = simulate_ep(replay, 2, redundant=args.redundant)
        out["validation"] = {"live": [w["imbalance"] for w in ep["windows"]], "sim": sim.imbalance}
    return out


def run(args: argparse.Namespace, output: Output) -> dict:
    import torch

    if args.quick:
        args.experts, args.requests, args.prompt, args.output, args.interval = 8, 4, 16, 16, 4
    hidden = 64 if args.quick else 256
    threads = torch.get_num_threads()
    output.open()
    results: dict = {"meta": output.meta(args, busy=not args.quick, torch=torch.__version__, hidden=hidden,
                                         threads=threads), "live": {}, "errors": {}}
    with tempfile.TemporaryDirectory(prefix="xllm-moe-") as tmp:
        path = pathlib.Path(tmp) / "model"
        build_model(path, args.experts, args.top_k, args.skew, hidden)
        for name in CONFIGS:
            r = attempt(results["errors"], name, "moe", run_config, path, name, args, threads)
            if r is not None:
                results["live"][name] = r
                print(f"[moe] {name}: {r['tok_s']:.1f} tok/s, {r['switches']} switches, windows "
                      f"{[round(w['imbalance'], 2) for w in r['windows']]}", flush=True)
            output.save(results)
    ref = results["live"].get("tp1", {}).get("tokens")
    for name, r in results["live"].items():
        r["equal_to_tp1"] = r["tokens"] == ref
        if ref is not None and not r["equal_to_tp1"]:
            results["errors"][f"{name}_outputs"] = "outputs differ from the one-process run"
    results["us_per_pair"] = us_per_pair(hidden)
    for name in ("ep2", "ep2_eplb"):
        r = results["live"].get(name)
        if r and r["windows"]:
            skip = 1 if name == "ep2_eplb" else 0  # (the first window runs the default placement)
            ws = r["windows"][skip:] or r["windows"]
            r["mean_imbalance"] = sum(w["imbalance"] for w in ws) / len(ws)
            r["wait_us_per_step"] = _live_wait(ws, args.interval) * results["us_per_pair"]
    results["sim"] = simulate(args, results["live"])
    output.save(results)
    return results


def _live_wait(windows: list[dict], interval: int) -> float:
    """The measured windows' straggler wait per step, in (token, expert) pairs: per layer ``max - mean`` of the rank
    loads (2 ranks), from the measured imbalance and the window's tokens."""
    total = 0.0
    for w in windows:
        pairs = sum(w["tokens"])
        total += pairs / 2 * (w["imbalance"] - 1)  # mean rank load x (max/mean - 1), summed over the layers
    return total / (len(windows) * interval)


def summary(results: dict) -> str:
    meta = results["meta"]
    cpu = meta.get("machine", {}).get("cpu_model", "?")
    lines = [f"# Expert parallelism and EPLB on a skewed MoE ({cpu}, {meta.get('threads')} threads)", "",
             f"Model: random DeepSeek-V3 shape, hidden {meta.get('hidden')}, {meta.get('experts')} experts, top "
             f"{meta.get('top_k')}, router skew {meta.get('skew')} (correction-bias slope); {meta.get('requests')} "
             f"requests x {meta.get('output')} tokens; EP: {meta.get('redundant')} redundant replicas, EPLB window "
             f"{meta.get('interval')} steps. One (token, expert) pair: {results.get('us_per_pair', 0):.2f} us.", "",
             "| config | tok/s | outputs = tp1 | windows' max/mean (mean) | switches | straggler wait/step (model) |",
             "|---|---|---|---|---|---|"]
    for name, r in results["live"].items():
        imb = f"{r['mean_imbalance']:.2f}" if "mean_imbalance" in r else "-"
        wait = f"{r['wait_us_per_step']:.0f} us" if "wait_us_per_step" in r else "-"
        lines.append(f"| {name} | {r['tok_s']:.1f} | {r.get('equal_to_tp1')} | {imb} | {r['switches']} | {wait} |")
    sim = results.get("sim", {})
    lines += ["", "Simulated (256 experts, 8 groups, top 8, 4,096 tokens a step, one redundant expert per rank; "
              "EPLB from its second window):", "",
              "| ranks | max/mean off | max/mean EPLB | wait share off | wait share EPLB | wait EPLB / off |",
              "|---|---|---|---|---|---|"]
    for s in sim.get("synthetic", []):
        ratio = s["on_wait"] / s["off_wait"] if s["off_wait"] else 0.0
        lines.append(f"| {s['ranks']} | {s['off_imbalance']:.2f} | {s['on_imbalance']:.2f} | "
                     f"{s['off_wait_fraction']:.0%} | {s['on_wait_fraction']:.0%} | {ratio:.2f} |")
    val = sim.get("validation")
    if val:
        lines += ["", "Validation, the live `ep2` windows replayed in the simulator (max/mean per window): live "
                  + ", ".join(f"{x:.2f}" for x in val["live"]) + "; simulated "
                  + ", ".join(f"{x:.2f}" for x in val["sim"]) + "."]
    if results.get("errors"):
        lines += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in results["errors"].items())]
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in ("ep2", "ep2_eplb"):
        r = results["live"].get(name)
        if r and r["windows"]:
            a.plot(range(1, len(r["windows"]) + 1), [w["imbalance"] for w in r["windows"]], marker="o", label=name)
    a.axhline(1.2, color="grey", lw=0.8, ls="--")
    a.set_xlabel("load window")
    a.set_ylabel("max / mean tokens per rank")
    a.set_title("live, 2 ranks")
    a.legend()
    sims = results.get("sim", {}).get("synthetic", [])
    xs = range(len(sims))
    b.bar([x - 0.2 for x in xs], [s["off_imbalance"] for s in sims], 0.4, label="default placement")
    b.bar([x + 0.2 for x in xs], [s["on_imbalance"] for s in sims], 0.4, label="EPLB")
    b.set_xticks(list(xs), [str(s["ranks"]) for s in sims])
    b.set_xlabel("ranks (simulated)")
    b.set_title("simulated, 256 experts")
    b.legend()
    fig.tight_layout()
    path = out_dir / "moe.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]


SCENARIO = Scenario("moe", "expert parallelism + EPLB on a skewed MoE: live 2 ranks and simulated 8-64", __doc__,
                    add_arguments, run, summary, plot)

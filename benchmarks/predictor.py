"""Latency predictors on held-out runs: how well the step-time model fitted on an ``xllm profile``
predicts the steps and the requests of a live mixed workload it never saw (issue 14, item 1).

    python -m benchmarks predictor                     # SmolLM2 bf16, 2 threads, the default profile grid
    python -m benchmarks predictor --profile FILE      # fit an existing profile instead of measuring one
    python -m benchmarks predictor --quick --model DIR --dtype float32 --threads 1   # smoke run (tests)

In one process, on one in-process :class:`xllm.core.LLMEngine` (synchronous, the serving defaults):

1. **profile**: the grid of :mod:`xllm.engine.profiler` (``--quick``: its small grid), measured on this
   engine (or ``--profile FILE`` read), and the :class:`xllm.sched.latency.StepTimeModel` fitted to it;
2. **held-out run**: a closed-loop workload at each of ``--concurrency`` levels (``--requests`` per
   level; random prompts of ``--prompt-len`` tokens and ``--output-len`` outputs, uniform, ignore EOS):
   every step's shape and time is recorded (what the engine's StepTiming observes);
3. **errors**: per step, |predicted − measured| / measured of the fitted model as is ("offline") and
   with the online correction an engine applies (:class:`xllm.sched.latency.OnlineCorrection`, fed
   the steps in order, each predicted before it is observed); p50/p90/mean, overall and by step kind
   (decode, prefill, mixed). Per request, TTFT and TPOT predicted at arrival from the engine's state
   (:meth:`StepTimeModel.ttft` with the prefill tokens queued ahead, the running decodes and the token
   budget; :meth:`StepTimeModel.decode_seconds` with the running batch plus this request) against the
   measured ones.

Results: ``results.json``, ``summary.md`` and ``predictor.png`` in ``--out`` (default
``benchmarks/results/predictor-<timestamp>``). The machine's load shows in ``cpu_busy_before/after``.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import time
from dataclasses import dataclass

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario
from xllm.common.argtypes import int_list


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("..")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO..HI, got {text!r}") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return a, b


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="engine precision")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engine")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the engine's running batch limit")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's token budget (default: the engine's default)")
    p.add_argument("--profile", type=pathlib.Path, default=None, metavar="FILE",
                   help="fit this xllm profile instead of measuring one first")
    p.add_argument("--quick", action="store_true",
                   help="small everything (the profiler's quick grid, short prompts, few requests): a smoke run")
    p.add_argument("--concurrency", type=int_list, default=None,
                   help="closed-loop concurrency levels of the held-out run (default 1,4,16; --quick 1,3)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default 48; --quick 4)")
    p.add_argument("--prompt-len", type=_range, default=None, metavar="LO..HI",
                   help="prompt tokens, uniform (default 32..1024; --quick 8..48)")
    p.add_argument("--output-len", type=_range, default=None, metavar="LO..HI",
                   help="output tokens, uniform (default 16..256; --quick 2..8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    add_output_args(p, "predictor", report=False)


@dataclass
class RequestRecord:
    prompt: int
    output: int
    arrival: float
    predicted_ttft: float
    predicted_tpot: float
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0
    # the lifetime predictors (xllm.sched.latency.lifetime_tpot; the queue as prompts for TTFT): the
    # fields above are the predictors at arrival as first built, kept to compare in the same run
    predicted_tpot_life: float = 0.0
    predicted_ttft_queue: float = 0.0

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None


def step_kind(shape) -> str:
    if shape.prefill_chunks and shape.decode_contexts:
        return "mixed"
    return "prefill" if shape.prefill_chunks else "decode"


def quantiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90 and mean of ``values`` (None when empty)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "mean": None}
    v = sorted(values)
    return {"n": len(v), "p50": v[len(v) // 2], "p90": v[min(len(v) - 1, int(0.9 * len(v)))],
            "mean": statistics.fmean(v)}


def step_errors(model, samples) -> dict:
    """Held-out step errors of ``model`` as is and corrected online (predicted before each observation),
    overall and by step kind."""
    from xllm.sched.latency import OnlineCorrection

    corr = OnlineCorrection(model)
    rows = []
    for s in samples:
        online = corr.step_seconds(s.shape)
        corr.observe(s.shape, s.seconds)
        rows.append((step_kind(s.shape), abs(model.step_seconds(s.shape) - s.seconds) / s.seconds,
                     abs(online - s.seconds) / s.seconds))
    out = {"all": {"offline": quantiles([r[1] for r in rows]), "online": quantiles([r[2] for r in rows])}}
    for kind in ("decode", "prefill", "mixed"):
        sel = [r for r in rows if r[0] == kind]
        out[kind] = {"offline": quantiles([r[1] for r in sel]), "online": quantiles([r[2] for r in sel])}
    out["final_correction"] = corr.factor
    return out


def request_errors(records: list[RequestRecord]) -> dict:
    """Relative errors and mean signed error (bias) of each request predictor: TTFT and TPOT at arrival
    (``ttft``, ``tpot``), TTFT with the queue taken as prompts (``ttft_queue``) and TPOT over the
    request's life (``tpot_life``)."""
    out: dict = {}
    for key, pred, measured in (("ttft", "predicted_ttft", "ttft"), ("tpot", "predicted_tpot", "tpot"),
                                ("ttft_queue", "predicted_ttft_queue", "ttft"),
                                ("tpot_life", "predicted_tpot_life", "tpot")):
        pairs = [(getattr(r, pred), getattr(r, measured)) for r in records]
        pairs = [(p, m) for p, m in pairs if m and m > 0 and p > 0]
        out[key] = quantiles([abs(p - m) / m for p, m in pairs])
        out[f"{key}_bias_mean"] = statistics.fmean((p - m) / m for p, m in pairs) if pairs else None
    return out


RECENT_STEPS = 256  # the steps whose prefill share the lifetime TPOT predictor reads (64 were too noisy in
# a simulated Poisson stream: the share of the last 64 steps over-predicted TPOT by 35 % at 95 % utilisation, of
# the last 1,024 by 12 %)


def _predict_at_arrival(engine, model, prompt: int, output: int, recent: list) -> dict[str, float]:
    """TTFT and TPOT of a request arriving now, from the engine's queues and its ``recent`` step samples:
    at arrival as first built (``ttft``: the queue as one prompt; ``tpot``: the decode step of the
    batch in the queues now) and the lifetime predictors (``ttft_queue``: the queue as its prompts;
    ``tpot_life``: :func:`xllm.sched.latency.lifetime_tpot` — the batch at its members' mean context
    with this request's prompt plus half its output, stretched by the prefill share of recent steps)."""
    from xllm.sched.latency import lifetime_tpot, prefill_share

    sched, budget = engine.scheduler, engine.config.max_num_batched_tokens
    decoding = [s for s in sched.running if s.num_tokens - s.num_computed_tokens <= 1]
    pending = [s.num_tokens - s.num_computed_tokens for s in [*sched.waiting, *sched.running] if s not in decoding]
    queued = sum(pending)
    context = sum(s.num_tokens for s in decoding)
    kw = {"token_budget": budget, "decode_batch": len(decoding), "decode_context": context}
    batch = min(len(sched.running) + len(sched.waiting) + 1, engine.config.max_num_seqs)
    contexts = [s.num_tokens for s in decoding] + [prompt + output / 2]
    share = prefill_share(model, [s.shape for s in recent[-RECENT_STEPS:]])
    return {"ttft": model.ttft(prompt, queued_prefill_tokens=queued, **kw),
            "tpot": model.decode_seconds(batch, context + prompt),
            "ttft_queue": model.ttft(prompt, queued_prefill_tokens=queued,
                                     queued_prompt_tokens=queued / len(pending) if pending else 0, **kw),
            "tpot_life": lifetime_tpot(model, batch, sum(contexts) / len(contexts), share)}


def live_run(engine, model, concurrency: int, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
             rng: random.Random) -> tuple[list, list[RequestRecord]]:
    """A closed loop of ``concurrency`` requests in flight until ``n`` have finished; every step's
    sample and every request's record."""
    from xllm.proto.engine.v1 import engine_pb2

    samples: list = []
    engine.step_timing.listeners.append(samples.append)
    vocab = int(engine.model.vocab_size)
    records: dict[str, RequestRecord] = {}
    done: list[RequestRecord] = []
    started = 0
    try:
        while len(done) < n:
            while started < n and len(records) < concurrency:
                started += 1
                plen, olen = rng.randint(*prompt_len), rng.randint(*output_len)
                rid = f"c{concurrency}-{started}"
                p = _predict_at_arrival(engine, model, plen, olen, samples)
                records[rid] = RequestRecord(plen, olen, time.perf_counter(), p["ttft"], p["tpot"],
                                             predicted_tpot_life=p["tpot_life"], predicted_ttft_queue=p["ttft_queue"])
                engine.add_request(engine_pb2.GenerateRequest(
                    request_id=rid, prompt_token_ids=[rng.randrange(min(100, vocab // 2), vocab) for _ in range(plen)],
                    sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True)))
            chunks = engine.step()
            now = time.perf_counter()
            for chunk in chunks:
                rec = records.get(chunk.request_id)
                if rec is None:
                    continue
                if chunk.token_ids:
                    rec.first = rec.first or now
                    rec.last = now
                    rec.tokens += len(chunk.token_ids)
                if chunk.finish_reason:
                    done.append(records.pop(chunk.request_id))
    finally:
        engine.step_timing.listeners.remove(samples.append)
    return samples, done


def run(args: argparse.Namespace, output: Output) -> dict:
    import torch

    from benchmarks.machine import cpu_busy_fraction
    from xllm.core import EngineConfig, LLMEngine
    from xllm.engine.profiler import QUICK_GRID, ProfileGrid, make_profile, run_profile
    from xllm.models import Tokenizer, load_model, resolve_model
    from xllm.sched.latency import PerfProfile, relative_errors

    quick = args.quick
    levels = args.concurrency or ([1, 3] if quick else [1, 4, 16])
    n = args.requests or (4 if quick else 48)
    prompt_len = args.prompt_len or ((8, 48) if quick else (32, 1024))
    output_len = args.output_len or ((2, 8) if quick else (16, 256))
    out = output.open()
    torch.set_num_threads(args.threads)
    path = pathlib.Path(args.model) if args.model else resolve_model()
    dtype = getattr(torch, args.dtype)
    cfg = {"dtype": dtype, "num_threads": args.threads, "max_num_seqs": args.max_num_seqs}
    if args.max_num_batched_tokens:
        cfg["max_num_batched_tokens"] = args.max_num_batched_tokens
    if quick:
        cfg["kv_cache_memory_gib"] = 0.25
    engine = LLMEngine(load_model(path, dtype=dtype, progress=False), Tokenizer(path), EngineConfig(**cfg))
    meta = output.meta(model=path.name, dtype=args.dtype, threads=args.threads, concurrency=levels,
                       requests_per_level=n, prompt_len=prompt_len, output_len=output_len,
                       token_budget=engine.config.max_num_batched_tokens)
    if args.profile:
        profile = PerfProfile.load(args.profile)
        meta["profile"] = str(args.profile)
    else:
        grid = QUICK_GRID if quick else ProfileGrid()
        run = run_profile(engine, grid, seed=args.seed)
        profile = make_profile(engine, run, path.name, args.threads)
        profile.save(out / "profile.json")
        meta["profile_seconds"] = run.seconds
    model = profile.fit()
    rng = random.Random(args.seed)
    levels_out = []
    all_samples, all_records = [], []
    for c in levels:
        samples, records = live_run(engine, model, c, n, prompt_len, output_len, rng)
        all_samples += samples
        all_records += records
        levels_out.append({"concurrency": c, "steps": len(samples), "requests": len(records),
                           "step_errors": step_errors(model, samples), "request_errors": request_errors(records)})
        print(f"[predictor] concurrency {c}: {len(samples)} steps, {len(records)} requests", flush=True)
    meta["cpu_busy_after"] = cpu_busy_fraction()
    fit_errors = relative_errors(model, profile.samples)
    results = {
        "meta": meta, "model_fit": model.to_dict(), "profile_samples": len(profile.samples),
        "fit_error": quantiles(fit_errors), "step_errors": step_errors(model, all_samples),
        "request_errors": request_errors(all_records), "levels": levels_out,
        "steps": [{**s.to_dict(), "predicted": model.step_seconds(s.shape)} for s in all_samples],
        "requests": [{"prompt": r.prompt, "output": r.output, "ttft": r.ttft, "tpot": r.tpot,
                      "predicted_ttft": r.predicted_ttft, "predicted_tpot": r.predicted_tpot,
                      "predicted_ttft_queue": r.predicted_ttft_queue, "predicted_tpot_life": r.predicted_tpot_life}
                     for r in all_records]}
    return results


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def summary(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Latency predictors on held-out runs ({meta['model']}, {meta['dtype']}, {meta['threads']} threads, "
             f"commit {meta['commit']})", "",
             f"Profile: {results['profile_samples']} step shapes; fit error on them p50 "
             f"{_pct(results['fit_error']['p50'])}. Held-out: closed loop at concurrency "
             f"{', '.join(map(str, meta['concurrency']))}, {meta['requests_per_level']} requests each, prompts "
             f"{meta['prompt_len'][0]}..{meta['prompt_len'][1]} and outputs {meta['output_len'][0]}.."
             f"{meta['output_len'][1]} tokens. CPU busy before/after: {meta['cpu_busy_before']:.0%} / "
             f"{meta['cpu_busy_after']:.0%}.", "",
             "Step time, relative error |predicted − measured| / measured (offline: the fitted model; online: "
             "corrected by the steps before, as an engine does):", "",
             "| steps | n | offline p50 | offline p90 | offline mean | online p50 | online p90 | online mean |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    se = results["step_errors"]
    for kind in ("all", "decode", "prefill", "mixed"):
        off, on = se[kind]["offline"], se[kind]["online"]
        lines.append(f"| {kind} | {off['n']} | {_pct(off['p50'])} | {_pct(off['p90'])} | {_pct(off['mean'])} | "
                     f"{_pct(on['p50'])} | {_pct(on['p90'])} | {_pct(on['mean'])} |")
    lines += ["", "Requests, predicted at arrival vs measured (relative error p50 / p90, bias = mean signed error). "
              "At arrival: TTFT with the queue read as one prompt, TPOT as the decode step of the batch in the "
              "queues; lifetime: TTFT with the queue as its prompts, TPOT over the request's life "
              "(`lifetime_tpot`: mean context over the life, recent prefill share):", "",
              "| concurrency | requests | TTFT at arrival | bias | TTFT, queue as prompts | bias | TPOT at arrival "
              "| bias | TPOT over the life | bias | step p50 (offline) |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for lv in [*results["levels"], {"concurrency": "all", "requests": len(results["requests"]),
                                    "request_errors": results["request_errors"], "step_errors": se}]:
        re = lv["request_errors"]
        cells = [f"{_pct(re[k]['p50'])} / {_pct(re[k]['p90'])} | {_pct(re[f'{k}_bias_mean'])}"
                 for k in ("ttft", "ttft_queue", "tpot", "tpot_life")]
        lines.append(f"| {lv['concurrency']} | {lv['requests']} | {' | '.join(cells)} | "
                     f"{_pct(lv['step_errors']['all']['offline']['p50'])} |")
    coef = ", ".join(f"{k} {v:.3g}" for k, v in results["model_fit"].items())
    lines += ["", f"Fitted model (seconds per unit): {coef}."]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {"decode": "tab:blue", "prefill": "tab:orange", "mixed": "tab:green"}
    from xllm.sched.latency import StepSample

    for kind, color in colors.items():
        pts = [(s["predicted"] * 1e3, s["seconds"] * 1e3) for s in results["steps"]
               if step_kind(StepSample.from_dict(s).shape) == kind]
        if pts:
            ax1.scatter([p for p, _ in pts], [m for _, m in pts], s=6, color=color, label=kind, alpha=0.6)
    lim = max([s["seconds"] * 1e3 for s in results["steps"]] + [s["predicted"] * 1e3 for s in results["steps"]] + [1])
    ax1.plot([0, lim], [0, lim], "k--", lw=0.8)
    ax1.set_xlabel("predicted step ms (offline fit)")
    ax1.set_ylabel("measured step ms")
    ax1.set_title("held-out steps")
    ax1.legend()
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT")):
        pts = [(r[f"predicted_{key}"], r[key]) for r in results["requests"] if r[key]]
        ax2.scatter([m * 1e3 for _, m in pts], [p * 1e3 for p, _ in pts], s=8, label=label, alpha=0.7)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("measured ms")
    ax2.set_ylabel("predicted at arrival ms")
    ax2.set_title("requests")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def plot_png(results: dict, out: pathlib.Path) -> None:
    plot(results, out / "predictor.png")


SCENARIO = Scenario("predictor", "step/TTFT/TPOT predictions vs a held-out live run", __doc__.split("\n\n")[0],
                    add_arguments, run, summary, plot_png)

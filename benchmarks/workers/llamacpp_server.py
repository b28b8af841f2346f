"""Run inside the llama.cpp venv: llama-cpp-python's OpenAI server, optionally without llama.cpp's extra
buffer types.

    python llamacpp_server.py [--no-extra-bufts] SERVER ARGS...

``--no-extra-bufts`` loads models with ``use_extra_bufts = False``: no AMX buffer and no weight repacking.
On CPUs that advertise AMX, ggml's AMX matmul for quantized weights (Q4_0/Q4_1/Q8_0...) executes
``tilezero`` on threads whose tile configuration is not loaded and dies with SIGILL (llama-cpp-python
0.3.36 on the 2-core Xeon of docs/performance.md, 2026-11-27), so the benchmarks serve quantized GGUFs
this way there (Q4_1 has no x86 repack, so its speed is unchanged; Q4_0/Q8_0 lose their AVX2 repack).
Only the standard library and llama_cpp (this venv's) are imported.
"""

from __future__ import annotations

import runpy
import sys


def disable_extra_bufts() -> None:
    """Every model llama_cpp loads from now on gets ``use_extra_bufts = False``."""
    import llama_cpp.llama_cpp as lib

    defaults = lib.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def main(argv: list[str]) -> None:
    if "--no-extra-bufts" in argv:
        argv.remove("--no-extra-bufts")
        disable_extra_bufts()
    sys.argv = ["llama_cpp.server", *argv]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Device/platform layer: which accelerator runs the engine and how to set it up.

The engine asks the platform for its device, synchronization and thread
settings instead of calling ``torch.cuda``/``torch_npu`` directly, so cpu,
cuda and npu share one code path.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    name: str  # "cpu", "cuda" or "npu"
    device: torch.device

    def synchronize(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.name == "npu":
            torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        # fp16 matmuls on CPU are emulated and slow; bf16 is native on AVX-512 bf16
        return not (self.name == "cpu" and dtype == torch.float16)


def detect_platform(requested: str = "auto") -> Platform:
    """The platform for ``requested`` ("auto", "cpu", "cuda[:N]", "npu[:N]").

    "auto" prefers cuda, then npu (``torch_npu`` installed), then cpu.
    Raises ``ValueError`` when the requested device is not available.
    """
    req = requested.lower()
    if req == "auto":
        if torch.cuda.is_available():
            req = "cuda"
        elif importlib.util.find_spec("torch_npu") is not None:
            req = "npu"
        else:
            req = "cpu"
    kind = req.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch reports no CUDA device")
    if kind == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise ValueError("device 'npu' requested but torch_npu is not installed")
        import torch_npu  # noqa: F401  (registers the npu backend)
    if kind not in ("cpu", "cuda", "npu"):
        raise ValueError(f"unknown device {requested!r}; choose auto, cpu, cuda or npu")
    return Platform(kind, torch.device(req))


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads (default: the cores this process may use)."""
    n = num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n

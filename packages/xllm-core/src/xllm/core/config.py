"""Engine configuration, validated with real errors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xllm.common import UnknownNameError
from xllm.core.dtypes import DTYPES
from xllm.core.errors import ConfigError
from xllm.core.kv.registry import KV_BACKENDS
from xllm.sched.batch_policy import DEFAULT_TOKEN_BUDGET


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``"float32"``/... -> ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES.get(name)
    except UnknownNameError as exc:
        raise ConfigError(str(exc)) from None


@dataclass
class EngineConfig:
    """Settings of one engine instance.

    ``max_model_len`` of ``None`` takes the model's context length.
    ``kv_cache_memory_gib`` bounds the physical KV memory; the token capacity
    is that divided by the model's KV bytes per token. ``block_size`` of
    ``None`` picks the backend's natural size (xTensor: the smallest multiple of
    16 tokens whose per-layer K/V block is a whole OS page). ``kv_cache_backend``
    is ``"xtensor"`` (virtual-contiguous, Linux), ``"paged"`` (block tables) or
    ``"contiguous"`` (max-length reservation per slot, no prefix cache).
    ``native_decode`` runs steps through a model's fused native forward when it
    has one (slot-addressed KV only): pure decode steps of up to 8 sequences
    through its decode kernel, every other step through its general step.
    ``async_scheduling`` overlaps scheduling, input preparation and output
    processing with the forward (xLLM §4.1), streaming each token one step later.
    ``compile_decode`` compiles (torch.compile, at start-up) one graph for pure
    decode batches the native path does not take (see ``graph_runner``).
    """

    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET
    max_model_len: int | None = None
    block_size: int | None = None
    kv_cache_memory_gib: float = 2.0
    kv_cache_backend: str = "xtensor"
    enable_prefix_cache: bool = True
    native_decode: bool = True
    async_scheduling: bool = False
    compile_decode: bool = False
    max_waiting_requests: int = 4096
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_backend not in KV_BACKENDS:
            raise ConfigError(f"kv_cache_backend: unknown KV cache backend {self.kv_cache_backend!r}; "
                              f"known: {', '.join(KV_BACKENDS.choices())}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")

    def resolve_max_model_len(self, model_max: int) -> int:
        """The effective context length: the configured one, never above the model's."""
        if self.max_model_len is None:
            return model_max
        if self.max_model_len > model_max:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's context length {model_max}")
        return self.max_model_len

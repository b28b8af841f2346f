"""Embeddings: the served model's pooled final hidden state of a prompt (``/v1/embeddings``).

A prompt runs through the model's eager forward once, outside the KV cache: :class:`DenseCausalAttention`
attends each token causally to its own prompt's earlier tokens and stores nothing, so an embedding takes no
KV pages and never touches the prefix cache. The engine runs it on its thread between steps (a command of
:class:`~xllm.core.AsyncEngine`): a long prompt holds the running requests' next step for its forward
(tens of milliseconds for SmolLM2 at a few hundred tokens). Pooling: ``last`` (the last token's state: how
decoder-only embedding models such as Qwen3-Embedding pool, and vLLM's default for them) or ``mean``;
``normalize`` scales to unit L2 norm.

Images have embeddings too: an encode instance's ``EngineService.Encode`` (EPD disaggregation) runs them
through the vision tower (:meth:`EngineEmbeddings.encode_requests`, :func:`xllm.core.images.encode_requests`),
the calls queued between two steps in one batch (:class:`EncodeQueue`: bounded while requests run).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from xllm.core.compute_thread import run_on
from xllm.core.model_api import CausalLM
from xllm.core.step_stats import image_stats
from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Executor

    from xllm.core.config import EngineConfig
    from xllm.core.model_runner import ModelRunner
    from xllm.core.platform import Platform

POOLINGS = ("last", "mean")


class DenseCausalAttention:
    """An ``AttentionContext`` over one prompt with no KV cache: causal attention within the prompt."""

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                  scale: float, v_dim: int | None = None) -> torch.Tensor:
        if v is None:  # a latent cache (MLA): the values are the first v_dim channels of the keys
            v = k[..., :v_dim]
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, scale=scale)
        return out.transpose(0, 1)


@torch.inference_mode()
def embed(model: CausalLM, prompt: list[int], pooling: str, normalize: bool, device: torch.device,
          max_len: int) -> tuple[float, ...]:
    """The pooled final hidden state of ``prompt`` (see the module docstring); ``InvalidRequestError`` naming
    ``input`` for an empty or too long prompt, ``pooling`` for an unknown pooling."""
    if pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}", "pooling")
    if not prompt or len(prompt) > max_len:
        raise InvalidRequestError(f"an input has {len(prompt)} tokens; between 1 and {max_len} are served", "input")
    ids = torch.tensor(prompt, dtype=torch.long, device=device)
    hidden = model.forward(ids, torch.arange(len(prompt), device=device), DenseCausalAttention()).float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
    if normalize:
        pooled = F.normalize(pooled, dim=0)
    return tuple(pooled.tolist())  # (a tuple: an engine command's list result reads as chunks to deliver)


class EngineEmbeddings:
    """The engine's answers that are embeddings, not tokens: a prompt's (``Embed``) and images' (``Encode``).
    Mixed into :class:`~xllm.core.engine.LLMEngine` (its ``model``, ``config``, ``runner``, platform and forward
    thread); both run on the engine thread between steps, and neither on a tensor-parallel instance (its other
    ranks take part only in steps)."""

    model: CausalLM
    config: EngineConfig
    runner: ModelRunner
    platform: Platform
    max_model_len: int
    max_encode_images: int
    _worker: Executor | None
    _notify_outside_step: Callable[..., None]

    def embed(self, prompt: list[int], pooling: str = "last", normalize: bool = True) -> tuple[float, ...]:
        """The pooled final hidden state of ``prompt`` (:func:`embed`: no KV, no tokens)."""
        if self.config.tensor_parallel_size > 1:
            raise InvalidRequestError("a tensor-parallel instance serves no embeddings", "model")
        return embed(self.model, prompt, pooling, normalize, self.platform.device, self.max_model_len)

    def encode_requests(self, requests: list[list[engine_pb2.ImageInput]]) -> list:
        """``Encode`` calls queued between two steps (an encode instance's work, or a decode instance's with
        ``ed+p``): each call's embeddings as a tuple, or the exception that refuses it; the images in one batch
        through the encoder cache, on the thread that runs the forwards (:func:`xllm.core.images.encode_requests`)."""
        if self.config.tensor_parallel_size > 1:
            refused = InvalidRequestError("a tensor-parallel instance encodes no images alone", "images")
            return [refused for _ in requests]
        out = run_on(self._worker, self.runner.encode_requests, requests, self.config.kv_model_identity or "")
        self._notify_outside_step(**image_stats(self.runner))  # (its images in /metrics and the heartbeats)
        return [got if isinstance(got, Exception) else tuple(got) for got in out]


IDLE_ENCODE_IMAGES = 16
"""Images one batch of ``Encode`` calls may hold while the engine runs no request (an encode instance's case)."""


class EncodeQueue:
    """``Encode`` calls waiting for the engine thread, and how many of them run between two steps: while the
    engine has requests running, calls up to ``bound`` images (the encode phase's per-step bound; at least one
    call), so a decode instance that encodes (``ed+p``) delays each decode step by at most that batch; while it
    runs none, calls up to :data:`IDLE_ENCODE_IMAGES` images. Each batch is one call of the vision tower."""

    def __init__(self) -> None:
        self._calls: deque[tuple[list[engine_pb2.ImageInput], object]] = deque()

    def __len__(self) -> int:
        return len(self._calls)

    def put(self, images: list[engine_pb2.ImageInput], future: object) -> None:
        self._calls.append((images, future))

    def take(self, busy: bool, bound: int) -> list[tuple[list[engine_pb2.ImageInput], object]]:
        """The calls of the next batch, in arrival order (``busy``: requests are running)."""
        limit = max(bound, 1) if busy else IDLE_ENCODE_IMAGES
        out, images = [], 0
        while self._calls and (not out or images + len(self._calls[0][0]) <= limit):
            call = self._calls.popleft()
            images += len(call[0])
            out.append(call)
        return out

    def drain(self) -> list[object]:
        """Every waiting call's future (the engine stopped)."""
        futures = [f for _, f in self._calls]
        self._calls.clear()
        return futures

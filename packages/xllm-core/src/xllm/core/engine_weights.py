"""Sleep, wake and in-place weight updates of an engine (vLLM's ``/sleep``, ``/wake_up``, SGLang's
``/update_weights_from_disk``): :class:`EngineWeights`, a base of :class:`~xllm.core.engine.LLMEngine`.

- :meth:`EngineWeights.sleep` level 1 drops the prefix cache's contents and hands the KV memory back to the
  OS (:meth:`~xllm.core.kv.base.KVCacheBackend.release_memory`); level 2 also frees the weights (every
  parameter's storage and the packed copies made from them). :meth:`EngineWeights.wake_up` takes the KV
  memory back and, after level 2, reads the weights again from the directory they were last loaded from.
- :meth:`EngineWeights.update_weights` reads a safetensors directory into the parameters in place (the
  loader's name mapping: the model's ``load_weights``), then makes everything derived from the old weights
  go: the packed copies and the fused native forward bound over them (rebuilt from the new weights), a
  compiled decode graph (rebuilt), the prefix cache (flushed); the KV identity (``kv_model_identity``, which
  names the KV tiers' namespace) becomes the new directory's, so blocks computed with the old weights are
  never served for the new ones.

The reading itself is the loader's (:class:`WeightReader`, attached by ``xllm.engine.loader`` with
:meth:`EngineWeights.attach_weights`; the core imports no model package). Each command runs on the engine
thread with nothing in flight: :class:`~xllm.core.async_engine.AsyncEngine` drains the engine first (running
and queued requests finish; new ones wait for an update, or are refused with :class:`ModelSleepingError`
while asleep). Refused (``InvalidRequestError``): updates of quantized, GGUF-as-stored or tensor-parallel
instances and with the ``self``/``mtp`` proposers (the engine says why in ``refusal``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from xllm.common.memory import release_freed_memory
from xllm.engine_api.errors import EngineOverloadedError, InvalidRequestError
from xllm.kvstore.tier import model_identity

if TYPE_CHECKING:
    from xllm.core.config import EngineConfig
    from xllm.core.kv.base import KVCacheBackend
    from xllm.core.model_api import CausalLM
    from xllm.core.model_runner import ModelRunner

log = logging.getLogger(__name__)

AWAKE, SLEEP_KV, SLEEP_WEIGHTS = 0, 1, 2


class ModelSleepingError(EngineOverloadedError):
    """The engine is asleep (or going to sleep): it takes no generation request until woken (answered 503)."""

    def __init__(self, level: int) -> None:
        super().__init__(f"the model is sleeping (level {level}): wake it with POST /wake_up before sending "
                         "requests")
        self.level = level


class WeightReader(Protocol):
    """Reads a model directory's weights into a loaded model in place (``xllm.models.reload``)."""

    def __call__(self, model: CausalLM, directory: str, fallback: str | None) -> None:
        """Copy ``directory``'s safetensors weights into ``model``'s parameters and refresh what the model
        derives from them. ``InvalidRequestError`` (``param`` ``model_path``) naming what does not fit (no such
        directory, no safetensors, a tensor of the wrong shape, a missing or unexpected tensor) before any
        weight changed, or after restoring ``fallback``'s weights when the mismatch showed while copying."""
        ...


@dataclass
class WeightsState:
    """Where the engine's weights stand (engine thread; ``level`` is read from any thread).

    ``level``: :data:`AWAKE`, :data:`SLEEP_KV` or :data:`SLEEP_WEIGHTS`; ``source``: the directory the weights
    were last read from (wake after level 2 reads it again); ``reader``: how to read one (None: neither level 2
    nor updates); ``refusal``: why this engine takes no update (None: it does); ``version``: updates so far;
    ``dropped``: the parameters level 2 emptied, with their shapes."""

    level: int = AWAKE
    source: str | None = None
    reader: WeightReader | None = None
    refusal: str | None = None
    version: int = 0
    dropped: list[tuple[torch.Tensor, torch.Size]] = field(default_factory=list)


class EngineWeights:
    """Sleep, wake and weight updates (see the module docstring). Mixed into :class:`LLMEngine`, whose
    ``weights`` (a :class:`WeightsState`), ``model``, ``kv``, ``runner`` and ``config`` it uses. Every method
    runs on the engine thread with no request in flight (``InvalidRequestError`` otherwise)."""

    weights: WeightsState
    model: CausalLM
    kv: KVCacheBackend
    runner: ModelRunner
    config: EngineConfig

    def attach_weights(self, source: str | None, reader: WeightReader | None, refusal: str | None = None) -> None:
        """The loader says where the weights came from and how to read such a directory again; ``refusal``:
        why updates are refused here (quantized or GGUF weights...). Engine thread, before serving."""
        w = self.weights
        w.source, w.reader = source, reader
        reasons = [r for r in (refusal, self._config_refusal()) if r]
        w.refusal = "; ".join(reasons) or None

    def _config_refusal(self) -> str | None:
        if self.config.tensor_parallel_size > 1:
            return "weight updates are not implemented with tensor parallelism"
        if self.config.speculative in ("self", "mtp"):
            return f"weight updates are not implemented with --speculative {self.config.speculative}"
        return None

    def sleeping_level(self) -> int:
        """0 awake, else the level it sleeps at (any thread)."""
        return self.weights.level

    def sleep(self, level: int) -> int:
        """Sleep at ``level`` (1: free the KV memory and the prefix cache; 2: the weights too); returns the
        level it sleeps at. Sleeping deeper than now goes deeper; asleep at that level or deeper: nothing."""
        if level not in (SLEEP_KV, SLEEP_WEIGHTS):
            raise InvalidRequestError(f"level must be 1 (free the KV cache) or 2 (the weights too), got {level}",
                                      "level")
        self._check_idle("sleep")
        w = self.weights
        if level == SLEEP_WEIGHTS and w.level < SLEEP_WEIGHTS and (w.reader is None or w.source is None
                                                                   or w.refusal is not None):
            raise InvalidRequestError("level 2 needs weights it can read again from a safetensors directory; this "
                                      f"engine's cannot be ({w.refusal or 'no weight reader attached'})", "level")
        if w.level >= level:
            return w.level
        if w.level == AWAKE:
            self._flush_prefix_cache()
            freed = self.kv.release_memory()
            log.info("engine %s: asleep, %.1f MB of KV memory released", self.instance_id, freed / 1e6)
        if level == SLEEP_WEIGHTS:
            self._drop_weights()
        w.level = level
        release_freed_memory()
        return level

    def wake_up(self) -> int:
        """Wake: take the KV memory back and, after level 2, read the weights again; returns the level it
        slept at (0: it was awake, nothing done)."""
        w = self.weights
        slept = w.level
        if slept == AWAKE:
            return AWAKE
        if slept == SLEEP_WEIGHTS:
            for t, shape in w.dropped:
                t.set_(torch.empty(shape, dtype=t.dtype, device=t.device))
            w.dropped = []
            w.reader(self.model, w.source, None)
            self._refresh_derived()
        self.kv.restore_memory()
        w.level = AWAKE
        log.info("engine %s: awake (slept at level %d)", self.instance_id, slept)
        return slept

    def update_weights(self, directory: str) -> str:
        """Read the safetensors weights in ``directory`` into the model in place (same architecture and shapes)
        and forget everything computed with the old ones; returns the new KV identity. ``InvalidRequestError``
        naming ``model_path`` when the directory does not fit (the old weights stay), or when this engine
        takes no updates (``refusal``) or sleeps."""
        w = self.weights
        if not directory:
            raise InvalidRequestError("model_path is required: a directory of safetensors weights", "model_path")
        if w.refusal is not None or w.reader is None:
            raise InvalidRequestError(f"this engine cannot update its weights: {w.refusal or 'no weight reader'}",
                                      "model_path")
        if w.level != AWAKE:
            raise InvalidRequestError("the model is sleeping: wake it (POST /wake_up) before updating its weights",
                                      "model_path")
        self._check_idle("update_weights")
        w.reader(self.model, directory, w.source)
        w.source = directory
        w.version += 1
        self._refresh_derived()
        self._flush_prefix_cache()
        identity = self._new_identity(directory)
        log.info("engine %s: weights updated from %s (update %d)", self.instance_id, directory, w.version)
        return identity

    # ---- internals -------------------------------------------------------------------------------
    def _check_idle(self, what: str) -> None:
        if self.has_work():  # type: ignore[attr-defined]
            raise InvalidRequestError(f"{what} needs an idle engine (the engine service drains it first)", "model")

    def _flush_prefix_cache(self) -> None:
        """Forget every cached block of this memory (not written down to the tiers)."""
        dropped = self.kv.drop_cached()
        if dropped:
            log.info("engine %s: %d prefix-cache blocks flushed", self.instance_id, dropped)

    def _drop_weights(self) -> None:
        """Free every parameter's storage (shapes kept for :meth:`wake_up`) and the packed copies."""
        seen: set[int] = set()
        dropped = []
        for p in self.model.parameters():  # type: ignore[attr-defined]
            if id(p) in seen:
                continue
            seen.add(id(p))
            dropped.append((p, p.shape))
        with torch.no_grad():
            for p, _ in dropped:
                p.set_(torch.empty(0, dtype=p.dtype, device=p.device))
        self.weights.dropped = dropped
        self._refresh_derived()
        gc.collect()

    def _refresh_derived(self) -> None:
        """Everything made from the weights goes and is rebuilt from the current ones: the model's packed
        copies and fused forward (``drop_packed``; ``post_load`` for a model without packed copies), the
        runner's binding of that fused forward and its cached image embeddings, a compiled decode graph."""
        model = self.model
        drop = getattr(model, "drop_packed", None)
        if drop is not None:
            drop()
        else:
            post_load = getattr(model, "post_load", None)
            if post_load is not None:
                post_load()
        runner = self.runner
        runner.refresh_fused()
        runner.forget_encoded()  # (image embeddings are made from the weights too)
        if getattr(runner, "graph", None) is not None:
            from xllm.core.graph_runner import build_compiled_decode
            runner.graph = build_compiled_decode(model, self.kv, runner, self.config.max_num_seqs)

    def _new_identity(self, directory: str) -> str:
        """The KV identity of the new weights; with KV tiers, their namespace moves to it (new tiers)."""
        try:
            identity = model_identity(directory)
        except OSError:
            identity = f"{directory}#{self.weights.version}"
        self.config.kv_model_identity = f"{identity}@update{self.weights.version}"
        if self.kv.has_tiers:
            from xllm.core.engine_build import attach_tiers
            old = self.kv.lower_tiers
            self.kv.detach_tiers()
            with contextlib.suppress(Exception):
                old.close()
            attach_tiers(self.config, self.kv, self.transfer_store())  # type: ignore[attr-defined]
        return self.config.kv_model_identity

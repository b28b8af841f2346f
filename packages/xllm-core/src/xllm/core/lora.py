"""The engine's LoRA adapters: which are registered (name -> PEFT directory), which are resident in the
model's ``max_loras`` slots (:class:`~xllm.core.model_api.LoraSlots`), and which slot a request's rows use.

- Adapters are registered at start (``--lora-modules NAME=PATH``, :attr:`EngineConfig.lora_modules`) or at run
  time (:meth:`EngineLora.load_lora`, :meth:`EngineLora.unload_lora`; the engine service's handle
  ``AsyncEngine.load_lora(name, path)`` queues either between steps, ``path`` None unloading). Registering
  reads and checks the directory at once.
- A request naming an adapter (``GenerateRequest.lora_name``; unknown: ``InvalidRequestError`` naming
  ``model``) gets its slot at admission: the adapter's slot if it is resident, else a free slot, else the
  least recently used slot no live request uses (evicted: the adapter is read again from its directory when
  a request needs it next). When every slot is taken by live requests of other adapters the request waits,
  parked outside the scheduler (:attr:`LoraManager.parked`, at most ``max_waiting_requests``, then
  :class:`EngineOverloadedError`), and joins the scheduler's queue (in its arrival order) at the first step
  that finds its adapter a slot.
- The sequence's KV block hashes are chained from the adapter's identity (a hash of its files,
  :attr:`Sequence.hash_root`): the prefix cache, the KV tiers and hand-offs never give one adapter's KV to
  another (or to the base model), and share it within one adapter, reloaded or on another instance.
- Every step's rows carry their slots (``BatchInputs.lora_slots``); such a step runs the fused native steps
  (Llama-family models over the xTensor slots: the kernels add each row's adapter after every adapted
  projection) or else the eager modules, whose projections add it (the compiled decode graphs know no adapters).

Not with tensor parallelism (refused at start, ``ConfigError``), beam search (refused per request) or a model
without :class:`~xllm.core.model_api.SupportsLora` (refused at start / at load).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xllm.core.images import image_hash_root
from xllm.core.model_api import LoraSlots, SupportsLora
from xllm.engine_api.errors import ConfigError, EngineOverloadedError, InvalidRequestError

PARKED = -2  # Sequence.lora_slot of a request waiting for its adapter's slot (LoraManager.parked)

if TYPE_CHECKING:
    from xllm.core.config import EngineConfig
    from xllm.core.model_api import CausalLM
    from xllm.core.model_runner import ModelRunner
    from xllm.core.output_processor import RequestOutput
    from xllm.core.scheduler import Scheduler
    from xllm.core.sequence import Sequence
    from xllm.core.step import StepInFlight
    from xllm.proto.engine.v1 import engine_pb2

log = logging.getLogger(__name__)


@dataclass
class LoraManager:
    """The registered adapters and the slot each resident one occupies (engine thread only).

    ``model`` is asked for its slots (``lora_stack``) on the first registration; ``runner.lora`` is set to
    them then. ``paths``: name -> directory; ``resident[s]``: the name in slot ``s`` (None: free);
    ``identities[s]``: the identity of the adapter installed there; ``last_used[s]``: an LRU clock."""

    model: CausalLM
    runner: ModelRunner
    max_loras: int
    max_rank: int
    paths: dict[str, str] = field(default_factory=dict)
    roots: dict[str, int] = field(default_factory=dict)  # name -> identity (its KV hash root) as last read
    slots: LoraSlots | None = None
    resident: list[str | None] = field(default_factory=list)
    identities: list[int] = field(default_factory=list)
    last_used: list[int] = field(default_factory=list)
    clock: int = 0
    parked: list[tuple[Sequence, str]] = field(default_factory=list)  # waiting for a slot: (sequence, adapter)
    loads: int = 0  # adapters read into a slot for a request (not resident when it came)
    load_seconds: float = 0.0  # mean seconds of one such read + install (an exponential moving average)

    def _slots(self) -> LoraSlots:
        if self.slots is None:
            if not isinstance(self.model, SupportsLora):
                raise ValueError(f"{type(self.model).__name__} does not serve LoRA adapters")
            if getattr(self.runner, "graph", None) is not None:
                raise ValueError("LoRA adapters are not served with compiled decode graphs (--compile-decode)")
            self.slots = self.model.lora_stack(self.max_loras, self.max_rank)
            self.runner.lora = self.slots
            self.resident = [None] * self.max_loras
            self.identities = [0] * self.max_loras
            self.last_used = [0] * self.max_loras
        return self.slots

    def names(self) -> list[str]:
        """The registered adapters' names, in registration order."""
        return list(self.paths)

    def register(self, name: str, path: str) -> None:
        """Register adapter ``name`` at ``path`` (read and checked now; ``ValueError`` naming what is wrong),
        and install it if a slot is free."""
        if not name or "=" in name:
            raise ValueError(f"a LoRA adapter needs a name without '=', got {name!r}")
        if name in self.paths:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = self._slots().read(path)
        self.paths[name] = str(path)
        self.roots[name] = adapter.identity
        if None in self.resident:
            self._install(self.resident.index(None), name, adapter)
        log.info("LoRA adapter %s registered: %s (rank %d)", name, path, adapter.rank)

    def unregister(self, name: str, in_use: set[int]) -> None:
        """Forget adapter ``name`` (``ValueError`` if unknown or while live requests use it)."""
        if name not in self.paths:
            raise ValueError(f"no LoRA adapter named {name!r}")
        slot = self.resident.index(name) if name in self.resident else None
        if slot is not None and slot in in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by requests in flight; unload it once they end")
        del self.paths[name], self.roots[name]
        if slot is not None:
            self._slots().clear(slot)
            self.resident[slot], self.identities[slot] = None, 0
        log.info("LoRA adapter %s unloaded", name)

    def acquire(self, name: str, in_use: set[int]) -> tuple[int, int]:
        """``(slot, identity)`` of adapter ``name`` for a new request, installing it if it is not resident
        (``in_use``: the slots live requests use, never evicted). Raises ``KeyError`` for an unknown name and
        :class:`EngineOverloadedError` when no slot can take it."""
        if name not in self.paths:
            raise KeyError(name)
        if name in self.resident:
            slot = self.resident.index(name)
        else:
            free = [s for s, n in enumerate(self.resident) if n is None]
            idle = sorted((s for s in range(self.max_loras) if s not in in_use), key=lambda s: self.last_used[s])
            if not free and not idle:
                raise EngineOverloadedError(f"all {self.max_loras} LoRA adapter slots (--max-loras) are in use by "
                                            f"requests of other adapters")
            slot = free[0] if free else idle[0]
            if self.resident[slot] is not None:
                log.info("LoRA adapter %s evicted from slot %d for %s", self.resident[slot], slot, name)
            start = time.perf_counter()
            self._install(slot, name, self._slots().read(self.paths[name]))
            seconds = time.perf_counter() - start
            self.load_seconds = seconds if not self.loads else 0.8 * self.load_seconds + 0.2 * seconds
            self.loads += 1
        self.clock += 1
        self.last_used[slot] = self.clock
        return slot, self.identities[slot]

    def report(self, in_use: set[int]) -> dict:
        """The load report's LoRA fields (``LoadReport.lora_*``): the resident adapters, the slots an adapter could
        take now (free, or not in ``in_use``, the slots of live requests), the mean load time, the parked requests."""
        if self.slots is None:
            return {}
        return {"lora_resident": [n for n in self.resident if n is not None],
                "lora_slots_free": sum(1 for s in range(self.max_loras) if s not in in_use),
                "lora_load_seconds": self.load_seconds, "lora_parked": len(self.parked)}

    def _install(self, slot: int, name: str, adapter) -> None:
        self._slots().install(slot, adapter)
        self.resident[slot], self.identities[slot] = name, adapter.identity
        self.roots[name] = adapter.identity
        self.clock += 1
        self.last_used[slot] = self.clock


def build_loras(config: EngineConfig, model: CausalLM, runner: ModelRunner) -> LoraManager:
    """The engine's adapters, with ``config.lora_modules`` registered (``ConfigError`` naming the adapter)."""
    loras = LoraManager(model, runner, config.max_loras, config.max_lora_rank)
    for name, path in config.lora_modules.items():
        try:
            loras.register(name, path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--lora-modules {name}={path}: {exc}") from None
    return loras


class EngineLora:
    """The LoRA side of :class:`~xllm.core.engine.LLMEngine` (its base class): run-time loading and a request's
    adapter at admission. Engine thread only."""

    config: EngineConfig
    loras: LoraManager
    requests: dict[str, RequestOutput]
    scheduler: Scheduler
    _in_flight: StepInFlight | None

    def lora_names(self) -> list[str]:
        """The registered adapters' names (served as model names)."""
        return self.loras.names()

    def lora_load_fields(self) -> dict:
        """The LoRA fields of the engine's load report (:meth:`LoraManager.report`; none without adapters)."""
        return self.loras.report(self._lora_slots_in_use())

    def lora_hash_roots(self) -> list[int]:
        """Per name of :meth:`lora_names`, the root its requests' KV block hashes chain from."""
        return [self.loras.roots[n] for n in self.loras.names()]

    def load_lora(self, name: str, path: str) -> int:
        """Register adapter ``name`` from the PEFT directory ``path`` (read and checked now); returns the root its
        requests' KV block hashes chain from. Raises :class:`InvalidRequestError` naming ``lora_name`` (a name
        taken) or ``lora_path`` (what is wrong)."""
        if name in self.loras.paths:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded", "lora_name")
        try:
            self.loras.register(name, path)
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"LoRA adapter {name!r}: {exc}", "lora_path") from None
        return self.loras.roots[name]

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``; :class:`InvalidRequestError` naming ``lora_name`` if it is unknown or in use
        (by requests in flight or waiting for a slot)."""
        if any(n == name and self._live(seq) for seq, n in self.loras.parked):
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by requests waiting for a slot", "lora_name")
        try:
            self.loras.unregister(name, self._lora_slots_in_use())
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "lora_name") from None

    def _lora_slots_in_use(self) -> set[int]:
        """Slots no adapter may replace now: those of live requests, and of every sequence of the step in flight
        (async scheduling: an aborted request's rows may still be computing, and their KV is still registered)."""
        seqs = [out.seq for out in self.requests.values()]
        if self._in_flight is not None:
            seqs += self._in_flight.seqs
        return {seq.lora_slot for seq in seqs if seq.lora_slot >= 0}

    def _check_lora_name(self, req: engine_pb2.GenerateRequest) -> None:
        """:class:`InvalidRequestError` naming ``model`` unless ``req.lora_name`` is empty or registered (any
        thread: :meth:`LLMEngine.validate`; admission checks again)."""
        if req.lora_name and req.lora_name not in self.loras.paths:
            raise InvalidRequestError(f"model {req.lora_name!r}: no such LoRA adapter on this instance", "model")

    def _admit_lora(self, seq: Sequence, req: engine_pb2.GenerateRequest) -> None:
        """Give ``seq`` the slot and KV hash root of the adapter ``req`` names (nothing for the base model)."""
        name = req.lora_name
        if not name:
            return
        self._check_lora_name(req)
        if seq.params.beam_width is not None:
            raise InvalidRequestError("beam search does not take a LoRA adapter yet", "model")
        try:
            seq.lora_slot, seq.hash_root = self.loras.acquire(name, self._lora_slots_in_use())
        except EngineOverloadedError:
            if len(self.loras.parked) >= self.config.max_waiting_requests:
                raise
            seq.lora_slot = PARKED
            self.loras.parked.append((seq, name))

    def _enqueue(self, seq: Sequence) -> None:
        """Queue an admitted sequence: to the scheduler, unless it waits for its adapter's slot (parked)."""
        if seq.lora_slot != PARKED:
            self.scheduler.add(seq)

    def _live(self, seq: Sequence) -> bool:
        out = self.requests.get(seq.request_id)
        return out is not None and out.seq is seq

    def _lora_unpark(self) -> None:
        """Before a step: the parked sequences whose adapter now finds a slot join the scheduler's queue (in
        parking order); aborted ones are dropped."""
        if not self.loras.parked:
            return
        waiting = []
        for seq, name in self.loras.parked:
            if not self._live(seq):
                continue
            try:
                seq.lora_slot, seq.hash_root = self.loras.acquire(name, self._lora_slots_in_use())
            except EngineOverloadedError:
                waiting.append((seq, name))
                continue
            if seq.images is not None:  # (its KV is keyed by its images after the adapter)
                seq.hash_root = image_hash_root(seq.hash_root, seq.images.hashes)
            self.scheduler.add(seq)
        self.loras.parked = waiting

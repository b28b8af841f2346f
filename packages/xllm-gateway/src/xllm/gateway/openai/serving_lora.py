"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's routes): LoRA adapters loaded onto,
or unloaded from, every live instance of a model at run time, all or none.

Loading asks each instance of the model (``model``, default: the gateway's default model) to read the PEFT
directory ``lora_path`` on its own host (``EngineService.LoadLora``); when every one has it, the adapter is a
model name (``/v1/models``, requests) routed to those instances, its KV keyed by the root they report. When one
refuses or cannot be reached, the others unload it again and the answer is the refusal (400 naming the
field, or 503). Unloading does the same the other way (refused while requests use the adapter). With API keys,
only an admin key (``--admin-api-key``) may do either (403).

An instance of the model that registers later (a restart, a scale-out, one joining while the load ran) is given
the run-time adapters too, in the background (:meth:`LoraAdmin.catch_up`), and gets their requests only once it
has them, and only when the files it read hash to a root the others reported: the same name never means two
different adapters. Each gateway knows the adapters loaded through it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.errors import APIError, bad_request
from xllm.gateway.openai.protocol import Identifier, _Strict
from xllm.gateway.registry import InstanceState, Registry

log = logging.getLogger(__name__)

AdapterName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")]


class LoadLoraAdapterRequest(_Strict):
    lora_name: AdapterName
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    model: Identifier | None = None  # the model the adapter is for (default: the gateway's default model)


class UnloadLoraAdapterRequest(_Strict):
    lora_name: AdapterName
    lora_int_id: int | None = None  # vLLM's; accepted, the name decides


@dataclass(frozen=True)
class RuntimeAdapter:
    """An adapter loaded through this gateway: its base model, the directory the engines read and the KV hash
    roots they reported (one, unless hosts hold different files under the path)."""

    model: str
    path: str
    roots: frozenset[int]


class LoraAdmin:
    """The two routes over the registry's instances, and the run-time adapters (name → :class:`RuntimeAdapter`)
    given to instances that register later (see the module docstring)."""

    def __init__(self, registry: Registry, dispatcher: Dispatcher) -> None:
        self.registry = registry
        self.dispatcher = dispatcher
        self.loaded: dict[str, RuntimeAdapter] = {}
        registry.add_listener(self._on_instance)

    async def load(self, req: LoadLoraAdapterRequest) -> dict:
        model, adapter = self.dispatcher.base_of(self.dispatcher.resolve_model(req.model))
        if adapter:
            raise bad_request(f"{adapter!r} is an adapter; name the model it is for", "model")
        if req.lora_name in self.registry.adapters() or req.lora_name in self.registry.served_models():
            raise bad_request(f"{req.lora_name!r} is already served (a model or an adapter)", "lora_name")
        states = self.registry.states(model)
        if not states:
            raise APIError(503, f"no live instance serves {model!r}", "server_unavailable")
        answers = await self._ask(states, req.lora_name, req.lora_path)
        failed = next(((s, a) for s, a in zip(states, answers, strict=True) if not _ok(a)), None)
        if failed is not None:  # all or none: the ones that loaded it unload it again
            await self._ask([s for s, a in zip(states, answers, strict=True) if _ok(a)], req.lora_name, "")
            raise _refusal(*failed)
        for state, answer in zip(states, answers, strict=True):
            state.unloaded_adapters.discard(req.lora_name)
            state.runtime_adapters[req.lora_name] = answer.hash_root
        self.loaded[req.lora_name] = RuntimeAdapter(model, req.lora_path, frozenset(a.hash_root for a in answers))
        asked = {s.instance_id for s in states}
        for state in self.registry.states(model):  # joined while the load ran: the listener did not know it yet
            if state.instance_id not in asked:
                self.registry.spawn(self.catch_up(state))
        return {"object": "lora_adapter", "lora_name": req.lora_name, "model": model, "loaded": True,
                "instances": sorted(s.instance_id for s in states)}

    async def unload(self, req: UnloadLoraAdapterRequest) -> dict:
        states = [s for s in self.registry.states() if req.lora_name in s.adapters()]
        if not states:
            raise APIError(404, f"no live instance serves the adapter {req.lora_name!r}", "invalid_request_error",
                           "lora_name", "model_not_found")
        self.loaded.pop(req.lora_name, None)
        answers = await self._ask(states, req.lora_name, "")
        for state, answer in zip(states, answers, strict=True):
            if _ok(answer):
                state.runtime_adapters.pop(req.lora_name, None)
                state.unloaded_adapters.add(req.lora_name)
        failed = next(((s, a) for s, a in zip(states, answers, strict=True) if not _ok(a)), None)
        if failed is not None:
            raise _refusal(*failed)
        return {"object": "lora_adapter", "lora_name": req.lora_name, "loaded": False,
                "instances": sorted(s.instance_id for s in states)}

    def _on_instance(self, event: str, state: InstanceState) -> None:
        if event == "added" and any(a.model == state.model for a in self.loaded.values()):
            self.registry.spawn(self.catch_up(state))

    async def catch_up(self, state: InstanceState) -> None:
        """Load onto ``state`` (an instance that registered after them) the run-time adapters of its model it
        lacks. One it refuses, or whose files hash to a root no other instance reported (then unloaded there
        again), is logged and never routed to it; the others are."""
        for name, adapter in list(self.loaded.items()):
            if adapter.model != state.model or name in state.adapters():
                continue
            try:
                answer = await state.client.load_lora(name, adapter.path)
            except Exception as exc:  # unreachable: its breaker and the registry handle the instance
                log.warning("instance %s: could not give it the adapter %r: %s", state.instance_id, name, exc)
                continue
            if not answer.ok:
                log.warning("instance %s refused the run-time adapter %r: %s", state.instance_id, name, answer.error)
                continue
            kept = self.loaded.get(name) == adapter and not state.removed
            if kept and answer.hash_root not in adapter.roots:
                log.error("instance %s read different files for the adapter %r at %s (root %x, others %s): "
                          "not served there", state.instance_id, name, adapter.path, answer.hash_root,
                          ", ".join(f"{r:x}" for r in sorted(adapter.roots)))
                kept = False
            if not kept:  # unloaded meanwhile, the instance gone, or other files
                await asyncio.gather(state.client.load_lora(name, ""), return_exceptions=True)
                continue
            state.unloaded_adapters.discard(name)
            state.runtime_adapters[name] = answer.hash_root
            log.info("instance %s: given the run-time adapter %r", state.instance_id, name)

    @staticmethod
    async def _ask(states: list[InstanceState], name: str, path: str) -> list:
        return await asyncio.gather(*(s.client.load_lora(name, path) for s in states), return_exceptions=True)


def _ok(answer) -> bool:
    return not isinstance(answer, BaseException) and answer.ok


def _refusal(state: InstanceState, answer) -> APIError:
    if isinstance(answer, InstanceUnavailableError):
        return APIError(503, f"instance {state.instance_id} is unavailable: {answer}", "server_unavailable")
    if isinstance(answer, BaseException):
        return APIError(500, f"instance {state.instance_id} failed to answer", "internal_error")
    return bad_request(f"instance {state.instance_id}: {answer.error}", answer.param or None)

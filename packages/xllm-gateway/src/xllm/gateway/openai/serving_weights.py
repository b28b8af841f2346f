"""Sleep, wake and in-place weight updates (vLLM's ``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``;
``POST /update_weights``, SGLang's ``/update_weights_from_disk``), asked of every live instance of a model.

Each instance runs the command through ``EngineService.Control`` (:mod:`xllm.core.engine_weights`): ``sleep``
lets the requests it is running and has queued finish, then frees its KV cache (level 1) and its weights too
(level 2); while asleep, generation requests are refused with 503 saying so. ``wake_up`` takes the memory back
(and reads the weights again after level 2). ``update_weights`` lets the running and queued requests finish on
the old weights, reads the float safetensors directory ``model_path`` on the instance's host into the model in
place, flushes the prefix cache and changes the KV identity (the KV tiers' namespace), so KV of the old weights
is never served for the new ones; requests that arrive meanwhile wait and run on the new weights.

Like vLLM, sleeping when asleep and waking when awake are no-ops answered 200. A refusal is a 400 naming the
field (``level``, ``model_path``: not a directory, no safetensors, a tensor whose shape does not fit, named),
an unreachable instance a 503; instances that accepted a command before another refused keep its effect (the
answer lists them). With API keys, only an admin key (``--admin-api-key``) may change anything (403).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.access import AccessPolicy, Caller
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.guard import caller_of
from xllm.gateway.openai.errors import APIError, bad_request
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import Identifier, _Strict
from xllm.gateway.openai.protocol_openapi import RequestBodies, answers
from xllm.gateway.openai.request_body import parse_request, read_body
from xllm.gateway.registry import InstanceState, Registry
from xllm.proto.engine.v1 import engine_pb2


class SleepRequest(_Strict):
    level: Annotated[int, Field(ge=1, le=2)] | None = None  # 1: free the KV cache; 2: the weights too (default 1)
    model: Identifier | None = None  # whose instances (default: the gateway's default model)


class WakeUpRequest(_Strict):
    model: Identifier | None = None


class UpdateWeightsRequest(_Strict):
    model_path: Annotated[str, Field(min_length=1, max_length=4096)]  # a directory on each instance's host
    model: Identifier | None = None
    # SGLang's /update_weights_from_disk fields, accepted: only safetensors directories load, and the prefix cache
    # is always flushed
    load_format: Identifier | None = None
    flush_cache: bool | None = None


class WeightsAdmin:
    """The routes' work over the registry's instances of a model (see the module docstring)."""

    def __init__(self, registry: Registry, dispatcher: Dispatcher) -> None:
        self.registry = registry
        self.dispatcher = dispatcher

    async def sleep(self, req: SleepRequest) -> dict:
        level = req.level or 1
        model, states = self._states(req.model)
        answers = await self._ask(states, engine_pb2.ControlRequest(action=engine_pb2.CONTROL_ACTION_SLEEP,
                                                                     level=level))
        return {"model": model, "level": level, **self._report(states, answers)}

    async def wake_up(self, req: WakeUpRequest) -> dict:
        model, states = self._states(req.model)
        answers = await self._ask(states, engine_pb2.ControlRequest(action=engine_pb2.CONTROL_ACTION_WAKE_UP))
        return {"model": model, **self._report(states, answers)}

    async def is_sleeping(self, model_name: str | None) -> dict:
        model, states = self._states(model_name)
        answers = await self._ask(states, engine_pb2.ControlRequest(action=engine_pb2.CONTROL_ACTION_IS_SLEEPING))
        return {"model": model, **self._report(states, answers)}

    async def update(self, req: UpdateWeightsRequest) -> dict:
        if req.load_format not in (None, "auto", "safetensors"):
            raise bad_request(f"load_format {req.load_format!r}: only safetensors weights are read", "load_format")
        model, states = self._states(req.model)
        answers = await self._ask(states, engine_pb2.ControlRequest(
            action=engine_pb2.CONTROL_ACTION_UPDATE_WEIGHTS, model_path=req.model_path))
        report = self._report(states, answers)
        return {"model": model, "model_path": req.model_path, "success": True, "message": "weights updated",
                **report}

    def _states(self, requested: str | None) -> tuple[str, list[InstanceState]]:
        model, adapter = self.dispatcher.base_of(self.dispatcher.resolve_model(requested))
        if adapter:
            raise bad_request(f"{adapter!r} is a LoRA adapter; name the model it is for", "model")
        states = self.registry.states(model)
        if not states:
            raise APIError(503, f"no live instance serves {model!r}", "server_unavailable")
        return model, states

    @staticmethod
    async def _ask(states: list[InstanceState], req: engine_pb2.ControlRequest) -> list:
        return await asyncio.gather(*(s.client.control(req) for s in states), return_exceptions=True)

    @staticmethod
    def _report(states: list[InstanceState], answers: list) -> dict:
        """Every instance's sleeping level; the first refusal raised (400 naming the field, or 503)."""
        for state, answer in zip(states, answers, strict=True):
            if isinstance(answer, InstanceUnavailableError):
                raise APIError(503, f"instance {state.instance_id} is unavailable: {answer}", "server_unavailable")
            if isinstance(answer, BaseException):
                raise APIError(500, f"instance {state.instance_id} failed to answer", "internal_error")
            if not answer.ok:
                done = sorted(s.instance_id for s, a in zip(states, answers, strict=True)
                              if not isinstance(a, BaseException) and a.ok)
                also = f" (done on {', '.join(done)})" if done else ""
                raise bad_request(f"instance {state.instance_id}: {answer.error}{also}", answer.param or None)
        levels = {s.instance_id: a.sleeping_level for s, a in zip(states, answers, strict=True)}
        return {"is_sleeping": any(levels.values()), "instances": levels}


def add_weights_routes(app: FastAPI, bodies: RequestBodies, preprocessor: Preprocessor, access: AccessPolicy,
                       admin: WeightsAdmin) -> None:
    """``POST /sleep`` (``level`` in the body or the query, default 1), ``POST /wake_up``, ``GET /is_sleeping``
    (``model`` in the query), ``POST /update_weights`` and its alias ``/update_weights_from_disk``; all but
    ``/is_sleeping`` an admin key's when keys are set. A body is optional where every field is."""
    anyone = Caller(False, access.allow_client_priority, admin=not access.requires_key)
    refusals = answers(None, 400, 403, 404, 413, 500, 503)

    async def body(raw: Request, schema: type[BaseModel], **query: object) -> BaseModel:
        data = await read_body(raw, preprocessor.limits.max_body_bytes)
        if data.strip():
            return await preprocessor.run(parse_request, data, schema, preprocessor.limits)
        try:
            return schema(**{k: v for k, v in query.items() if v is not None})
        except ValueError:
            raise bad_request("level must be 1 or 2", "level") from None

    @app.post("/sleep", operation_id="sleep", openapi_extra=bodies.json(SleepRequest), responses=refusals)
    async def sleep(raw: Request):
        level = raw.query_params.get("level")
        if level is not None and level not in ("1", "2"):
            raise bad_request(f"level must be 1 or 2, got {level!r}", "level")
        req = await body(raw, SleepRequest, level=int(level) if level else None, model=raw.query_params.get("model"))
        access.check_admin(caller_of(raw.scope) or anyone, "putting the model to sleep")
        return await admin.sleep(req)

    @app.post("/wake_up", operation_id="wakeUp", openapi_extra=bodies.json(WakeUpRequest), responses=refusals)
    async def wake_up(raw: Request):
        req = await body(raw, WakeUpRequest, model=raw.query_params.get("model"))
        access.check_admin(caller_of(raw.scope) or anyone, "waking the model")
        return await admin.wake_up(req)

    @app.get("/is_sleeping", operation_id="isSleeping", responses=answers(None, 404, 500, 503))
    async def is_sleeping(raw: Request, model: str | None = None):
        return await admin.is_sleeping(model)

    async def update(raw: Request):
        req = await preprocessor.parse(raw, UpdateWeightsRequest)
        access.check_admin(caller_of(raw.scope) or anyone, "updating the model's weights")
        return await admin.update(req)

    for path, op in (("/update_weights", "updateWeights"), ("/update_weights_from_disk", "updateWeightsFromDisk")):
        app.post(path, operation_id=op, openapi_extra=bodies.json(UpdateWeightsRequest), responses=refusals)(update)

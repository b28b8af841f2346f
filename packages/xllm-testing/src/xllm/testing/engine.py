"""Driving an :class:`~xllm.core.LLMEngine` in tests: build one, queue requests, step to the end."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.core.config import parse_dtype
from xllm.core.kv.xtensor import page_aligned_block_size
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.tiny import TinyLM, tiny_tokenizer

KV_BACKENDS = ("xtensor", "paged", "contiguous")  # every backend a test parametrized over KV memory runs on


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Autouse fixture for suites that run engines (import it into a conftest): tests share 2 cores
    with other processes, and a second intra-op thread buys little but, oversubscribed, makes every
    op wait on a descheduled OpenMP thread (10x slowdowns seen). Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def unit_block_size(model, dtype: torch.dtype | str = torch.float32) -> int:
    """xTensor's smallest block for ``model`` (whole OS pages per layer's K/V), for tests whose prompts are tens
    of tokens: with the 128-token default they would not span several blocks."""
    return page_aligned_block_size(model.kv_cache_spec(), parse_dtype(dtype))


def make_engine(model=None, *, kv_backend: str = "xtensor", async_scheduling: bool = False, tokenizer=None,
                **config) -> LLMEngine:
    """An engine over ``model`` (default: a fresh :class:`TinyLM`) with test-sized defaults: fp32,
    8 sequences, 256 MiB of KV memory, xTensor's smallest page-aligned block, one torch thread (tests
    share 2 cores with other processes; an oversubscribed OpenMP thread makes every op wait, 10x slowdowns
    seen). ``config`` overrides any setting."""
    config.setdefault("dtype", torch.float32)
    config.setdefault("max_num_seqs", 8)
    config.setdefault("num_threads", 1)
    # 256 MiB of KV is room for every test's sequences; the engine's 2 GiB default took 0.4 s to map
    # (xtensor) and 3.5 s to allocate (paged) per engine, and suites build hundreds of engines
    config.setdefault("kv_cache_memory_gib", 0.25)
    model = model if model is not None else TinyLM()
    if config.get("kv_cache_backend", kv_backend) == "xtensor" and config.get("kv_cache_dtype", "auto") == "auto":
        config.setdefault("block_size", unit_block_size(model, config["dtype"]))
    config = {"kv_cache_backend": kv_backend, "async_scheduling": async_scheduling, **config}
    return LLMEngine(model, tokenizer or tiny_tokenizer(), EngineConfig(**config))


def make_request(rid: str, prompt: list[int], priority: int = 0, arrival_time: float = 0.0,
            **sampling) -> engine_pb2.GenerateRequest:
    """A greedy request for 16 tokens unless ``sampling`` says otherwise."""
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 16)
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, priority=priority,
                                      arrival_time=arrival_time, sampling=engine_pb2.SamplingParams(**sampling))


@dataclass
class StepGate:
    """A step observer that holds its engine's thread after the engine's ``hold_after``-th step until
    :meth:`release` (once released, never again). A test that acts on a request mid-stream (drains
    its instance, say) holds the engine where the request cannot have finished, acts, releases: the
    action then lands on a running request however fast the model and however slow the test's event
    loop (a tiny model otherwise finished 40 tokens before a drain begun from the event loop landed,
    under load). ``timeout``: seconds a held engine waits before failing its step."""

    hold_after: int
    timeout: float = 60.0
    steps: int = 0
    _released: threading.Event = field(default_factory=threading.Event)

    def on_step(self, stats) -> None:
        self.steps += 1
        if self.steps >= self.hold_after and not self._released.wait(self.timeout):
            raise AssertionError(f"engine held after step {self.steps} for {self.timeout:.0f} s: never released")

    def release(self) -> None:
        self._released.set()


@dataclass
class MoveHold:
    """Holds the steps of the engines it is put on, not their commands, while a move of their requests
    is under way: an engine it is put on (:meth:`put_on`) finishes one more step (whose chunks carry
    what its server says from then on: a draining one's move offer), then steps again only once each
    of its requests is paused for a move (``pause_for_move``), finished or gone (aborted, handed back),
    or once :meth:`release` is called (once released, never again). What a move runs on the engine
    thread between steps (snapshots, the pause, aborts) goes on meanwhile, so a migration lands on a
    request that cannot have finished however fast the model and however slow the event loop (a tiny
    model otherwise decoded its last 30 tokens before a migration decided on the loop paused it).
    ``timeout``: seconds an engine stays held before its loop fails."""

    timeout: float = 60.0
    _released: threading.Event = field(default_factory=threading.Event)

    def put_on(self, engine: LLMEngine) -> None:
        """Hold ``engine`` after its next step (its :meth:`~LLMEngine.has_work` says no while it is held)."""
        has_work, steps, since = engine.has_work, engine.counters.steps, None

        def held_has_work() -> bool:
            nonlocal since
            if (engine.counters.steps == steps or self._released.is_set()
                    or all(out.finished or out.seq.moving for out in engine.requests.values())):
                return has_work()
            since = since or time.monotonic()
            if time.monotonic() - since > self.timeout:
                raise AssertionError(f"{engine.instance_id} held for {self.timeout:.0f} s: its requests never moved")
            return False

        engine.has_work = held_has_work

    def release(self) -> None:
        self._released.set()


def gated(engine: LLMEngine, gate: StepGate) -> LLMEngine:
    """``engine`` with ``gate`` among its step observers."""
    engine.observers.append(gate)
    return engine


class Collected:
    """Every chunk of every request, merged."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.logprobs: dict[str, list[float]] = {}
        self.final: dict[str, engine_pb2.GenerateResponse] = {}

    def add(self, chunks) -> None:
        for c in chunks:
            assert c.request_id not in self.final, f"chunk after the final one for {c.request_id}"
            self.tokens.setdefault(c.request_id, []).extend(c.token_ids)
            self.text[c.request_id] = self.text.get(c.request_id, "") + c.text
            self.logprobs.setdefault(c.request_id, []).extend(lp.logprob for lp in c.logprobs)
            if c.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                self.final[c.request_id] = c


def moved_decode_request(req: engine_pb2.GenerateRequest, got: Collected) -> engine_pb2.GenerateRequest:
    """The decode-phase request that continues ``req`` on another instance, as the gateway builds it for a
    migration: the request so far (``req`` plus what ``got`` streamed of it) with that output as earlier
    output (``resumed_output_tokens``, ``resumed_sent_chars``)."""
    tokens, text = got.tokens.get(req.request_id, []), got.text.get(req.request_id, "")
    cont = engine_pb2.GenerateRequest()
    cont.CopyFrom(req)
    cont.prompt_token_ids.extend(tokens)
    cont.resumed_output_tokens, cont.resumed_sent_chars = len(tokens), len(text)
    cont.disagg_phase = engine_pb2.DISAGG_PHASE_DECODE
    return cont


def run_to_completion(engine: LLMEngine, max_steps: int = 5000) -> Collected:
    got = Collected()
    for _ in range(max_steps):
        if not engine.has_work():
            return got
        got.add(engine.step())
    raise AssertionError(f"engine did not finish within {max_steps} steps")


def generate(engine: LLMEngine, requests) -> Collected:
    ready = [c for r in requests for c in engine.add_request(r)]
    got = run_to_completion(engine)
    got.add(ready)
    return got


def drive_loaded(loaded, requests) -> Collected:
    """Run ``requests`` to completion on ``loaded`` (an :class:`xllm.engine.loader.LoadedEngine`): the whole
    loop on its compute thread, as ``AsyncEngine`` runs it; with async scheduling the loop here and the
    forwards on that thread."""
    engine, got = loaded.engine, Collected()

    def drive():
        for r in requests:
            got.add(engine.add_request(r))
        while engine.has_work():
            got.add(engine.step())

    drive() if engine.config.async_scheduling else loaded.compute.call(drive)
    return got


def stream_until_killed(aeng, prompt: list[int], kill, after_tokens: int = 3, max_tokens: int = 400,
                        timeout: float = 60.0) -> tuple[int, BaseException | None, float]:
    """Stream one long greedy request through the started ``AsyncEngine`` ``aeng`` and call ``kill()`` once
    ``after_tokens`` tokens arrived: (tokens received, the ``EngineCrashedError`` that ended the stream or
    None if it finished, seconds from the kill to the stream's end)."""
    import asyncio

    from xllm.engine_api.errors import EngineCrashedError

    async def stream() -> tuple[int, BaseException | None, float]:
        s = aeng.submit(make_request("long", prompt, max_tokens=max_tokens, ignore_eos=True))
        n, killed_at = 0, 0.0
        try:
            async for chunk in s:
                n += len(chunk.token_ids)
                if n >= after_tokens and not killed_at:
                    kill()
                    killed_at = time.monotonic()
        except EngineCrashedError as exc:
            return n, exc, time.monotonic() - killed_at
        return n, None, time.monotonic() - killed_at

    return asyncio.run(asyncio.wait_for(stream(), timeout))


class HandoffListener:
    """A ``DisaggListener`` for prefill/decode hand-off tests without a transport: records the decode side's
    reservations and the prefill side's hand-offs by request id (the test moves the KV itself)."""

    def __init__(self) -> None:
        self.reserved: dict = {}
        self.handoffs: dict = {}

    def on_reserved(self, reservation) -> None:
        self.reserved[reservation.request_id] = reservation

    def on_prompt_finishing(self, prompts):
        return None

    def on_handoff(self, handoff) -> None:
        self.handoffs[handoff.request_id] = handoff

    def on_abandoned(self, request_id: str) -> None:
        pass


class MigrationListener:
    """A ``DisaggListener`` for migration tests: records reservations, ready moves and abandoned requests
    (the engine service's side, without a transport); a prefill hand-off fails the test."""

    def __init__(self) -> None:
        self.reserved: dict = {}
        self.ready: dict = {}
        self.abandoned: list[str] = []

    def on_reserved(self, reservation) -> None:
        self.reserved[reservation.request_id] = reservation

    def on_prompt_finishing(self, prompts):
        return None

    def on_handoff(self, handoff) -> None:
        raise AssertionError("no prefill hand-off in a migration")

    def on_move_ready(self, ready) -> None:
        self.ready[ready.request_id] = ready

    def on_abandoned(self, request_id: str) -> None:
        self.abandoned.append(request_id)


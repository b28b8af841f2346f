"""Engines that stop stepping without breaking their streams off, over real engine servers in this
process (tiny model), each resumed elsewhere through the gateway's dispatcher exactly as after a crash:

- a deadlocked engine thread (a :class:`StepGate` that never lets its step return) while the process
  lives: the engine's step watchdog takes it for hung, fails its streams, its health says why;
- a stopped instance (what SIGSTOP looks like from outside: no chunk, no heartbeat): it leaves the
  registry and the gateway's progress check breaks its streams off;
- an instance that heartbeats but sends a streaming request nothing: the gateway's no-chunk bound.

The oracle is one engine serving the whole request: the client reads the same tokens, text and finish
reason, greedy and seeded. (SIGSTOP of a real engine process: integration_tests/reliability.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from xllm.core import LLMEngine
from xllm.engine.instance import InstanceOptions, serve_instance
from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.errors import EngineCrashedError, EngineDeadError
from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.progress import StallLimits
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.router import Router
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.engine import Collected, StepGate, gated, generate, make_engine, make_request
from xllm.testing.processes import until
from xllm.testing.registry import LocalPublisher
from xllm.testing.served import ServedEngine
from xllm.testing.tiny import TinyLM, tiny_tokenizer

MODEL = "tiny"
LM = TinyLM()
PROMPT = tiny_tokenizer().encode_pieces(list("the quick brown fox jumps over the lazy dog, twice over " * 2))
GREEDY = dict(max_tokens=40, ignore_eos=True)
SEEDED = dict(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True)
HOLD_AFTER = 4  # steps of an engine before its gate holds its thread
FAST = StallLimits(no_chunk_s=0.0, gone_silent_s=0.2, poll_s=0.05)  # (defaults: seconds)
TIMEOUT = 60.0


class Cluster:
    """Instances ``a`` and ``b`` registered with one in-process registry, each engine behind its own
    gate; the instance a request lands on is held after ``HOLD_AFTER`` steps, the other one released.
    ``step_timeout``: the engines' step watchdog (0: none)."""

    def __init__(self, stall: StallLimits, step_timeout: float = 0.0) -> None:
        self.registry = EmbeddedRegistry()
        self.gates = {iid: StepGate(hold_after=HOLD_AFTER) for iid in ("a", "b")}
        self.nodes = {iid: ServedEngine(named(gated(make_engine(LM), gate), iid), model=MODEL,
                                        step_timeout=step_timeout) for iid, gate in self.gates.items()}
        self.dispatcher = Dispatcher(self.registry, MODEL, Router(self.registry, "kv_aware"), stall=stall)

    async def __aenter__(self) -> Cluster:
        for node in self.nodes.values():
            await node.start(self.registry)
        return self

    async def __aexit__(self, *exc) -> None:
        for gate in self.gates.values():
            gate.release()
        for node in self.nodes.values():
            if node.aeng.is_running:
                await node.stop()
            else:  # (a hung engine: ServedEngine.stop takes it for stopped already)
                if node.agent is not None:
                    await node.agent.stop()
                await node.client.close()
                await node.server.stop(0)
                node.aeng.shutdown()
                node.engine.close()
        await self.registry.close()

    async def generate(self, rid: str, on_held=None, **sampling) -> tuple[Collected, object]:
        """One request through the dispatcher, its instance held after ``HOLD_AFTER`` steps (the other
        released); ``on_held(node)`` (a coroutine) starts once the client read a chunk of it. Returns the
        client's view and the routed stream."""
        _, (stream,) = await self.dispatcher.submit_all(MODEL, [make_request(rid, PROMPT, **sampling)])
        first = stream.instance_id
        for iid, gate in self.gates.items():
            if iid != first:
                gate.release()
        got, acted = Collected(), None
        async for chunk in stream:
            got.add([chunk])
            if acted is None and on_held is not None:
                acted = asyncio.ensure_future(on_held(self.nodes[first]))
        if acted is not None:
            await acted
        return got, stream


def named(engine: LLMEngine, instance_id: str) -> LLMEngine:
    engine.instance_id = instance_id
    return engine


def reference(rid: str, **sampling) -> Collected:
    return generate(make_engine(LM), [make_request(rid, PROMPT, **sampling)])


def assert_same(got: Collected, want: Collected, rid: str) -> None:
    assert got.tokens[rid] == want.tokens[rid]
    assert got.text[rid] == want.text[rid]
    assert got.final[rid].finish_reason == want.final[rid].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert got.final[rid].usage.completion_tokens == want.final[rid].usage.completion_tokens


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_deadlocked_engine_thread_is_taken_for_hung_and_its_stream_resumes_elsewhere(sampling):
    async def main():
        async with Cluster(StallLimits(), step_timeout=1.0) as cluster:  # (well above a tiny step on a busy CI)
            got, stream = await cluster.generate("r", **sampling)
            assert stream.resumes == 1 and len(stream.progress.failed) == 1
            held = cluster.nodes[next(iter(stream.progress.failed))]
            # the watchdog's verdict: dead, its health says why, new requests refused
            assert held.aeng.hung and not held.aeng.is_running
            assert held.server.health_problem().startswith("engine hung")
            with pytest.raises(EngineDeadError):
                held.aeng.submit(make_request("late", PROMPT))
            return got

    assert_same(run(main()), reference("r", **sampling), "r")


def test_a_hung_instance_fails_its_streams_deregisters_and_exits_as_a_crashed_one():
    """The instance process's side of the watchdog (``serve_instance``): the stream fails as in a crash,
    the instance leaves the registry, and serving ends with ``EngineCrashedError`` (exit status 1)."""

    async def main():
        registry, gate = EmbeddedRegistry(), StepGate(hold_after=HOLD_AFTER)
        engine = named(gated(make_engine(LM), gate), "w")
        info = instance_pb2.InstanceInfo(instance_id="w", model=instance_pb2.ModelInfo(
            served_name=MODEL, max_model_len=engine.max_model_len, block_size=engine.layout.block_size))
        opts = InstanceOptions(step_timeout=1.0, heartbeat_interval=0.05, drain_timeout=1.0)
        serving = asyncio.ensure_future(serve_instance(engine, info, opts, LocalPublisher(registry)))
        client = None
        try:
            await until(lambda: registry.get("w") is not None, 30, "the instance registered")
            client = GrpcEngineClient(info)
            with pytest.raises(InstanceUnavailableError) as broke:
                async for _ in await client.submit(make_request("r", PROMPT, **GREEDY)):
                    pass
            assert broke.value.crashed and "engine hung" in str(broke.value)
            with pytest.raises(EngineCrashedError):
                await serving
            assert registry.get("w") is None
        finally:
            gate.release()
            serving.cancel()
            if client is not None:
                await client.close()
            await registry.close()

    run(main())


def test_a_long_step_below_the_margin_is_not_taken_for_hung():
    """The watchdog allows 4 times the longest step so far: a step 1.5 times the floor, after one of
    half of it, is legitimate (without the margin it would trip; 0.5 s of slack each way for a busy CI)."""
    floor = 1.0
    waits = {2: 0.5 * floor, 3: 1.5 * floor}

    class SlowSteps:  # a big prefill stand-in: some steps take long
        steps = 0

        def on_step(self, stats) -> None:
            self.steps += 1
            time.sleep(waits.get(self.steps, 0.0))

    async def main():
        node = ServedEngine(gated(make_engine(LM), SlowSteps()), model=MODEL, step_timeout=floor)
        await node.start()
        try:
            chunks = [c async for c in await node.client.submit(make_request("r", PROMPT, max_tokens=8))]
            assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
            assert node.aeng.is_running and not node.aeng.hung and node.server.health_problem() == ""
            assert node.aeng.longest_step >= waits[3]
        finally:
            await node.stop()

    run(main())


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_stopped_instance_leaves_the_registry_and_its_stream_resumes_elsewhere(sampling):
    """A SIGSTOP'd engine seen from the gateway: no more chunks (its thread held) and no more heartbeats
    (its lease ends: the registry drops it); no watchdog of its own runs (the process is stopped)."""

    async def main():
        async with Cluster(FAST) as cluster:
            got, stream = await cluster.generate("r", on_held=lambda node: node.agent.stop(), **sampling)
            assert stream.resumes == 1 and len(stream.progress.failed) == 1
            assert cluster.registry.get(next(iter(stream.progress.failed))) is None
            return got

    assert_same(run(main()), reference("r", **sampling), "r")


def test_an_instance_silent_mid_stream_is_broken_off_at_the_bound():
    """Heartbeats flow (no watchdog there) but the stream gets nothing past the gateway's bound."""

    async def main():
        async with Cluster(StallLimits(no_chunk_s=0.3, gone_silent_s=1.0, poll_s=0.05)) as cluster:
            got, stream = await cluster.generate("r", **SEEDED)
            assert stream.resumes == 1 and len(stream.progress.failed) == 1
            state = cluster.registry.get(next(iter(stream.progress.failed)))
            assert state is not None and state.breaker.failures  # still registered; its breaker counted it
            return got

    assert_same(run(main()), reference("r", **SEEDED), "r")

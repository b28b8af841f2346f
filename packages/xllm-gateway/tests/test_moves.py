"""Requests moved off a draining instance through the gateway's dispatcher, over real engine servers
in this process (tiny model): migrated with their KV over each transport, or recomputed, in mixed
and PD clusters, and falling back to recompute when a migration is refused. The oracle is one
engine serving the whole request: what the client reads across the move has the same tokens,
text and finish reason, greedy and seeded. The gateway's move metrics and the engines' migration
counters say which way each request went, and the drained instance ends up holding nothing."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.disagg import PDStream
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.metrics import MoveMetrics, PDMetrics
from xllm.gateway.moves import Migration, MoveOptions, Mover
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.router import Router
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.engine import Collected, MoveHold, StepGate, gated, generate, make_engine, make_request
from xllm.testing.processes import until
from xllm.testing.served import ServedEngines
from xllm.testing.tiny import TinyLM, tiny_tokenizer

MODEL = "tiny"
LM = TinyLM()
PROMPT = tiny_tokenizer().encode_pieces(list("the quick brown fox jumps over the lazy dog, twice over " * 2))
GREEDY = dict(max_tokens=40, ignore_eos=True)
SEEDED = dict(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True)
MOVE_AFTER = 4  # chunks the client has read when the instance starts draining
TIMEOUT = 60.0


class Cluster:
    """Instances registered with one in-process registry, and a dispatcher moving as ``mode`` says."""

    def __init__(self, roles: dict[str, str], transport: str, mode: str) -> None:
        self.registry = EmbeddedRegistry()
        # the engines hold (after 2 x MOVE_AFTER steps of them all: past the client's MOVE_AFTER-th chunk) until
        # the drain has begun: the request is still running when it does, however fast the model
        self.gate = StepGate(hold_after=2 * MOVE_AFTER)
        # then the drained instance steps only once its request is paused for the move (or gone): a migration
        # copies while the source decodes, and the tiny model otherwise finished before the pause under load
        self.hold = MoveHold()
        self.served = ServedEngines(roles, lambda: gated(make_engine(LM), self.gate), transport, MODEL)
        self.nodes = self.served.nodes
        self.prom = CollectorRegistry()
        router = Router(self.registry, "kv_aware")
        self.dispatcher = Dispatcher(self.registry, MODEL, router, pd_metrics=PDMetrics(self.prom),
                                     mover=Mover(router, MoveOptions(mode), MoveMetrics(self.prom)))

    async def __aenter__(self) -> Cluster:
        await self.served.start(self.registry)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.served.stop()
        await self.registry.close()

    def moves(self, how: str) -> float:
        return self.prom.get_sample_value("xllm:request_moves_total", {"model_name": MODEL, "how": how}) or 0.0

    async def generate_draining(self, rid: str, **sampling) -> tuple[Collected, str]:
        """One request through the dispatcher; once the client read ``MOVE_AFTER`` chunks, the
        instance decoding it drains. Returns the client's view and the drained instance."""
        _, (stream,) = await self.dispatcher.submit_all(MODEL, [make_request(rid, PROMPT, **sampling)])
        got, chunks, drained, drain = Collected(), 0, "", None
        async for chunk in stream:
            got.add([chunk])
            chunks += 1
            if chunks == MOVE_AFTER:
                drained = _decoding_instance(stream)
                self.nodes[drained].server.begin_drain()
                self.hold.put_on(self.nodes[drained].engine)
                drain = asyncio.ensure_future(self.nodes[drained].server.drain(30.0))
                self.gate.release()
        assert drain is not None, "the request ended before the drain"
        await drain
        return got, drained


def _decoding_instance(stream) -> str:
    inner = stream._stream
    return inner.decode.state.instance_id if isinstance(inner, PDStream) else stream.instance_id


def reference(rid: str, **sampling) -> Collected:
    return generate(make_engine(LM), [make_request(rid, PROMPT, **sampling)])


def assert_same(got: Collected, want: Collected, rid: str) -> None:
    assert got.tokens[rid] == want.tokens[rid]
    assert got.text[rid] == want.text[rid]
    assert got.final[rid].finish_reason == want.final[rid].finish_reason
    assert got.final[rid].usage.completion_tokens == want.final[rid].usage.completion_tokens


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


CASES = [("fd", "migrate", GREEDY), ("fd", "migrate", SEEDED), ("grpc", "migrate", SEEDED),
         ("fd", "recompute", SEEDED), ("fd", "auto", GREEDY)]


@pytest.mark.parametrize("transport, mode, sampling", CASES,
                         ids=[f"{t}-{m}-{'seeded' if 'seed' in s else 'greedy'}" for t, m, s in CASES])
def test_a_draining_instance_moves_its_request_and_the_client_sees_one_run(transport, mode, sampling):
    async def main():
        async with Cluster({"a": "mixed", "b": "mixed"}, transport, mode) as c:
            got, drained = await c.generate_draining("r", **sampling)
            other = next(n for iid, n in c.nodes.items() if iid != drained)
            source = c.nodes[drained]
            await until(lambda: not source.engine.requests and source.engine.kv.num_free_blocks ==
                        source.engine.layout.num_blocks, 5, "the drained instance holds nothing")
            return got, {h: c.moves(h) for h in ("migrated", "recomputed", "migration_failed")}, \
                source.server.counters(), other.server.counters()

    got, moves, src, dst = run(main())
    assert_same(got, reference("r", **sampling), "r")
    how = "recomputed" if mode == "recompute" else "migrated"  # auto: the tiny KV is far quicker to copy
    assert moves[how] == 1 and sum(moves.values()) == 1, moves
    migrated = how == "migrated"
    assert (src.kv_migrations_sent, dst.kv_migrations_installed) == (migrated, migrated)
    assert src.kv_migration_failures == dst.kv_migration_failures == 0


def test_a_decode_instance_of_a_pd_pair_migrates_to_another_decode_instance():
    async def main():
        async with Cluster({"p": "prefill", "d1": "decode", "d2": "decode"}, "grpc", "migrate") as c:
            got, drained = await c.generate_draining("r", **SEEDED)
            return got, drained, c.moves("migrated"), {i: n.server.counters() for i, n in c.nodes.items()}

    got, drained, migrated, counters = run(main())
    assert_same(got, reference("r", **SEEDED), "r")
    assert drained in ("d1", "d2") and migrated == 1
    other = "d2" if drained == "d1" else "d1"
    assert counters[other].kv_migrations_installed == 1 and counters["p"].kv_migrations_installed == 0


def test_a_refused_migration_falls_back_to_recompute(monkeypatch):
    async def refuse(self, request, context):
        return engine_pb2.MigrateResponse(accepted=False, error="refused by the test")

    monkeypatch.setattr("xllm.engine.server.EngineServer.Migrate", refuse)

    async def main():
        async with Cluster({"a": "mixed", "b": "mixed"}, "fd", "migrate") as c:
            attempt = Migration._run

            async def attempt_then_go_on(self) -> None:
                try:
                    await attempt(self)
                finally:  # the gateway knows how the move went (its task ends with this): the source goes on
                    c.hold.release()

            monkeypatch.setattr(Migration, "_run", attempt_then_go_on)
            got, _ = await c.generate_draining("r", **GREEDY)
            return got, {h: c.moves(h) for h in ("migrated", "recomputed", "migration_failed")}

    got, moves = run(main())
    assert_same(got, reference("r", **GREEDY), "r")
    assert moves == {"migrated": 0, "recomputed": 1, "migration_failed": 1}


class _Unreachable:
    """An instance's client that only has an identity and a load (a reservation there fails)."""

    def __init__(self, iid: str) -> None:
        self.info = instance_pb2.InstanceInfo(instance_id=iid, model=instance_pb2.ModelInfo(served_name=MODEL))

    async def submit(self, req, trace=None):
        raise InstanceUnavailableError(f"{self.info.instance_id} is only a test double", self.info.instance_id)

    async def close(self) -> None:
        pass


def test_moves_decided_together_see_each_other():
    """The cost of each move counts the moves decided before it: recomputes already queued on the
    destination, KV already being copied. Four requests of 1000 tokens (2 MB of KV each) leave at
    once for an instance prefilling 4000 tokens/s, over a 40 MB/s link: 0.25 s of prefill each
    against 0.05 s of copy each."""
    registry = EmbeddedRegistry()
    for iid in ("src", "dst"):
        registry.register(_Unreachable(iid))
    registry.get("dst").load = instance_pb2.LoadReport(instance_id="dst", prefill_tokens_per_s=4000.0)
    router = Router(registry, "least_load")
    source = router.route_move(MODEL, [1], exclude={"dst"})

    async def decide(mode: str, n: int) -> list:
        mover = Mover(router, MoveOptions(mode, bandwidth_prior=40e6))
        offer = engine_pb2.MoveOffer(num_tokens=1000, kv_bytes=2_000_000)
        cont = make_request("r#1", list(range(1000)))
        plans = [mover.offer(MODEL, source, "r", cont, offer) for _ in range(n)]
        for p in plans:
            if isinstance(p, Migration):
                await p.cancel()
        return plans

    recomputes = asyncio.run(decide("recompute", 4))
    queued = [p.cost.recompute_seconds for p in recomputes]
    assert queued == sorted(queued) and queued[-1] > 3.9 * queued[0]  # 0.25 s, then behind 1, 2, 3 of them
    assert registry.get("dst").pending_prefill == 4000
    for p in recomputes:
        p.release()
    assert registry.get("dst").pending_prefill == 0
    auto = asyncio.run(decide("auto", 6))
    # copies share the link: 50 ms, 100 ms, ... until a recompute (250 ms) is quicker than the next copy
    assert [type(p).__name__ for p in auto] == ["Migration"] * 5 + ["Recompute"]
    assert [round(p.cost.transfer_seconds, 3) for p in auto] == [0.05, 0.1, 0.15, 0.2, 0.25, 0.3]

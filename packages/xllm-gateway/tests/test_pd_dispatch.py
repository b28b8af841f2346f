"""PD mode through the gateway's dispatcher, over real engine servers in this process (tiny model):
the stream a client sees equals one engine serving the whole request (tokens, text, finish reason;
greedy and seeded, several choices), the decode instance holding a prefix is chosen and receives
only the rest, a prefill instance that dies before the first token is replaced, a decode instance
that dies mid-stream is resumed through another pair, and a client leaving between the phases
frees both sides. Every one of these shows in the gateway's PD metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from prometheus_client import CollectorRegistry

from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.metrics import PDMetrics
from xllm.gateway.progress import StallLimits
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.router import Router
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected, StepGate, gated, generate, make_engine, make_request
from xllm.testing.processes import until
from xllm.testing.served import ServedEngine, ServedEngines
from xllm.testing.tiny import TinyLM, tiny_tokenizer

MODEL = "tiny"
LM = TinyLM()
TOK = tiny_tokenizer()
PROMPT = TOK.encode_pieces(list("the quick brown fox jumps over the lazy dog, twice over " * 2))
GREEDY = dict(max_tokens=24, ignore_eos=True)
SEEDED = dict(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
TIMEOUT = 60.0


class Cluster:
    """Prefill and decode instances registered with one in-process registry, and a dispatcher."""

    def __init__(self, roles: dict[str, str], transport: str = "fd", stall: StallLimits | None = None) -> None:
        self.registry = EmbeddedRegistry()
        self.served = ServedEngines(roles, lambda: make_engine(LM), transport, MODEL)
        self.nodes = self.served.nodes
        self.prom = CollectorRegistry()
        self.dispatcher = Dispatcher(self.registry, MODEL, Router(self.registry, "kv_aware"),
                                     pd_metrics=PDMetrics(self.prom), handoff_grace=1.0, stall=stall)

    async def __aenter__(self) -> Cluster:
        await self.served.start(self.registry)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.served.stop()
        await self.registry.close()

    def metric(self, name: str, **labels: str) -> float:
        return self.prom.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0

    async def generate(self, rid: str, prompt: list[int], n: int = 1, **sampling):
        """Every choice of one API request through the dispatcher: (client view, streams)."""
        reqs = [make_request(f"{rid}-{i}", prompt, **sampling) for i in range(n)]
        _, streams = await self.dispatcher.submit_all(MODEL, reqs)
        got = Collected()
        for s in streams:
            async for chunk in s:
                got.add([chunk])
        return got, streams

    async def settled(self, iid: str, free_blocks: int) -> bool:
        """Whether instance ``iid`` ends up with no request and ``free_blocks`` free (polled: the
        release runs on the engine thread after the call ended)."""
        engine = self.nodes[iid].engine
        try:
            await until(lambda: not engine.requests and engine.kv.num_free_blocks == free_blocks, 4, f"{iid} idle")
        except AssertionError:
            return False
        return True


def reference(rid: str, prompt: list[int], n: int = 1, **sampling) -> Collected:
    """One engine serving each choice whole (the oracle)."""
    return generate(make_engine(LM), [make_request(f"{rid}-{i}", prompt, **sampling) for i in range(n)])


@pytest.fixture(scope="module", autouse=True)
def _kernels_built():
    """One engine run before any timed run: the first build of the native kernels on a fresh cache
    (about a minute on two cores, at the first step) must not count against a test's ``TIMEOUT``."""
    reference("warm", PROMPT, n=2, max_tokens=2)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_pd_streams_equal_one_engine(sampling):
    async def main():
        async with Cluster({"p": "prefill", "d": "decode"}) as c:
            got, streams = await c.generate("r", PROMPT, n=2, **sampling)
            pd = [s._stream for s in streams]
            return got, pd, c.metric("xllm:kv_transfer_bytes_total", transport="fd"), \
                c.metric("xllm:pd_ttft_breakdown_seconds_count", phase="transfer")

    got, pd, moved, breakdowns = run(main())
    ref = reference("r", PROMPT, n=2, **sampling)
    for rid in ("r-0", "r-1"):
        assert got.tokens[rid] == ref.tokens[rid] and got.text[rid] == ref.text[rid]
        assert got.final[rid].finish_reason == ref.final[rid].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert got.final[rid].usage.completion_tokens == sampling["max_tokens"]
    assert all((s.prefill.state.instance_id, s.decode.state.instance_id) == ("p", "d") for s in pd)
    assert moved > 0 and breakdowns == 2


def test_the_decode_instance_holding_the_prefix_is_chosen_and_receives_only_the_rest():
    system = TOK.encode_pieces(list("you are a helpful assistant and you answer briefly. " * 3)[:130])
    first, second = system + TOK.encode_pieces(list("hi")), system + TOK.encode_pieces(list("yo"))

    async def main():
        async with Cluster({"p": "prefill", "d1": "decode", "d2": "decode"}) as c:
            _, (s1,) = await c.generate("a", first, **GREEDY)
            home = s1._stream.decode.state.instance_id
            # its heartbeats carry the blocks it holds into the global index
            await until(lambda: c.registry.kv_index.num_blocks(home), 10, "the blocks in the global index")
            got, (s2,) = await c.generate("b", second, **GREEDY)
            return home, s1._stream.target, s2._stream, got, c.nodes["p"].engine.kv.prefix_stats.hits

    home, t1, pd2, got, prefill_hits = run(main())
    bs = make_engine(LM).layout.block_size
    assert pd2.decode.state.instance_id == home
    assert t1.matched_tokens == 0 and pd2.target.matched_tokens == len(system) // bs * bs > 0
    assert prefill_hits >= len(system) // bs * bs  # the prefill instance reused its own copy too
    assert got.tokens["b-0"] == reference("b", second, **GREEDY).tokens["b-0"]


def _die_on_first_request(node: ServedEngine, loop: asyncio.AbstractEventLoop, died: list[str], when: str,
                          accepted: list[bool]) -> None:
    """Make ``node`` stop serving on the first request it gets, before any token of it: ``"submit"``
    while the call is being accepted (the client's submit fails), ``"accepted"`` once the call was
    accepted and the request reached the engine (the client's stream fails; ``accepted`` gets whether
    the server had registered the call when it stopped)."""
    if when == "submit":
        submit = node.aeng.submit_async

        async def submit_async(req, trace=None):
            if died:
                return await submit(req, trace)
            died.append(node.instance_id)
            stopping = asyncio.ensure_future(node.server.stop(0))
            await asyncio.Event().wait()  # cancelled with the call, by ``stopping``
            del stopping

        node.aeng.submit_async = submit_async
        return
    add = node.engine.add_request

    def add_request(req, trace=None):  # on the engine thread
        if not died:
            died.append(node.instance_id)
            deadline = time.monotonic() + 10
            while not node.server.num_inflight and time.monotonic() < deadline:
                time.sleep(0.001)  # the server accepts the call on its loop right after queueing the request
            accepted.append(node.server.num_inflight > 0)
            asyncio.run_coroutine_threadsafe(node.server.stop(0), loop).result()
            return None  # the request dies with the instance
        return add(req, trace)

    node.engine.add_request = add_request


@pytest.mark.parametrize("when", ["submit", "accepted"])
def test_a_prefill_instance_dying_before_the_first_token_is_replaced(when):
    """Either way the instance dies, the request is prefilled by the other one, the retry counts
    once, and the stream equals one engine's."""
    async def main():
        async with Cluster({"p1": "prefill", "p2": "prefill", "d": "decode"}) as c:
            died: list[str] = []
            accepted: list[bool] = []
            for iid in ("p1", "p2"):
                _die_on_first_request(c.nodes[iid], asyncio.get_running_loop(), died, when, accepted)
            got, (stream,) = await c.generate("r", PROMPT, **SEEDED)
            pd = stream._stream
            return got, died, accepted, pd, stream.resumes, \
                c.metric("xllm:pd_prefill_retries_total", instance=died[0])

    got, died, accepted, pd, resumes, retries = run(main())
    assert accepted == ([True] if when == "accepted" else [])  # the instance died where the case says
    assert len(died) == 1 and pd.prefill.state.instance_id != died[0] and pd.prefill_attempts == 2
    assert retries == 1 and resumes == 0  # the reservation waited: no resume needed
    ref = reference("r", PROMPT, **SEEDED)
    assert got.tokens["r-0"] == ref.tokens["r-0"] and got.text["r-0"] == ref.text["r-0"]


def test_a_prefill_instance_that_stops_before_the_first_token_is_replaced():
    """A prefill instance that stops without breaking its stream off (its engine thread held in its first
    step, before the first token; its heartbeats gone: SIGSTOP seen from outside): once it has left the
    registry the gateway breaks its prefill stream off, the other prefill instance prefills the request, the
    decode side's reservation waits, and the stream equals one engine's."""
    async def main():
        stall = StallLimits(gone_silent_s=0.2, poll_s=0.05)
        async with Cluster({"p1": "prefill", "p2": "prefill", "d": "decode"}, stall=stall) as c:
            gates = {iid: StepGate(hold_after=1) for iid in ("p1", "p2")}
            for iid, gate in gates.items():
                gated(c.nodes[iid].engine, gate)
            try:
                _, (stream,) = await c.dispatcher.submit_all(MODEL, [make_request("r-0", PROMPT, **SEEDED)])
                held = stream._stream.prefill.state.instance_id
                for iid, gate in gates.items():
                    if iid != held:
                        gate.release()
                await c.nodes[held].agent.stop()  # no more heartbeats: it leaves the registry
                got = Collected()
                async for chunk in stream:
                    got.add([chunk])
            finally:
                for gate in gates.values():
                    gate.release()
            return got, held, stream._stream, stream.resumes, c.metric("xllm:pd_prefill_retries_total", instance=held)

    got, held, pd, resumes, retries = run(main())
    assert pd.prefill.state.instance_id != held and pd.prefill_attempts == 2
    assert retries == 1 and resumes == 0
    ref = reference("r", PROMPT, **SEEDED)
    assert got.tokens["r-0"] == ref.tokens["r-0"] and got.text["r-0"] == ref.text["r-0"]


def test_a_prefill_instance_dying_after_the_first_token_without_handing_off_is_resumed():
    """The prefill instance streams the first token, then dies before sending the KV: the decode
    side never shows a token, so after the grace period the request is resumed (prompt + the
    token already streamed) through the other prefill instance."""
    async def main():
        async with Cluster({"p1": "prefill", "p2": "prefill", "d": "decode"}) as c:
            first_seen, died, stopping = asyncio.Event(), [], []
            for iid in ("p1", "p2"):
                node = c.nodes[iid]

                async def die_instead_of_sending(request_id, target, out, node=node):
                    if died:
                        return await real_send[node.instance_id](request_id, target, out)
                    died.append(node.instance_id)
                    await out.commit()  # the first token is sampled
                    await first_seen.wait()  # and the client has it
                    stopping.append(asyncio.ensure_future(node.server.stop(0)))  # (it cancels this task)

                real_send[iid] = node.server.handoff._send
                node.server.handoff._send = die_instead_of_sending
            _, (stream,) = await c.dispatcher.submit_all(MODEL, [make_request("r-0", PROMPT, **GREEDY)])
            got = Collected()
            async for chunk in stream:
                got.add([chunk])
                first_seen.set()
            return got, died, stream.resumes, c.metric("xllm:pd_handoffs_lost_total")

    real_send: dict = {}
    got, died, resumes, lost = run(main())
    assert len(died) == 1 and resumes == 1 and lost == 1
    ref = reference("r", PROMPT, **GREEDY)
    assert got.tokens["r-0"] == ref.tokens["r-0"] and got.text["r-0"] == ref.text["r-0"]
    assert got.final["r-0"].usage.completion_tokens == GREEDY["max_tokens"]


def test_a_decode_instance_dying_mid_stream_is_resumed_through_another_pair():
    async def main():
        async with Cluster({"p": "prefill", "d1": "decode", "d2": "decode"}) as c:
            reqs = [make_request("r-0", PROMPT, **GREEDY)]
            _, (stream,) = await c.dispatcher.submit_all(MODEL, reqs)
            first_decode = stream._stream.decode.state.instance_id
            got, stopper = Collected(), None
            async for chunk in stream:
                got.add([chunk])
                if len(got.tokens["r-0"]) >= 6 and stopper is None:
                    stopper = asyncio.ensure_future(c.nodes[first_decode].kill())
            await stopper
            return got, stream, first_decode

    got, stream, first_decode = run(main())
    ref = reference("r", PROMPT, **GREEDY)
    assert stream.resumes == 1 and stream._stream.decode.state.instance_id != first_decode
    assert got.tokens["r-0"] == ref.tokens["r-0"] and got.text["r-0"] == ref.text["r-0"]
    assert got.final["r-0"].usage.completion_tokens == GREEDY["max_tokens"]


def test_a_client_leaving_between_the_phases_frees_both_sides():
    async def main():
        async with Cluster({"p": "prefill", "d": "decode"}) as c:
            free = {iid: n.engine.kv.num_free_blocks for iid, n in c.nodes.items()}
            _, (stream,) = await c.dispatcher.submit_all(MODEL, [make_request("r-0", PROMPT, max_tokens=40,
                                                                              ignore_eos=True)])
            it = aiter(stream)
            first = await anext(it)  # the prefill instance's first token; the client goes away
            with contextlib.suppress(StopAsyncIteration):
                await it.aclose()
            freed = [await c.settled(iid, blocks) for iid, blocks in free.items()]
            return first, freed, c.metric("xllm:pd_cancelled_total")

    first, freed, cancelled = run(main())
    assert len(first.token_ids) == 1 and all(freed) and cancelled == 1

"""Bounded work before trust and before cost (issue 50, item 2): the engine service refuses a
message larger than its kind can need before parsing it (gRPC core for anything over the largest
kind, the bounded deserializers of :mod:`xllm.engine.intake` below that), and the request limits the
gateway applies are applied again by the engine, naming the field, cheapest checks first. A served
tiny engine keeps serving and heartbeating through an attack of 64 and 200 MiB messages."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import struct
import time

import grpc
import pytest

from xllm.core import AsyncEngine
from xllm.engine.handoff import grpc as grpc_transport
from xllm.engine.handoff.base import HandoffOptions, TransferError
from xllm.engine.handoff.fd import FdReceiver
from xllm.engine.handoff.manager import HandoffManager
from xllm.engine.intake import SMALL_MESSAGE_BYTES, Oversized, generate_shape, message_bounds
from xllm.engine_api.bounds import (
    KV_MESSAGE_BYTES,
    RequestBounds,
    generate_allowance,
    generate_message_bytes,
    kv_message_bytes,
)
from xllm.engine_api.wire import ACCEPTED_KEY, ERROR_PARAM_KEY
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.engine import generate, make_engine, make_request
from xllm.testing.processes import until
from xllm.testing.served import ServedEngine, pd_generate
from xllm.testing.tiny import TinyLM, tiny_tokenizer

GENERATE = "/xllm.engine.v1.EngineService/Generate"
MIB = 1 << 20
PROMPT = tiny_tokenizer().encode_pieces(list("the cat sat on the mat"))


class CountingLimits:
    """The engine's :class:`RequestLimits`, counting the requests that reach validation."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def check(self, req):
        self.calls += 1
        return self.inner.check(req)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Leases:
    """A lease table with etcd's semantics (a lease lives ``ttl`` s past its last renewal), counting
    the renewals: what the registry sees of the engine."""

    def __init__(self, ttl: float = 3.0) -> None:
        self.ttl = ttl
        self.grants = 0
        self.renewals = 0
        self.expired = 0
        self._expires: dict[int, float] = {}

    def grant(self, info: instance_pb2.InstanceInfo, ttl: float) -> tuple[int, float]:
        self.grants += 1
        self._expires[self.grants] = time.monotonic() + self.ttl
        return self.grants, self.ttl

    def keepalive(self, lease_id: int, heartbeat: instance_pb2.Heartbeat | None = None) -> bool:
        if self._expires.get(lease_id, 0.0) < time.monotonic():
            self.expired += 1
            return False
        self.renewals += 1
        self._expires[lease_id] = time.monotonic() + self.ttl
        return True

    def revoke(self, lease_id: int) -> None:
        self._expires.pop(lease_id, None)


def huge_generate(size: int) -> bytes:
    """A serialized GenerateRequest of ``size`` bytes: a valid head and a packed prompt of ``1`` tokens
    (built as bytes: no 50-million-element message in the test process)."""
    head = make_request("huge", [1], max_tokens=1).SerializeToString()
    tokens = size - len(head) - 1 - 4
    return head + b"\x12" + _varint(tokens) + b"\x01" * tokens


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


async def _status(call) -> tuple[grpc.StatusCode, str, dict]:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", dict(exc.trailing_metadata() or ())
    return grpc.StatusCode.OK, "", {}


def serve(test, **config):
    """Run ``await test(node)`` against a served tiny engine registered in a :class:`Leases`."""
    config.setdefault("kv_cache_backend", "paged")
    config.setdefault("block_size", 16)
    config.setdefault("kv_cache_memory_gib", 0.01)

    async def main():
        engine = make_engine(**config)
        engine.instance_id = "e0"
        node = ServedEngine(engine)
        node.leases = Leases()
        await node.start(node.leases)
        try:
            return await test(node)
        finally:
            await node.stop()

    return asyncio.run(main())


def test_64_and_200_mib_generates_are_refused_unparsed_and_the_engine_stays_registered():
    async def test(node: ServedEngine):
        limits = node.engine.limits = CountingLimits(node.engine.limits)
        leases = node.leases
        await until(lambda: leases.renewals >= 2, 30, "the first heartbeats")
        async with grpc.aio.insecure_channel(node.info.address) as channel:
            raw = channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                                       response_deserializer=engine_pb2.GenerateResponse.FromString)
            refusals = [await _status(raw(huge_generate(size))) for size in (64 * MIB, 200 * MIB)]
        during, validated = leases.renewals, limits.calls
        # the engine keeps serving, and keeps heartbeating on the same lease
        stream = await node.client.submit(make_request("ok", PROMPT, max_tokens=4, ignore_eos=True))
        tokens = [t async for chunk in stream for t in chunk.token_ids]
        await until(lambda: leases.renewals >= during + 3, 30, "heartbeats after the attack")
        return refusals, validated, limits.calls, tokens, (leases.grants, leases.expired, node.agent.registrations)

    refusals, validated, after, tokens, registration = serve(test)
    for code, details, _ in refusals:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in details  # gRPC core refused it: Python never saw the bytes
    assert validated == 0 and after > 0  # the attack never reached validation; the normal request did
    assert len(tokens) == 4
    assert registration == (1, 0, 1)  # one lease all along: no renewal came after it expired, no re-registration


def _over_limit(field: str) -> engine_pb2.GenerateRequest:
    req = make_request(f"bad-{field}", PROMPT, max_tokens=4)
    s = req.sampling
    if field == "stop":
        s.stop.extend(["x" * 1000] * 2000)  # the probe: 2,000 stop strings of 1,000 characters
    elif field == "stop_chars":
        s.stop.append("y" * 257)
    elif field == "stop_token_ids":
        s.stop_token_ids.extend([5] * 257)
    elif field == "logit_bias":
        s.logit_bias.update({i: 0.0 for i in range(301)})
    elif field == "guided_regex":
        s.structured.CopyFrom(engine_pb2.StructuredOutput(regex="a" * 1_000_001, field="guided_regex"))
    elif field == "prompt":
        req.prompt_token_ids.extend([1] * 200)  # past the tiny model's 160-token context
    return req


def test_over_limit_fields_are_refused_by_the_engine_naming_the_field_and_requests_at_the_bounds_pass():
    fields = ["stop", "stop_chars", "stop_token_ids", "logit_bias", "guided_regex", "prompt"]

    async def test(node: ServedEngine):
        limits = node.engine.limits = CountingLimits(node.engine.limits)
        async with grpc.aio.insecure_channel(node.info.address) as channel:  # straight to the engine
            raw = engine_pb2_grpc.EngineServiceStub(channel)
            refused, unparsed = {}, set()
            for f in fields:
                before = node.server.intake.refused
                refused[f] = await _status(raw.Generate(_over_limit(f)))
                if node.server.intake.refused > before:
                    unparsed.add(f)
            at = make_request("at-bounds", PROMPT, max_tokens=4, ignore_eos=True)
            at.sampling.stop.extend(["\U0001F600" * 256] * 16)  # 16 stop strings of 256 four-byte characters
            at.sampling.stop_token_ids.extend(range(63, 63 + 256))  # none of them in the vocabulary
            at.sampling.logit_bias.update({i: 0.0 for i in range(63)})  # every token of the tiny vocabulary
            call = raw.Generate(at)
            accepted = dict(await call.initial_metadata()).get(ACCEPTED_KEY)
            chunks = [c async for c in call]
        return refused, unparsed, accepted, chunks, limits.calls

    refused, unparsed, accepted, chunks, calls = serve(test)
    for f, (code, details, trailing) in refused.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (f, code, details)
        assert trailing[ERROR_PARAM_KEY] == {"stop_chars": "stop"}.get(f, f), (f, details)
    assert "stop sequences" in refused["stop"][1] and "at most 16" in refused["stop"][1]
    assert accepted == "1" and chunks[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    # counts past their bounds are refused before parsing (a walk over field headers), the rest by validation
    assert unparsed == {"stop", "logit_bias"} and calls == len(fields) - len(unparsed) + 2  # (+2: the one served)


def test_each_kind_is_bounded_by_its_own_size_before_parsing():
    """Below the channel-wide limit (the largest kind's bound: here TransferKV's 4 MiB pages) an Abort
    or a Generate over its own kind's bound is refused unparsed by the bounded deserializer, named and
    counted; a KV message over its bound ends its transfer unused."""
    async def test(node: ServedEngine):
        intake = node.server.intake
        bounds = intake.bounds
        assert bounds.of("Abort") == SMALL_MESSAGE_BYTES < bounds.generate < bounds.transfer_kv == bounds.largest
        async with grpc.aio.insecure_channel(node.info.address) as channel:
            abort = channel.unary_unary("/xllm.engine.v1.EngineService/Abort", request_serializer=lambda b: b,
                                        response_deserializer=engine_pb2.AbortResponse.FromString)
            big_abort = engine_pb2.AbortRequest(request_id="a" * SMALL_MESSAGE_BYTES).SerializeToString()
            try:
                await abort(big_abort)
                abort_refusal = None
            except grpc.aio.AioRpcError as exc:
                abort_refusal = exc.code(), exc.details()
            still = await abort(engine_pb2.AbortRequest(request_id="nobody").SerializeToString())
            raw = channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                                       response_deserializer=engine_pb2.GenerateResponse.FromString)
            generate_refusal = await _status(raw(huge_generate(bounds.generate + 1)))
        ack = await grpc_transport.receive(node.server.handoff, _one(Oversized("TransferKV", 10, 5)), intake)
        return abort_refusal, still, generate_refusal, ack, intake.refused

    abort_refusal, still, generate_refusal, ack, refused = serve(test)
    assert abort_refusal[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and abort_refusal[1].startswith("Abort: ")
    assert f"at most {SMALL_MESSAGE_BYTES}" in abort_refusal[1]
    assert not still.aborted  # the service answers the next call as ever
    assert generate_refusal[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert generate_refusal[1].startswith("Generate: ") and "larger than max" not in generate_refusal[1]
    assert not ack.installed and ack.error.startswith("TransferKV: ")
    assert refused == 3


async def _one(item):
    yield item


def test_the_bounds_cover_the_largest_valid_messages():
    """The worst-case valid request of each kind fits its bound (widest varints, four-byte characters,
    a choice constraint of one-character choices: the most bytes per counted character)."""
    bounds = RequestBounds(max_grammar_chars=3000)
    n = 4096
    worst = engine_pb2.GenerateRequest(
        request_id="r" * 200, prompt_token_ids=[2**31 - 1] * n, model="m" * 200, arrival_time=1.5,
        resumed_output_tokens=n - 1, resumed_sent_chars=2**32 - 1, priority=-(2**31), movable=True,
        kv_target=engine_pb2.KVTarget(transport="grpc", address="a" * 300, transfer_id="t" * 200,
                                      matched_tokens=2**32 - 1, layout="l" * 1000),
        sampling=engine_pb2.SamplingParams(
            max_tokens=2**32 - 1, temperature=1.0, top_p=1.0, top_k=2**31 - 1, seed=2**64 - 1,
            stop=["\U0001F600" * bounds.max_stop_chars] * bounds.max_stop,
            stop_token_ids=[-1] * bounds.max_stop_token_ids,
            logit_bias={-i - 1: -100.0 for i in range(bounds.max_logit_bias)},
            structured=engine_pb2.StructuredOutput(choice=engine_pb2.StringList(
                values=["\U0001F600"] * (bounds.max_grammar_chars // 5)), field="guided_choice")))
    assert worst.ByteSize() <= generate_message_bytes(n, bounds)
    assert generate_shape(worst.SerializeToString(), generate_allowance(n, bounds)) is None
    assert generate_message_bytes(n, bounds) < 4 * MIB  # ... and is not absurdly generous
    page_bytes = (3 * MIB, 5 * MIB)  # one page over KV_MESSAGE_BYTES is sent alone
    pages = engine_pb2.KVTransferMessage(pages=engine_pb2.KVPages(
        transfer_id="t" * 200, range=2**32 - 1, first_block=2**32 - 1, data=b"\0" * (5 * MIB), crc32=2**32 - 1))
    blocks = -(-n // 16)
    commit = engine_pb2.KVTransferMessage(commit=engine_pb2.KVCommit(
        transfer_id="t" * 200, num_tokens=n, first_block=0, num_blocks=blocks, first_token=2**31 - 1,
        layout="l" * 1000, block_crc32=[2**32 - 1] * blocks, store_hashes=[2**64 - 1] * blocks,
        appended_tokens=[2**31 - 1] * n, sent_chars=2**32 - 1, migration=engine_pb2.MIGRATION_STAGE_FINAL))
    for message in (pages, commit):
        assert message.ByteSize() <= kv_message_bytes(n, 16, page_bytes)
    assert kv_message_bytes(n, 16, (MIB,)) < KV_MESSAGE_BYTES + MIB


def test_a_generates_parts_are_held_to_their_own_allowances_before_parsing():
    """Within the message's bound, the walk over field headers refuses a part past its own allowance,
    naming the request field; each walk stops at what a valid request holds; bytes that are no message
    are left to the parser."""
    parts = generate_allowance(160)
    ok = make_request("r", PROMPT, max_tokens=4)

    def refusal(req: engine_pb2.GenerateRequest | bytes):
        found = generate_shape(req if isinstance(req, bytes) else req.SerializeToString(), parts)
        return found and (found.param, found.reason)

    assert refusal(ok) is None
    long_prompt = make_request("r", [1] * 2000, max_tokens=4)
    assert refusal(long_prompt)[0] == "prompt"
    huge_regex = make_request("r", PROMPT, max_tokens=4)
    huge_regex.sampling.structured.CopyFrom(engine_pb2.StructuredOutput(  # within the sampling allowance, over its own
        regex="\U0001F600" * 1_020_000, field="guided_regex"))
    assert refusal(huge_regex)[0] == "guided_regex"
    bias = make_request("r", PROMPT, max_tokens=4)
    bias.sampling.logit_bias.update({i: 1.0 for i in range(400)})
    assert refusal(bias)[0] == "logit_bias"
    long_stop = make_request("r", PROMPT, max_tokens=4, stop=["\U0001F600" * 300])
    assert refusal(long_stop)[0] == "stop"
    assert refusal(make_request("r", PROMPT, max_tokens=4, stop=["s"] * 17))[0] == "stop"
    unpacked = ok.SerializeToString() + b"\x10\x01" * 40  # prompt_token_ids one field per token
    assert refusal(unpacked) == (None, "the request has more than 32 fields")
    assert engine_pb2.GenerateRequest.FromString(unpacked).prompt_token_ids[-1] == 1  # (a valid encoding)
    assert refusal(ok.SerializeToString()[:-1]) is None  # truncated: the parser's to report


def test_images_are_bounded_by_the_context_a_multimodal_model_can_hold():
    """A text model's request has no room for images (each held to the fixed allowance); a multimodal model's
    images take what ``max_model_len`` image tokens need (several images together, one as large as the context),
    no more: an image of more pixel bytes than the context's tokens can hold is refused before parsing, naming
    ``images``."""
    n, per_token = 160, 4 * 1176 * 4  # Qwen2-VL: 4 patch rows of 1,176 floats behind each image token

    def image(tokens: int) -> engine_pb2.ImageInput:
        return engine_pb2.ImageInput(pixel_values=b"\0" * (tokens * per_token), grid_thw=[1, 2, 2 * tokens],
                                     content_hash=b"h" * 32)

    def refusal(images: list, token_bytes: int):
        req = make_request("r", PROMPT, max_tokens=4)
        req.images.extend(images)
        found = generate_shape(req.SerializeToString(), generate_allowance(n, image_token_bytes=token_bytes))
        return found and found.param

    assert refusal([image(8)], 0) == "images"  # a text model (the engine would refuse it: no images here)
    assert refusal([image(8)] * 10, per_token) is None
    assert refusal([image(n)], per_token) is None
    assert refusal([image(2 * n)], per_token) == "images"
    parts = generate_allowance(n, image_token_bytes=per_token)
    assert parts.total - generate_allowance(n).total == parts.images < n * (per_token + 256) + MIB


def test_the_served_engines_bounds_follow_its_configuration():
    engine = make_engine(kv_cache_backend="paged", block_size=16, kv_cache_memory_gib=0.01)
    try:
        store = engine.kv.page_store()
        default = message_bounds(engine.limits, store.page_bytes)
        smaller = message_bounds(dataclasses.replace(engine.limits, bounds=RequestBounds(max_grammar_chars=1000)),
                                 store.page_bytes)
        without_kv = message_bounds(engine.limits)
    finally:
        engine.close()
    assert default.generate == generate_message_bytes(engine.max_model_len) > smaller.generate
    assert default.largest == max(default.generate, default.transfer_kv) and smaller.largest == smaller.transfer_kv
    assert without_kv.transfer_kv == SMALL_MESSAGE_BYTES
    assert dict(default.server_options())["grpc.max_receive_message_length"] == default.largest


class RefusingSink:
    """A decode side awaiting no transfer, bounded like an engine: what an fd receiver asks of it."""

    def __init__(self, message_bytes: int) -> None:
        self.message_bytes = message_bytes
        self.begun: list[str] = []

    def begin_receive(self, transfer_id: str, transport: str):
        self.begun.append(transfer_id)
        raise TransferError(f"{transfer_id}: nothing awaits this transfer")


def test_the_fd_handoff_socket_refuses_a_message_past_the_intake_bound_unread():
    """The fd transport's socket holds a message to the ``TransferKV`` bound of the gRPC intake (the engine's
    hand-off manager reports it): a length prefix past it gets a failed ack at once, the 64 MiB body never
    sent nor read, and the connection is closed; a message within it is parsed and answered."""
    engine = make_engine(kv_cache_backend="paged", block_size=16, kv_cache_memory_gib=0.01)
    try:
        manager = HandoffManager(AsyncEngine(engine), HandoffOptions(transport="fd"), lambda _c, _n: None)
        bound = manager.message_bytes
        assert bound == message_bounds(engine.limits, engine.kv.page_store().page_bytes).transfer_kv
    finally:
        engine.close()

    def ack(conn: socket.socket) -> engine_pb2.KVTransferAck:
        (size,) = struct.unpack("!I", conn.recv(4, socket.MSG_WAITALL))
        return engine_pb2.KVTransferAck.FromString(conn.recv(size, socket.MSG_WAITALL))

    async def main():
        receiver, sink = FdReceiver({}), RefusingSink(bound)
        await receiver.start(sink)
        memfd = os.memfd_create("xllm-test")
        os.ftruncate(memfd, 4096)  # the sender's pages, mapped by the receiver
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(10)
                conn.connect("\0" + receiver.address[1:])
                socket.send_fds(conn, [b"XKV1"], [memfd])
                within = engine_pb2.KVFdHandoff(commit=engine_pb2.KVCommit(transfer_id="t1")).SerializeToString()
                conn.sendall(struct.pack("!I", len(within)) + within)
                first = await asyncio.to_thread(ack, conn)
                conn.sendall(struct.pack("!I", 64 * MIB))  # the header only: the answer cannot wait for a body
                refused = await asyncio.to_thread(ack, conn)
                closed = await asyncio.to_thread(conn.recv, 1)
            return first, refused, closed, sink.begun
        finally:
            os.close(memfd)
            await receiver.stop()

    first, refused, closed, begun = asyncio.run(main())
    assert not first.installed and "nothing awaits" in first.error and begun == ["t1"]
    assert not refused.installed and f"{64 * MIB}-byte" in refused.error and f"bound of {bound} bytes" in refused.error
    assert closed == b"" and begun == ["t1"]  # closed, and the oversized message never reached the sink


@pytest.mark.parametrize("payload", [1, 3 * 1024])
def test_kv_pages_are_sent_in_bounded_messages_and_still_install(monkeypatch, payload):
    """With KV messages of one block (and of three) the hand-off installs the KV as one message per range
    did: the decode side checks that each range's messages tile its blocks."""
    monkeypatch.setattr(grpc_transport, "KV_MESSAGE_BYTES", payload)
    model = TinyLM()
    prompt = tiny_tokenizer().encode_pieces(list("the quick brown fox jumps over the lazy dog, twice over " * 2))
    mixed = generate(make_engine(model), [make_request("r", prompt, max_tokens=8, ignore_eos=True)])
    sent: list[int] = []
    real = grpc_transport.TransferChannels.transfer

    async def counting(self, address, messages, timeout):
        async def seen():
            async for m in messages:
                sent.append(len(m.pages.data) if m.HasField("pages") else -1)
                yield m

        return await real(self, address, seen(), timeout)

    monkeypatch.setattr(grpc_transport.TransferChannels, "transfer", counting)

    async def main():
        nodes = []
        for name in ("p", "d"):
            engine = make_engine(model)
            engine.instance_id = name
            nodes.append(await ServedEngine(engine, handoff=HandoffOptions(transport="grpc")).start())
        try:
            got, _, stats = await pd_generate(*nodes, "r", prompt, max_tokens=8, ignore_eos=True)
            return got, stats, nodes[0].engine.kv.page_store().page_bytes
        finally:
            for node in nodes:
                await node.stop()

    got, stats, page_bytes = asyncio.run(main())
    assert stats is not None and not stats.recomputed, stats
    assert got.tokens["r"] == mixed.tokens["r"]
    per = max(1, payload // max(page_bytes))
    assert max(sent) <= per * max(page_bytes) and sent[-1] == -1
    assert len(sent) - 1 > len(page_bytes)  # more messages than ranges: the pages were split

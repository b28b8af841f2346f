"""Bounded intake of the engine service: no message larger than its kind can need is parsed.

Every ``EngineService`` call kind has a size bound derived from the engine's configured limits
(:class:`MessageBounds`, :func:`message_bounds`):

- ``Generate``: what a valid request can need (:func:`xllm.engine_api.bounds.generate_message_bytes`:
  ``max_model_len`` prompt tokens plus the largest stop strings, stop ids, ``logit_bias`` and output
  constraint the request bounds allow; with a multimodal model, the images of ``max_model_len`` image
  tokens);
- ``TransferKV``: one KV hand-off message (:func:`xllm.engine_api.bounds.kv_message_bytes`: a
  ``KVPages`` of at most :data:`~xllm.engine_api.bounds.KV_MESSAGE_BYTES`, or a commit naming every
  block of the context), by the engine's KV page sizes;
- ``Encode``: the images of ``max_model_len`` image tokens (a text model: small messages only);
- everything else (``Abort``, ``Migrate``, ``Health``, ``GetLoad``, ``GetKVEvents``, ``Prove`` ...):
  :data:`SMALL_MESSAGE_BYTES`.

Three layers enforce them, cheapest first. gRPC core refuses a message over the largest bound
(``grpc.max_receive_message_length``, :meth:`MessageBounds.server_options`) with
``RESOURCE_EXHAUSTED`` before Python sees a byte of it; below that, the request deserializer compares
the message's length with its kind's bound before parsing (:meth:`Intake.register`), and for a
``Generate`` walks the wire format's field headers (:func:`generate_shape`: a few hundred fields at
most, no parsing) to hold each part to its own allowance (the prompt to ``max_model_len`` tokens, a
stop string to its characters, the counts of stop strings and ``logit_bias`` entries to theirs).
A message past any of them becomes an :class:`Oversized` marker instead of a message: a unary call
is then refused before its servicer runs, with ``RESOURCE_EXHAUSTED`` naming the limit (or, for one
part past its allowance, ``INVALID_ARGUMENT`` naming the request field, as validation would), and a
streaming request (``TransferKV``) hands the marker to its servicer, which ends the transfer. Per-field limits
follow in request validation (:mod:`xllm.core.validation`), also cheapest first.

Why sizes and shapes, not a worker thread: protobuf's parser (upb) holds the GIL, so a big message
parsed anywhere stalls the event loop (heartbeats) and the engine's step loop alike; what a message
may hold must be bounded before it is parsed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf import message_factory

from xllm.core.validation import RequestLimits
from xllm.engine_api.bounds import GenerateAllowance, generate_allowance, kv_message_bytes
from xllm.engine_api.errors import InvalidRequestError
from xllm.engine_api.wire import status_for
from xllm.proto.engine.v1 import engine_pb2

log = logging.getLogger(__name__)

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
SMALL_MESSAGE_BYTES = 64 << 10  # ids, a KV target, a nonce: every request kind but Generate and TransferKV
MAX_SEND_BYTES = 256 << 20      # responses (a beam request's hypotheses, prompt logprobs); not a peer's input


@dataclass(frozen=True)
class Oversized:
    """What the deserializer yields instead of a message past its kind's bounds (never parsed):
    ``reason`` names the part and the limit; ``param``, the request field past its bound (refused as
    an invalid request naming it), or None for the message as a whole (``RESOURCE_EXHAUSTED``)."""

    method: str
    reason: str
    param: str | None = None

    @property
    def details(self) -> str:
        return (f"{self.method}: {self.reason} (a bound of this engine's configured limits: context length, "
                "request bounds, KV page sizes)")


@dataclass(frozen=True)
class MessageBounds:
    """The largest request message of each call kind (bytes), and the parts of a ``Generate``
    (``generate_parts``); see the module docstring."""

    generate: int
    transfer_kv: int
    other: int = SMALL_MESSAGE_BYTES
    generate_parts: GenerateAllowance | None = None
    encode: int = SMALL_MESSAGE_BYTES

    def of(self, method: str) -> int:
        """The bound of ``method`` (a method name of ``EngineService``)."""
        return {"Generate": self.generate, "Embed": self.generate, "TransferKV": self.transfer_kv,
                "Encode": self.encode}.get(method, self.other)

    @property
    def largest(self) -> int:
        return max(self.generate, self.transfer_kv, self.other)

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC server options: the channel-wide receive limit (the largest kind), the send limit."""
        return [("grpc.max_receive_message_length", self.largest), ("grpc.max_send_message_length", MAX_SEND_BYTES)]


def message_bounds(limits: RequestLimits, page_bytes: tuple[int, ...] | list[int] = ()) -> MessageBounds:
    """The bounds of an engine with these request ``limits`` and KV ``page_bytes`` (per range; empty
    when it cannot receive KV, whose ``TransferKV`` then takes small messages only)."""
    kv = kv_message_bytes(limits.max_model_len, limits.layout.block_size, page_bytes) if page_bytes \
        else SMALL_MESSAGE_BYTES
    parts = generate_allowance(limits.max_model_len, limits.bounds, limits.image_token_bytes)
    return MessageBounds(generate=parts.total, transfer_kv=kv, generate_parts=parts,
                         encode=parts.images or SMALL_MESSAGE_BYTES)


# ---- the wire format's field headers (https://protobuf.dev/programming-guides/encoding/) -------------------
_NAMES = {m.name: {f.number: f.name for f in m.fields} for m in (
    engine_pb2.GenerateRequest.DESCRIPTOR, engine_pb2.SamplingParams.DESCRIPTOR,
    engine_pb2.StructuredOutput.DESCRIPTOR)}
_FIXED_WIDTH = {1: 8, 5: 4}  # wire types I64, I32
_API_NAME = {"prompt_token_ids": "prompt"}  # the request field an error names, where the proto's differs
_STOP = engine_pb2.SamplingParams.DESCRIPTOR.fields_by_name["stop"].number
_LOGIT_BIAS = engine_pb2.SamplingParams.DESCRIPTOR.fields_by_name["logit_bias"].number
_CONSTRAINT_FIELD = engine_pb2.StructuredOutput.DESCRIPTOR.fields_by_name["field"].number


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: bytes, start: int, end: int, cap: int) -> tuple[list[tuple[int, int, int]], bool]:
    """``(field number, payload start, payload end)`` of the fields of the message ``buf[start:end]``
    (a varint's payload is the varint), at most ``cap`` of them, and whether that was all. Raises
    ``ValueError`` or ``IndexError`` for bytes that are no message (the parser then reports them)."""
    out = []
    i = start
    while i < end:
        if len(out) == cap:
            return out, False
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            j = _varint(buf, i)[1]
        elif wire == 2:
            n, i = _varint(buf, i)
            j = i + n
        elif wire in _FIXED_WIDTH:
            j = i + _FIXED_WIDTH[wire]
        else:
            raise ValueError(f"wire type {wire}")
        if j > end:
            raise ValueError("truncated")
        out.append((key >> 3, i, j))
        i = j
    return out, True


@dataclass(frozen=True)
class Refusal:
    """Why a message cannot be a valid request, and the request field to name (None: the message)."""

    reason: str
    param: str | None = None


def generate_shape(raw: bytes, parts: GenerateAllowance) -> Refusal | None:
    """Why the serialized ``GenerateRequest`` ``raw`` cannot be a valid request (None when its parts
    fit ``parts``): one pass over its field headers, its sampling parameters' and its constraint's,
    each walk capped at what a valid request has (a few hundred fields), so the work is bounded
    however the bytes are arranged. Repeated numbers count as packed, as every
    protobuf library writes them (an unpacked prompt reads as too many fields)."""
    try:
        top, complete = _fields(raw, 0, len(raw), 32)
        if not complete:
            return Refusal("the request has more than 32 fields")
        names = _NAMES["GenerateRequest"]
        for number, start, end in top:
            name = names.get(number, f"field {number}")
            limit = {"prompt_token_ids": parts.prompt, "sampling": parts.sampling,
                     "images": parts.images or parts.fixed}.get(name, parts.fixed)
            if end - start > limit:
                return Refusal(f"{_API_NAME.get(name, name)}: {end - start} bytes; at most {limit}",
                               _API_NAME.get(name, name))
            if name == "sampling":
                refusal = _sampling_shape(raw, start, end, parts)
                if refusal is not None:
                    return refusal
    except (ValueError, IndexError):
        return None  # not a message at all: the parser says so
    return None


def _sampling_shape(raw: bytes, start: int, end: int, parts: GenerateAllowance) -> Refusal | None:
    inner, complete = _fields(raw, start, end, parts.max_stop + parts.max_logit_bias + 64)
    for number, most, what in ((_STOP, parts.max_stop, "stop sequences"),
                               (_LOGIT_BIAS, parts.max_logit_bias, "logit_bias entries")):
        count = sum(1 for n, _, _ in inner if n == number)
        if count > most:
            name = _NAMES["SamplingParams"][number]
            return Refusal(f"{name}: {'' if complete else 'at least '}{count} {what}; this engine accepts at "
                           f"most {most}", name)
    if not complete:
        return Refusal("sampling: too many fields", "sampling")
    limits = {"stop": parts.stop, "stop_token_ids": parts.stop_token_ids, "logit_bias": parts.logit_bias_entry,
              "structured": parts.constraint}
    for n, a, b in inner:
        name = _NAMES["SamplingParams"].get(n, f"field {n}")
        limit = limits.get(name, parts.fixed)
        param = _constraint_name(raw, a, b) if name == "structured" else name
        if b - a > limit:
            return Refusal(f"{param}: {b - a} bytes; at most {limit}", param)
        if name == "structured" and not _fields(raw, a, b, 8)[1]:
            return Refusal(f"{param}: too many fields", param)
    # (a choice constraint's strings are not walked here: the parser reads them faster than Python walks their
    # headers, and the count is the first check after it)
    return None


def _constraint_name(raw: bytes, start: int, end: int) -> str:
    """The API field a serialized ``StructuredOutput`` came from ("structured" if it names none)."""
    for n, a, b in _fields(raw, start, end, 8)[0]:
        if n == _CONSTRAINT_FIELD:
            return raw[a:b].decode("utf-8", "replace")[:64] or "structured"
    return "structured"


class Intake:
    """Counts and logs the refusals of oversized messages (the first, then every 100th)."""

    def __init__(self, bounds: MessageBounds) -> None:
        self.bounds = bounds
        self.refused = 0

    def note(self, oversized: Oversized) -> None:
        self.refused += 1
        if self.refused % 100 == 1:
            log.warning("refused %s (%d oversized messages refused so far)", oversized.details, self.refused)

    async def refuse(self, oversized: Oversized, context: grpc.aio.ServicerContext) -> None:
        self.note(oversized)
        if oversized.param is not None:  # a field past its bound: what validation would answer, earlier
            status = status_for(InvalidRequestError(oversized.details, oversized.param))
            await context.abort(status.code, status.details, status.trailing)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, oversized.details)

    def _deserializer(self, method: str, parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
        limit = self.bounds.of(method)
        parts = self.bounds.generate_parts if method == "Generate" else None

        def deserialize(raw: bytes) -> object:
            if len(raw) > limit:  # before any parsing: a length, not a pass over the bytes
                return Oversized(method, f"the message has {len(raw)} bytes; at most {limit}")
            if parts is not None and (refusal := generate_shape(raw, parts)) is not None:
                return Oversized(method, refusal.reason, refusal.param)
            return parse(raw)

        return deserialize

    def _unary_unary(self, behavior):
        async def guarded(request, context):
            if isinstance(request, Oversized):
                await self.refuse(request, context)
            return await behavior(request, context)

        return guarded

    def _unary_stream(self, behavior):
        async def guarded(request, context) -> AsyncIterator:
            if isinstance(request, Oversized):
                await self.refuse(request, context)
            async with contextlib.aclosing(behavior(request, context)) as items:  # its cleanup runs at once
                async for item in items:
                    yield item

        return guarded

    def register(self, servicer: object, server: grpc.aio.Server) -> None:
        """Add ``servicer``'s ``EngineService`` methods to ``server`` (in place of the generated
        ``add_EngineServiceServicer_to_server``), every request deserializer bounded. A method
        with a streaming request gets :class:`Oversized` markers among its messages and must
        handle them (``TransferKV``: :func:`xllm.engine.handoff.grpc.receive`)."""
        handlers = {}
        for m in SERVICE.methods:
            behavior = getattr(servicer, m.name)
            deserialize = self._deserializer(m.name, message_factory.GetMessageClass(m.input_type).FromString)
            serialize = message_factory.GetMessageClass(m.output_type).SerializeToString
            if m.client_streaming:
                make = grpc.stream_stream_rpc_method_handler if m.server_streaming \
                    else grpc.stream_unary_rpc_method_handler
            elif m.server_streaming:
                make, behavior = grpc.unary_stream_rpc_method_handler, self._unary_stream(behavior)
            else:
                make, behavior = grpc.unary_unary_rpc_method_handler, self._unary_unary(behavior)
            handlers[m.name] = make(behavior, request_deserializer=deserialize, response_serializer=serialize)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
        server.add_registered_method_handlers(SERVICE.full_name, handlers)

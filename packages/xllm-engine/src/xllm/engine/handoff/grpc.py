"""The ``grpc`` transport: KV streamed over the engines' gRPC service (between hosts).

The prefill instance opens the decode instance's ``TransferKV`` when the forward that completes the
prompt starts, and sends one :class:`KVPages` per (layer, K|V) range — that range's page of every
block the decode side lacks, with a CRC-32 — as soon as the forward stored the layer, so the
transfer overlaps the rest of the prefill; the :class:`KVCommit` (first token, sampler state)
follows the sampling. The decode side checks and writes each message into its reservation as it
arrives; a corrupted or missing range makes it recompute the prompt instead of installing the KV.
The same call carries the commit of the Mooncake transport, whose blocks are fetched from the
store (``fetch``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc

from xllm.core.kv.page_store import PageStore
from xllm.engine.handoff.base import (
    Destination,
    HandoffSink,
    KVSender,
    Outgoing,
    TransferError,
    TransferResult,
    Transport,
    crc32,
    write_checked,
    write_pages_checked,
)
from xllm.engine.security import NO_SECURITY, ClusterSecurity, open_channel
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc

MAX_MESSAGE = 256 << 20  # a block of a large model is several MiB
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


class TransferChannels:
    """gRPC channels to decode instances, by address (opened in the caller's event loop, with the
    cluster token and TLS of ``security``: the ``"security"`` entry of a sender's options, which
    :class:`~xllm.engine.server.EngineServer` sets)."""

    def __init__(self, security: ClusterSecurity | None = None) -> None:
        self.security = security or NO_SECURITY
        self._stubs: dict[str, tuple[grpc.aio.Channel, engine_pb2_grpc.EngineServiceStub]] = {}

    def stub(self, address: str) -> engine_pb2_grpc.EngineServiceStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = open_channel(address, self.security, CHANNEL_OPTIONS)
            entry = self._stubs[address] = (channel, engine_pb2_grpc.EngineServiceStub(channel))
        return entry[1]

    async def transfer(self, address: str, messages: AsyncIterator[engine_pb2.KVTransferMessage],
                       timeout: float) -> engine_pb2.KVTransferAck:
        try:
            return await self.stub(address).TransferKV(messages, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise TransferError(f"TransferKV to {address}: {exc.code().name} {exc.details()}") from None

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


class GrpcSender(KVSender):
    name = "grpc"
    streams_layers = True

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self.channels = TransferChannels(options.get("security"))

    async def send(self, target: engine_pb2.KVTarget, store: PageStore, out: Outgoing) -> TransferResult:
        sent = 0

        async def messages() -> AsyncIterator[engine_pb2.KVTransferMessage]:
            nonlocal sent
            async for layer in out.layers():
                for r in store.ranges_of_layer(layer):
                    data = store.read_pages(r, out.pages)
                    sent += len(data)
                    yield engine_pb2.KVTransferMessage(pages=engine_pb2.KVPages(
                        transfer_id=out.transfer_id, range=r, first_block=out.first_block, data=data,
                        crc32=crc32(data)))
            yield engine_pb2.KVTransferMessage(commit=await out.commit())

        ack = await self.channels.transfer(target.address, messages(), float(self.options.get("timeout", 30.0)))
        return TransferResult(ack.installed, sent if ack.installed else 0, ack.error)

    async def close(self) -> None:
        await self.channels.close()


async def receive(sink: HandoffSink, messages: AsyncIterator[engine_pb2.KVTransferMessage],
                  fetch: Callable[[list[str]], list[bytes]] | None = None) -> engine_pb2.KVTransferAck:
    """Decode side of ``TransferKV``: write the streamed pages (or, for a commit naming store keys,
    the blocks ``fetch`` returns) into the reservation, then install or recompute."""
    dest, error, received, started = None, "", 0, time.monotonic()
    ranges_seen: list[tuple[int, int, int]] = []  # (range, first block, blocks)
    try:
        async for message in messages:
            if message.HasField("pages"):
                pages = message.pages
                if dest is None:
                    started = time.monotonic()
                    dest = sink.begin_receive(pages.transfer_id, "grpc")
                if not error:
                    try:
                        n = write_pages_checked(dest, pages.range, pages.first_block, pages.data, pages.crc32)
                        received += n
                        ranges_seen.append((pages.range, pages.first_block, n // dest.store.page_bytes[pages.range]))
                    except TransferError as exc:
                        error = str(exc)  # keep reading: the commit still lets the decode side recompute
                continue
            commit = message.commit
            committed = time.monotonic()
            if dest is None:
                started = committed
                dest = sink.begin_receive(commit.transfer_id, "mooncake" if commit.store_keys else "grpc")
            if not error and commit.store_keys:
                received, error = await _fetch_blocks(dest, commit, fetch)
            elif not error:
                error = _missing(dest, commit, ranges_seen)
            installed = await sink.end_receive(commit, received, error, started, committed - started)
            return engine_pb2.KVTransferAck(installed=installed, error=error)
    except TransferError as exc:
        return engine_pb2.KVTransferAck(installed=False, error=str(exc))
    if dest is not None:  # the stream broke off before the commit
        sink.cancel_receive(dest.transfer_id)
    return engine_pb2.KVTransferAck(installed=False, error="the transfer ended without its commit")


def _missing(dest: Destination, commit: engine_pb2.KVCommit, ranges_seen: list[tuple[int, int, int]]) -> str:
    """What the commit covers but the pages received do not ("" when complete)."""
    expected = [(r, commit.first_block, commit.num_blocks) for r in range(len(dest.store.page_bytes))]
    if commit.num_blocks == 0 or sorted(ranges_seen) == expected:
        return ""
    return (f"{commit.transfer_id}: received {len(ranges_seen)} page ranges, expected blocks "
            f"{commit.first_block}..{commit.first_block + commit.num_blocks - 1} of {len(expected)} ranges")


async def _fetch_blocks(dest: Destination, commit: engine_pb2.KVCommit, fetch) -> tuple[int, str]:
    """Mooncake: every block the commit names, from the store. Returns the bytes written and the error."""
    if fetch is None:
        return 0, "this instance has no KV store to fetch the blocks from"
    if len(commit.store_keys) != commit.num_blocks or len(commit.block_crc32) != commit.num_blocks:
        return 0, (f"{commit.transfer_id}: the commit names {len(commit.store_keys)} keys and "
                   f"{len(commit.block_crc32)} checksums for {commit.num_blocks} blocks")
    received = 0
    try:
        blocks = await asyncio.to_thread(fetch, list(commit.store_keys))  # one batch
        for i, (data, check) in enumerate(zip(blocks, commit.block_crc32)):
            received += write_checked(dest, commit.first_block + i, data, check)
    except (TransferError, OSError, KeyError) as exc:
        return received, str(exc)
    return received, ""


TRANSPORT = Transport("grpc", GrpcSender)

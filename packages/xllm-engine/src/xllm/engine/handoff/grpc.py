"""The ``grpc`` transport: KV streamed over the engines' gRPC service (between hosts).

The prefill instance opens the decode instance's ``TransferKV`` when the forward that completes the
prompt starts, and sends the :class:`KVPages` of each (layer, K|V) range — that range's page of every
block the decode side lacks, in messages of at most :data:`~xllm.engine_api.bounds.KV_MESSAGE_BYTES`
(one page at least) each with its CRC-32 — as soon as the forward stored the layer, so the
transfer overlaps the rest of the prefill; the :class:`KVCommit` (first token, sampler state)
follows the sampling. The decode side checks and writes each message into its reservation as it
arrives; a corrupted or missing range makes it recompute the prompt instead of installing the KV.
The same call carries the store path's hand-offs (``xllm.engine.handoff.mooncake``): a commit naming
``store_hashes`` has those blocks read from the decode side's KV tiers (the cluster store) and the
rest as pages; when the store cannot deliver them all, the answer asks the sender to send them again
as pages (``resend``) and the reservation waits for that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator

import grpc

from xllm.core.kv.page_store import PageAccess
from xllm.engine.handoff.base import (
    Destination,
    HandoffSink,
    KVSender,
    Outgoing,
    TransferError,
    TransferResult,
    Transport,
    crc32,
    write_pages_checked,
)
from xllm.engine.intake import Intake, Oversized
from xllm.engine_api.bounds import KV_MESSAGE_BYTES
from xllm.engine_api.security import NO_SECURITY, ClusterSecurity, open_channel
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE = 256 << 20  # what a sender may send: a KVPages holds at most KV_MESSAGE_BYTES or one page (several MiB)
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


def page_messages(store: PageAccess, transfer_id: str, pages: tuple[int, ...], first_block: int,
                  ranges: list[int] | None = None) -> Iterator[engine_pb2.KVTransferMessage]:
    """The :class:`KVPages` of each range (``ranges``, default all): its page of each of ``pages``, the
    blocks ``first_block ..``, in messages of at most :data:`KV_MESSAGE_BYTES` (one page at least; one
    empty message for a range without pages), each with its CRC-32."""
    for r in range(len(store.page_bytes)) if ranges is None else ranges:
        per = max(1, KV_MESSAGE_BYTES // store.page_bytes[r])
        for i in range(0, max(len(pages), 1), per):
            data = store.read_pages(r, pages[i:i + per])
            yield engine_pb2.KVTransferMessage(pages=engine_pb2.KVPages(
                transfer_id=transfer_id, range=r, first_block=first_block + i, data=data, crc32=crc32(data)))


class GrpcSender(KVSender):
    name = "grpc"
    streams_layers = True

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self.channels = TransferChannels(options.get("security"))

    async def send(self, target: engine_pb2.KVTarget, store: PageAccess, out: Outgoing) -> TransferResult:
        sent = 0

        async def messages() -> AsyncIterator[engine_pb2.KVTransferMessage]:
            nonlocal sent
            async for layer in out.layers():
                for message in page_messages(store, out.transfer_id, out.pages, out.first_block,
                                             store.ranges_of_layer(layer)):
                    sent += len(message.pages.data)
                    yield message
            yield engine_pb2.KVTransferMessage(commit=await out.commit())

        ack = await self.channels.transfer(target.address, messages(), float(self.options.get("timeout", 30.0)))
        return TransferResult(ack.installed, sent if ack.installed else 0, ack.error)

    async def close(self) -> None:
        await self.channels.close()


async def receive(sink: HandoffSink, messages: AsyncIterator[engine_pb2.KVTransferMessage | Oversized],
                  intake: Intake | None = None) -> engine_pb2.KVTransferAck:
    """Decode side of ``TransferKV``: write the streamed pages (and, for a commit naming store hashes,
    the blocks read from the store) into the reservation, then install or recompute. A message over
    the service's bound (an :class:`Oversized` marker, never parsed: :mod:`xllm.engine.intake`) ends
    the transfer unused, counted by ``intake``."""
    dest, error, received, started = None, "", 0, time.monotonic()
    ranges_seen: list[tuple[int, int, int]] = []  # (range, first block, blocks)
    try:
        async for message in messages:
            if isinstance(message, Oversized):
                if intake is not None:
                    intake.note(message)
                error = message.details
                break
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
                dest = sink.begin_receive(commit.transfer_id, "mooncake" if commit.store_hashes else "grpc")
            from_store = len(commit.store_hashes)
            if not error and from_store:
                got, error = await _read_store_blocks(sink, dest, commit)
                if not error and got < from_store:  # the store lost some: the sender sends them as pages
                    sink.cancel_receive(dest.transfer_id)
                    return engine_pb2.KVTransferAck(
                        installed=False, resend=True,
                        error=f"{commit.transfer_id}: {got} of {from_store} blocks read from the KV store")
                received += from_store * dest.store.block_bytes
            if not error:
                error = _missing(dest, commit, ranges_seen, from_store)
            installed = await sink.end_receive(commit, received, error, started, committed - started,
                                               store_blocks=from_store if not error else 0)
            return engine_pb2.KVTransferAck(installed=installed, error=error)
    except TransferError as exc:
        return engine_pb2.KVTransferAck(installed=False, error=str(exc))
    if dest is not None:  # the stream broke off before the commit
        sink.cancel_receive(dest.transfer_id)
    return engine_pb2.KVTransferAck(installed=False, error=error or "the transfer ended without its commit")


def _missing(dest: Destination, commit: engine_pb2.KVCommit, ranges_seen: list[tuple[int, int, int]],
             from_store: int = 0) -> str:
    """What the commit covers but the pages received (after the ``from_store`` blocks read from the
    store) do not ("" when complete): every range's messages must tile the paged blocks exactly."""
    paged = commit.num_blocks - from_store
    start = commit.first_block + from_store
    expected = {r: start + paged for r in range(len(dest.store.page_bytes))} if paged else {}
    covered: dict[int, int] = {}  # range -> the block after the last one received in order
    tiled = True
    for r, first, n in sorted(ranges_seen):
        if n == 0:  # a range without pages
            continue
        tiled &= covered.get(r, start) == first
        covered[r] = first + n
    if tiled and covered == expected:
        return ""
    return (f"{commit.transfer_id}: received {len(ranges_seen)} page messages, expected blocks {start}.."
            f"{start + paged - 1} of {len(dest.store.page_bytes)} ranges")


async def _read_store_blocks(sink: HandoffSink, dest: Destination, commit: engine_pb2.KVCommit) -> tuple[int, str]:
    """The store path: the blocks ``commit.store_hashes`` names, from the decode side's KV tiers into the
    reservation (checked there: hash, namespace, checksum). Returns how many leading blocks arrived intact,
    and an error for a commit that names blocks this reservation does not receive."""
    first, n = commit.first_block, len(commit.store_hashes)
    if n > commit.num_blocks or first < dest.first_block or first + commit.num_blocks > len(dest.pages):
        return 0, (f"{commit.transfer_id}: the commit names blocks {first}..{first + commit.num_blocks - 1} "
                   f"({n} from the store); this reservation receives {dest.first_block}..{len(dest.pages) - 1}")
    try:
        return await asyncio.to_thread(sink.fetch_from_store, list(commit.store_hashes),
                                       dest.pages[first:first + n]), ""
    except Exception:  # a tier's bug: the blocks come again as pages
        log.exception("%s: reading blocks from the KV store failed", commit.transfer_id)
        return 0, ""


TRANSPORT = Transport("grpc", GrpcSender)

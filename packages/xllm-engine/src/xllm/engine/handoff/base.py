"""The contract of a KV transport, and the checks every byte transport shares.

A transport moves the prompt KV of one request from a prefill instance (:class:`KVSender`) into the
pages a decode instance reserved for it, then delivers the :class:`KVCommit` (first token, sampler
state). What to send is an :class:`Outgoing`: the blocks, the layers whose KV is final so far (a
transport that ``streams_layers`` starts while the prefill forward still runs), and the commit
once the first token is sampled. The decode side's :class:`HandoffSink` (the
:class:`~xllm.engine.handoff.manager.HandoffManager`) names the pages to fill and installs the KV
once they hold it; a transport that cannot deliver intact KV says so, and the decode instance
recomputes the prompt instead.
"""

from __future__ import annotations

import asyncio
import zlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from xllm.core.kv.page_store import PageAccess
from xllm.proto.engine.v1 import engine_pb2


@dataclass
class HandoffOptions:
    transport: str = "fd"               # how this instance receives KV (what its reservations name)
    handoff_timeout: float = 30.0       # prefill side: longest wait for the decode side's answer
    reservation_timeout: float = 60.0   # decode side: longest wait for a reservation's KV
    transport_options: dict = field(default_factory=dict)  # e.g. Mooncake's master and metadata server


TIERS_OPTION = "kv_tiers"  # a sender's options entry: the engine's LowerTiers (HandoffManager sets it)


class TransferError(RuntimeError):
    """A hand-off could not deliver intact KV (unreachable, corrupted, incompatible layout)."""


@dataclass(frozen=True)
class TransferResult:
    """What a sender learnt: whether the decode side installed the KV, and the bytes moved. The store path:
    how many blocks went through the cluster store, and whether blocks meant for it went as pages instead
    (``fallback``: the store was unavailable, or the decode side could not read them there)."""

    installed: bool
    bytes: int
    error: str = ""
    store_blocks: int = 0
    fallback: bool = False


@dataclass(frozen=True)
class Destination:
    """Decode side: where one reservation's blocks go."""

    transfer_id: str
    store: PageAccess
    pages: tuple[int, ...]  # the reserved page of every prompt block
    first_block: int        # blocks before it were in the local prefix cache: not received


class HandoffSink(Protocol):
    """The decode side's part in a transfer (called on the server's event loop)."""

    @property
    def message_bytes(self) -> int:
        """The largest hand-off message this side takes (a receiver refuses a larger one before reading it)."""
        ...

    def begin_receive(self, transfer_id: str, transport: str) -> Destination:
        """The pages to write; :class:`TransferError` if nothing awaits this transfer (expired,
        abandoned, unknown). Until :meth:`end_receive` the pages stay reserved."""
        ...

    async def end_receive(self, commit: engine_pb2.KVCommit, received_bytes: int, error: str = "",
                          started: float | None = None, overlapped: float = 0.0, store_blocks: int = 0) -> bool:
        """The blocks are written (``error`` empty) or were not: install the KV, or recompute.
        ``started``: ``time.monotonic()`` when the transfer's first byte arrived; ``overlapped``: the
        seconds of it before the commit arrived (sent while the prefill ran); ``store_blocks``: of the
        blocks, how many were read from the cluster store. Returns whether the received KV was installed."""
        ...

    def fetch_from_store(self, hashes: list[int], pages: tuple[int, ...]) -> int:
        """Blocking (call from a thread): read blocks ``hashes`` from this instance's KV tiers into
        ``pages``, each checked against its hash, namespace and checksum; how many leading blocks
        arrived intact (0 without tiers)."""
        ...

    def cancel_receive(self, transfer_id: str) -> None:
        """The transfer broke off before its commit: the reservation waits for another one (or expires)."""
        ...


class Outgoing:
    """Prefill side: one hand-off as its sender sees it (used on the server's event loop).

    ``pages`` are this side's pages of the blocks ``first_block ..`` to send. Layers become final as
    the prefill forward stores them (:meth:`layer_done`; all at once for a hand-off that starts after
    the prefill); the commit arrives with the first token (:meth:`commit_ready`), and with it the
    hashes of the full blocks (``block_hashes``)."""

    def __init__(self, transfer_id: str, first_block: int, pages: tuple[int, ...], num_layers: int) -> None:
        self.transfer_id = transfer_id
        self.first_block = first_block
        self.pages = pages
        self.num_layers = num_layers
        # the chained hashes of the full blocks among ``pages`` (a prefix of them), known with the commit
        self.block_hashes: tuple[int, ...] = ()
        self._layers: asyncio.Queue[int] = asyncio.Queue()
        self.committed_future: asyncio.Future[engine_pb2.KVCommit] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task | None = None  # the send, while it runs

    @property
    def committed(self) -> bool:
        """Whether the first token is sampled (the hand-off will happen)."""
        return self.committed_future.done()

    def cancel(self) -> None:
        """Stop sending: no hand-off will come."""
        if self.task is not None:
            self.task.cancel()

    def layer_done(self, layer: int) -> None:
        self._layers.put_nowait(layer)

    def all_layers_done(self) -> None:
        for layer in range(self.num_layers):
            self._layers.put_nowait(layer)

    def commit_ready(self, commit: engine_pb2.KVCommit) -> None:
        if not self.committed_future.done():
            self.committed_future.set_result(commit)

    async def layers(self) -> AsyncIterator[int]:
        """Each layer once, as it becomes final."""
        for _ in range(self.num_layers):
            yield await self._layers.get()

    async def commit(self) -> engine_pb2.KVCommit:
        return await asyncio.shield(self.committed_future)


class KVSender(ABC):
    """Prefill side of one transport (built with the transport options of the instance)."""

    name: ClassVar[str]
    streams_layers: ClassVar[bool] = False  # starts during the prefill forward, layer by layer

    def __init__(self, options: dict) -> None:
        self.options = options

    @abstractmethod
    async def send(self, target: engine_pb2.KVTarget, store: PageAccess, out: Outgoing) -> TransferResult:
        """Send ``out``'s blocks and then its commit to ``target``; raises :class:`TransferError`
        when the decode side cannot be reached."""

    async def close(self) -> None:  # noqa: B027 (most senders hold nothing)
        """Release connections."""


class KVReceiver(ABC):
    """Decode side of a transport with an endpoint of its own (the gRPC and Mooncake transports are
    received by the engine server's ``TransferKV`` call instead)."""

    name: ClassVar[str]
    address: str

    def __init__(self, options: dict) -> None:
        self.options = options

    @abstractmethod
    async def start(self, sink: HandoffSink) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...


@dataclass(frozen=True)
class Transport:
    """One transport: its sender, and its receiver when it has an endpoint of its own."""

    name: str
    sender: type[KVSender]
    receiver: type[KVReceiver] | None = None


def block_range(num_tokens: int, matched_tokens: int, block_size: int) -> range:
    """The blocks a hand-off carries: from the first one the decode side lacks to the one holding
    the prompt's last token."""
    return range(matched_tokens // block_size, -(-num_tokens // block_size))


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def write_pages_checked(dest: Destination, r: int, first_block: int, data: bytes | memoryview,
                        expected_crc: int) -> int:
    """Write one received range's pages of consecutive blocks into their reserved pages after
    checking them; returns the bytes written."""
    page_bytes = dest.store.page_bytes
    if r >= len(page_bytes):
        raise TransferError(f"{dest.transfer_id}: range {r} is not in this instance's KV layout")
    n, rest = divmod(len(data), page_bytes[r])
    if rest or first_block < dest.first_block or first_block + n > len(dest.pages):
        raise TransferError(f"{dest.transfer_id}: {len(data)} bytes of range {r} from block {first_block} are not "
                            "pages this reservation receives")
    if crc32(data) != expected_crc:
        raise TransferError(f"{dest.transfer_id}: range {r} is corrupted (CRC mismatch)")
    dest.store.write_pages(r, dest.pages[first_block:first_block + n], data)
    return len(data)

"""The ``mooncake`` transport: blocks through a Mooncake store (the xLLM paper's KV store; over
TCP here, RDMA where deployments have it, by Mooncake's configuration).

The prefill instance puts every block under a key of its own (one batch), then sends the commit
(keys and CRC-32s) over the decode instance's ``TransferKV``; the decode side fetches the blocks in
one batch, removes the keys (forced: a read leaves a lease that a plain remove respects), checks and
writes the blocks into its reservation. Every instance using it names the store's master
and metadata server (``--mooncake-master HOST:PORT --mooncake-metadata URL``); PyPI
``mooncake-transfer-engine-non-cuda`` provides the client (imported only when this transport is
used). Mooncake's own transfer endpoint binds the host's interface, not loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading

from xllm.core.kv.page_store import PageStore
from xllm.engine.handoff.base import KVSender, Outgoing, TransferError, TransferResult, Transport, crc32
from xllm.engine.handoff.grpc import TransferChannels
from xllm.proto.engine.v1 import engine_pb2


class MooncakeStore:
    """A Mooncake store client (blocking calls: run them in a thread)."""

    def __init__(self, options: dict) -> None:
        master, metadata = options.get("mooncake_master"), options.get("mooncake_metadata")
        if not master or not metadata:
            raise TransferError("the mooncake transport needs --mooncake-master and --mooncake-metadata")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise TransferError("the mooncake transport needs PyPI mooncake-transfer-engine-non-cuda "
                                f"(and Debian libibverbs1): {exc}") from exc
        self._store = MooncakeDistributedStore()
        segment = int(float(options.get("mooncake_segment_gib", 0.25)) * 2**30)
        code = self._store.setup(options.get("mooncake_host", "127.0.0.1"), metadata, segment, segment // 4,
                                 "tcp", "", master)
        if code != 0:
            raise TransferError(f"cannot join the Mooncake store at {master} (setup returned {code})")
        self._lock = threading.Lock()

    def put_many(self, keys: list[str], values: list[bytes]) -> None:
        with self._lock:
            code = self._store.put_batch(keys, values)
        if code != 0:
            raise TransferError(f"Mooncake put of {len(keys)} blocks failed ({code})")

    def take_many(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, which are removed (each block has one reader)."""
        with self._lock:
            values = self._store.get_batch(keys)
            # a read leaves a lease on the objects, which a plain remove respects (-706): force it
            self._store.batch_remove(keys, True)
        missing = [k for k, v in zip(keys, values) if not v]
        if missing:
            raise TransferError(f"Mooncake has no {missing[0]} ({len(missing)} of {len(keys)} blocks missing)")
        return [bytes(v) for v in values]

    def close(self) -> None:
        with self._lock, contextlib.suppress(Exception):
            self._store.close()


class MooncakeSender(KVSender):
    name = "mooncake"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._store: MooncakeStore | None = None
        self.channels = TransferChannels(options.get("security"))

    async def send(self, target: engine_pb2.KVTarget, store: PageStore, out: Outgoing) -> TransferResult:
        if self._store is None:
            self._store = await asyncio.to_thread(MooncakeStore, self.options)
        commit = await out.commit()
        prefix = f"xllm/kv/{commit.transfer_id}/{secrets.token_hex(4)}"
        blocks = [store.read_block(page) for page in out.pages]
        keys = [f"{prefix}/{commit.first_block + i}" for i in range(len(blocks))]
        if blocks:
            await asyncio.to_thread(self._store.put_many, keys, blocks)  # one batch: one thread hop, one round trip
        commit.store_keys.extend(keys)
        commit.block_crc32.extend(crc32(b) for b in blocks)
        sent = sum(len(b) for b in blocks)

        async def messages():
            yield engine_pb2.KVTransferMessage(commit=commit)

        ack = await self.channels.transfer(target.address, messages(), float(self.options.get("timeout", 30.0)))
        return TransferResult(ack.installed, sent if ack.installed else 0, ack.error)

    async def close(self) -> None:
        await self.channels.close()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)


TRANSPORT = Transport("mooncake", MooncakeSender)

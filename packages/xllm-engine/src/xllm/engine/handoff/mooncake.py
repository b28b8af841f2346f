"""The ``mooncake`` transport: hand-offs through the cluster KV store (T3), Mooncake's own design.

The store is the engines' T3 tier (``--kv-store mooncake://HOST:PORT``, :mod:`xllm.kvstore.mooncake_tier`),
and a hand-off uses it as every tier is used: blocks keyed by their chained hashes in the namespace of
the model and KV layout, each stored with its header and SHA-256 and checked on every read. There is
no second client and no per-transfer key.

Prefill side (:class:`StoreSender`): once the first token is out, the request's full blocks that the
decode side lacks are published to the store (one lookup, one batch put of those the store does not
hold already: a shared system prompt another hand-off published is not sent again); then, over the
decode instance's ``TransferKV``, the pages of the blocks the store did not take (the prompt's last,
partial block has no hash) and the commit naming the published blocks by hash (``store_hashes``).

Decode side (:func:`xllm.engine.handoff.grpc.receive`): the named blocks are read from its KV tiers
into the reservation (``LowerTiers.fetch``, the path a prefix load takes), the pages written, the KV
installed. The blocks then stay in the store as ordinary T3 blocks: both instances publish them in
their KV events (``KVCacheEvents.tiers``, scope-shared with every instance on the store), so a later
request with the same prefix is a T3 hit wherever it is routed.

Failures never give a wrong token: no store on the prefill side, a store that is down or refuses the
blocks, and the blocks go as pages instead; a block the decode side cannot read intact from the store
(evicted meanwhile, corrupt, the store killed) makes it answer ``resend``, and the same KV is sent again
as pages (the existing ``grpc`` path) into the waiting reservation. Both count as a fallback
(``EngineCounters.kv_handoff_store_fallbacks``). Only if that fails too does the decode side recompute.
"""

from __future__ import annotations

import asyncio
import logging

from xllm.core.kv.lower_tiers import LowerTiers
from xllm.core.kv.page_store import PageAccess
from xllm.engine.handoff.base import TIERS_OPTION, KVSender, Outgoing, TransferResult, Transport
from xllm.engine.handoff.grpc import TransferChannels, page_messages
from xllm.proto.engine.v1 import engine_pb2

log = logging.getLogger(__name__)


class StoreSender(KVSender):
    name = "mooncake"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self.tiers: LowerTiers | None = options.get(TIERS_OPTION)
        self.channels = TransferChannels(options.get("security"))

    async def send(self, target: engine_pb2.KVTarget, store: PageAccess, out: Outgoing) -> TransferResult:
        commit = await out.commit()
        full = list(out.block_hashes[:len(out.pages)])
        published = 0
        if self.tiers is not None and full:
            try:
                published = await asyncio.to_thread(self.tiers.publish, full, out.pages[:len(full)])
            except Exception:  # a tier's bug: the blocks go as pages
                log.exception("KV hand-off %s: publishing its blocks to the store failed", out.transfer_id)
        commit.store_hashes[:] = full[:published]
        ack, sent = await self._transfer(target, store, out, commit, published)
        fallback = published < len(full)
        if ack.resend:  # the decode side could not read them all from the store: the same KV as pages
            fallback, published = True, 0
            again = engine_pb2.KVCommit()
            again.CopyFrom(commit)
            del again.store_hashes[:]
            ack, sent = await self._transfer(target, store, out, again, 0)
        return TransferResult(ack.installed, sent if ack.installed else 0, ack.error,
                              store_blocks=published if ack.installed else 0, fallback=fallback)

    async def _transfer(self, target: engine_pb2.KVTarget, store: PageAccess, out: Outgoing,
                        commit: engine_pb2.KVCommit, from_store: int) -> tuple[engine_pb2.KVTransferAck, int]:
        """One ``TransferKV`` call: the pages of the blocks after the first ``from_store``, then ``commit``;
        returns the answer and the bytes moved (store blocks counted at their size)."""
        rest = out.pages[from_store:]
        sent = from_store * store.block_bytes + len(rest) * store.block_bytes

        async def messages():
            if rest:
                for message in page_messages(store, out.transfer_id, rest, out.first_block + from_store):
                    yield message
            yield engine_pb2.KVTransferMessage(commit=commit)

        ack = await self.channels.transfer(target.address, messages(), float(self.options.get("timeout", 30.0)))
        return ack, sent

    async def close(self) -> None:
        await self.channels.close()


TRANSPORT = Transport("mooncake", StoreSender)

"""Migration, source side: a running request's KV moved to another instance while it keeps
decoding (xLLM §3.5; Llumnix's staged copy), over the same transports as prefill/decode hand-offs.

The caller (a gateway answering a draining instance's move offer) reserved KV on the destination
with a decode-phase request whose prompt is the request's first ``num_tokens`` tokens, and asks
``Migrate``. Then:

1. **copy stage**: the blocks the request holds wholly computed now go while it keeps decoding here
   (full blocks never change while their sequence runs); their commit
   (``MIGRATION_STAGE_COPY``) only writes pages at the destination;
2. **final stage**: the engine stops scheduling the request once no step in flight computes it
   (``pause_for_move``); the blocks the copy stage did not carry (all of them if the request was
   preempted meanwhile) go with the ``MIGRATION_STAGE_FINAL`` commit: how many tokens the KV covers,
   the tokens produced here after the reservation (the destination computes their KV: a few tokens)
   and how much text the client has. The destination continues the request; its stream here ends
   with ``FINISH_REASON_HANDED_OFF`` (``release_kv``).

A move that cannot complete (destination unreachable, a stage refused, the request no longer
running) is reported to ``on_failed``: the engine server hands the request back, and its caller
resumes it elsewhere by recompute (the reservation is dropped with the caller's call).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from xllm.core.disagg import MoveReady
from xllm.engine.handoff.base import Outgoing, TransferError, TransferResult
from xllm.proto.engine.v1 import engine_pb2

if TYPE_CHECKING:
    from xllm.engine.handoff.manager import HandoffManager

log = logging.getLogger(__name__)

COPY, FINAL = engine_pb2.MIGRATION_STAGE_COPY, engine_pb2.MIGRATION_STAGE_FINAL


class Migrations:
    """The migrations this instance is sending (on the engine server's event loop)."""

    def __init__(self, manager: HandoffManager, on_failed: Callable[[str], None]) -> None:
        self._m = manager
        self._on_failed = on_failed
        self._tasks: dict[str, asyncio.Task] = {}
        self._ready: dict[str, asyncio.Future[MoveReady]] = {}

    def start(self, request_id: str, target: engine_pb2.KVTarget, num_tokens: int) -> str:
        """Begin moving ``request_id`` to ``target``; returns why it cannot ("" once started)."""
        m = self._m
        if not m.enabled:
            return "this instance's KV backend cannot send KV"
        if request_id in self._tasks:
            return "the request is already being moved"
        if target.layout != m.layout:
            return f"the destination expects KV layout {target.layout!r}, this instance has {m.layout!r}"
        self._tasks[request_id] = task = asyncio.ensure_future(self._run(request_id, target, num_tokens))
        task.add_done_callback(lambda _t: self._tasks.pop(request_id, None))
        return ""

    def ready(self, ready: MoveReady) -> None:
        """The engine stopped the request (``on_move_ready``, moved to this loop)."""
        future = self._ready.get(ready.request_id)
        if future is not None and not future.done():
            future.set_result(ready)

    def cancel(self, request_id: str) -> None:
        """The request's call ended (it finished, or its caller left): stop moving it."""
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()

    async def _run(self, rid: str, target: engine_pb2.KVTarget, num_tokens: int) -> None:
        m, bs = self._m, self._m.block_size
        started = time.monotonic()
        first = target.matched_tokens // bs
        try:
            sender = m.sender(target.transport)
            snap = await m.engine.move_snapshot(rid)
            if snap is None:
                raise TransferError("the request is not running here")
            staged = range(first, max(first, min(snap.num_computed_tokens, num_tokens) // bs))
            sent = 0
            if staged:
                sent += (await self._send(sender, target, snap.pages, staged, COPY)).bytes
            self._ready[rid] = asyncio.get_running_loop().create_future()
            if not await m.engine.pause_for_move(rid):
                raise TransferError("the request stopped running here")
            ready = await asyncio.wait_for(self._ready[rid], m.options.handoff_timeout)
            paused = time.monotonic()
            if len(ready.token_ids) < num_tokens:
                raise TransferError(f"the reservation covers {num_tokens} tokens, the request has "
                                    f"{len(ready.token_ids)}")
            covered = min(ready.num_computed_tokens, num_tokens)
            resend = ready.num_preemptions != snap.num_preemptions  # its pages were released meanwhile
            rest = range(first if resend else staged.stop, -(-covered // bs))
            result = await self._send(sender, target, ready.pages, rest, FINAL, covered,
                                      ready.token_ids[num_tokens:], ready.sent_chars)
            sent += result.bytes
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure: the request is resumed by recompute
            m.count("kv_migration_failures", 1)
            log.warning("migration of %s to %s failed (%s): handing it back", rid, target.address, exc)
            self._on_failed(rid)
            return
        finally:
            self._ready.pop(rid, None)
        m.count("kv_migrations_sent", 1)
        log.info("migrated %s to %s over %s: %d bytes, %d block(s) while it ran, %d after it stopped "
                 "(%d token(s) appended); %.1f ms in all, %.1f ms stopped", rid, target.address, target.transport,
                 sent, len(staged), len(rest), len(ready.token_ids) - num_tokens,
                 1e3 * (time.monotonic() - started), 1e3 * (time.monotonic() - paused))
        with contextlib.suppress(Exception):  # the engine stopped: nothing to release
            await m.engine.release_kv(rid)

    async def _send(self, sender, target: engine_pb2.KVTarget, pages: Sequence[int], blocks: range, stage: int,
                    num_tokens: int = 0, appended: Sequence[int] = (), sent_chars: int = 0) -> TransferResult:
        m = self._m
        out = Outgoing(target.transfer_id, blocks.start, tuple(pages[j] for j in blocks), m.num_layers)
        out.all_layers_done()
        out.commit_ready(engine_pb2.KVCommit(
            transfer_id=target.transfer_id, num_tokens=num_tokens, first_block=blocks.start, num_blocks=len(blocks),
            layout=m.layout, migration=stage, appended_tokens=appended, sent_chars=sent_chars))
        result = await asyncio.wait_for(sender.send(target, m.store, out), m.options.handoff_timeout)
        if not result.installed and stage == COPY:
            raise TransferError(f"the destination refused the copied blocks: {result.error}")
        return result

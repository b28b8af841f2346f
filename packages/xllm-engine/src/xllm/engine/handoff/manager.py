"""Prefill/decode hand-offs of one engine instance: both sides, every transport.

:class:`HandoffManager` is the engine's :class:`~xllm.core.disagg.DisaggListener` and the
:class:`~xllm.engine.handoff.base.HandoffSink` of the transports. It lives on the engine server's
event loop; the engine thread only reports to it.

Decode side: a reservation is announced to the gateway as the request's first message (the
:class:`KVTarget` a prefill instance needs). When its blocks arrive they are written into the
reserved pages and the KV installed; a transfer that fails (corrupted block, broken connection)
installs nothing and the engine recomputes the prompt instead. A reservation nobody fills within
``reservation_timeout`` is dropped and its request fails (the gateway resumes it elsewhere).

Prefill side: the blocks the decode side lacks are sent — by a transport that streams layers
(``grpc``) from the start of the forward that completes the prompt, each layer once stored; by the
others once the first token is out — then the commit; the KV is released when the decode side
answered, or ``handoff_timeout`` after the commit if it never does. A request aborted while its
KV is being sent keeps it until the send ended (a transfer may be reading its pages).

Migration (:mod:`xllm.engine.handoff.migration`): the source side sends a running request's KV in
stages; the destination side is a reservation like a decode side's that takes several transfers:
``MIGRATION_STAGE_COPY`` commits only write pages, the ``MIGRATION_STAGE_FINAL`` one installs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from xllm.core import AsyncEngine
from xllm.core.disagg import Handoff, LayerObserver, MoveReady, PromptFinishing, Reservation
from xllm.core.kv.lower_tiers import LowerTiers
from xllm.engine.handoff.base import (
    TIERS_OPTION,
    Destination,
    HandoffOptions,
    KVReceiver,
    KVSender,
    Outgoing,
    TransferError,
    block_range,
)
from xllm.engine.handoff.migration import Migrations
from xllm.engine.intake import message_bounds
from xllm.engine_api.names import KV_TRANSPORTS
from xllm.proto.engine.v1 import engine_pb2

log = logging.getLogger(__name__)


@dataclass
class _Reserved:
    reservation: Reservation
    target: asyncio.Future  # resolves to the KVTarget announced to the gateway
    expiry: asyncio.TimerHandle | None = None
    receiving: bool = False
    abandoned: bool = False
    # a migration's copy stages before its final commit: bytes written, the first one's start, a failure
    staged_bytes: int = 0
    staged_from: float | None = None
    stage_error: str = ""


class HandoffManager:
    """Both sides of the hand-offs of the engine served by one :class:`~xllm.engine.server.EngineServer`."""

    def __init__(self, engine: AsyncEngine, options: HandoffOptions, count: Callable[[str, int], None],
                 on_move_failed: Callable[[str], None] = lambda _rid: None) -> None:
        """``count(counter, n)`` advances an ``EngineCounters`` field; ``on_move_failed(request_id)``:
        a migration of that request could not complete (hand it back)."""
        self.engine = engine
        self.options = options
        self.count = count
        layout = engine.kv_layout
        self.store = engine.page_store()
        self.block_size = layout.block_size
        self.num_layers = layout.spec.num_layers
        self.layout = layout.fingerprint
        self.address = ""  # this instance's EngineService address (gRPC and Mooncake transports)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reserved: dict[str, _Reserved] = {}
        self._stats: dict[str, engine_pb2.DisaggStats] = {}
        self._senders: dict[str, KVSender] = {}
        self._sending: dict[str, Outgoing] = {}  # prefill side: hand-offs whose send has not ended
        self._receiver: KVReceiver | None = None
        self._tasks: set[asyncio.Task] = set()
        self.migrations = Migrations(self, on_move_failed)

    @property
    def enabled(self) -> bool:
        """Whether this engine can hand KV off at all (its backend has pages)."""
        return self.store is not None

    async def start(self, address: str) -> None:
        self._loop = asyncio.get_running_loop()
        self.address = address
        if self.enabled:
            receiver_cls = KV_TRANSPORTS.get(self.options.transport).receiver
            if receiver_cls is not None:
                self._receiver = receiver_cls(self.options.transport_options)
                await self._receiver.start(self)
            if self.options.transport == "fd" and self.store.memfd is None:
                log.warning("--kv-transfer fd needs this instance's KV pages in a memfd (--kv-cache-backend xtensor, "
                            "--tensor-parallel-size 1): hand-offs to it fail; --kv-transfer grpc moves any KV")
            if self.options.transport == "mooncake" and not (self.tiers is not None and self.tiers.has_store):
                log.warning("--kv-transfer mooncake without a cluster KV store tier (--kv-store): hand-offs to "
                            "this instance arrive as pages")
            self.engine.attach_disagg(self)

    @property
    def message_bytes(self) -> int:
        """The largest hand-off message this decode side takes: the ``TransferKV`` bound of the gRPC
        intake (:func:`xllm.engine.intake.message_bounds`), for transports with an endpoint of their own."""
        return message_bounds(self.engine.request_limits, self.store.page_bytes if self.store is not None
                              else ()).transfer_kv

    @property
    def tiers(self) -> LowerTiers | None:
        """The engine's KV tiers below its memory (the store path reads and publishes through them)."""
        return self.engine.lower_tiers

    def fetch_from_store(self, hashes: list[int], pages: tuple[int, ...]) -> int:
        tiers = self.tiers
        return 0 if tiers is None else tiers.fetch(hashes, pages)

    async def stop(self) -> None:
        await self.migrations.stop()
        if self._receiver is not None:
            await self._receiver.stop()
        for sender in self._senders.values():
            with contextlib.suppress(Exception):
                await sender.close()
        for task in list(self._tasks):
            task.cancel()

    # ---- DisaggListener: called on the engine thread ------------------------------------------------
    def on_reserved(self, reservation: Reservation) -> None:
        self._loop.call_soon_threadsafe(self._reserved_now, reservation)

    def on_prompt_finishing(self, prompts: list[PromptFinishing]) -> LayerObserver | None:
        streamed = tuple(p for p in prompts if self._streams_layers(p.target.transport))
        if not streamed:
            return None
        loop, ids = self._loop, tuple(p.request_id for p in streamed)
        loop.call_soon_threadsafe(self._start_streams, streamed)
        return lambda layer: loop.call_soon_threadsafe(self._layer_done, ids, layer)

    def on_handoff(self, handoff: Handoff) -> None:
        self._loop.call_soon_threadsafe(self._handoff_now, handoff)

    def on_abandoned(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._abandon, request_id)

    def on_move_ready(self, ready: MoveReady) -> None:
        self._loop.call_soon_threadsafe(self.migrations.ready, ready)

    # ---- what the engine server asks ------------------------------------------------------------------
    def expect_reservation(self, request_id: str) -> asyncio.Future:
        """A future for the KVTarget a decode-phase request will announce (call before submitting it)."""
        state = self._reserved.get(request_id)
        if state is None:
            state = self._reserved[request_id] = _Reserved(None, self._loop.create_future())  # type: ignore[arg-type]
        return state.target

    def migrate(self, request_id: str, target: engine_pb2.KVTarget, num_tokens: int) -> str:
        """Move a running request to ``target`` (see :mod:`xllm.engine.handoff.migration`); returns
        why it cannot ("" once started)."""
        return self.migrations.start(request_id, target, num_tokens)

    def forget(self, request_id: str) -> None:
        """The request's call is over: drop what was kept for it."""
        self.migrations.cancel(request_id)
        state = self._reserved.get(request_id)
        if state is not None and state.reservation is None:
            del self._reserved[request_id]
        self._stats.pop(request_id, None)

    def take_stats(self, request_id: str) -> engine_pb2.DisaggStats | None:
        """Stats to attach to the request's next chunk (once)."""
        return self._stats.pop(request_id, None)

    # ---- decode side --------------------------------------------------------------------------------
    def _reserved_now(self, reservation: Reservation) -> None:
        rid = reservation.request_id
        state = self._reserved.get(rid)
        if state is None:
            state = self._reserved[rid] = _Reserved(reservation, self._loop.create_future())
        state.reservation = reservation
        address = self._receiver.address if self._receiver is not None else self.address
        if not state.target.done():
            state.target.set_result(engine_pb2.KVTarget(
                transport=self.options.transport, address=address, transfer_id=rid,
                matched_tokens=reservation.matched_tokens, layout=self.layout))
        state.expiry = self._loop.call_later(self.options.reservation_timeout, self._expire, rid)

    def begin_receive(self, transfer_id: str, transport: str) -> Destination:
        state = self._reserved.get(transfer_id)
        if state is None or state.reservation is None or state.abandoned or state.receiving:
            raise TransferError(f"no reservation awaits {transfer_id!r} here")
        state.receiving = True
        r = state.reservation
        return Destination(transfer_id, self.store, r.pages, r.matched_tokens // self.block_size)

    async def end_receive(self, commit: engine_pb2.KVCommit, received_bytes: int, error: str = "",
                          started: float | None = None, overlapped: float = 0.0, store_blocks: int = 0) -> bool:
        rid = commit.transfer_id
        staging = self._reserved.get(rid)
        if commit.migration == engine_pb2.MIGRATION_STAGE_COPY and staging is not None and not staging.abandoned:
            return self._staged(staging, received_bytes, error, started)
        state = self._reserved.pop(rid, None)
        if state is None:
            return False
        if state.expiry is not None:
            state.expiry.cancel()
        if state.abandoned:
            await self.engine.release_kv(rid)
            return False
        received_bytes += state.staged_bytes
        started = state.staged_from if state.staged_from is not None else started
        error = error or state.stage_error
        ok = not error and commit.layout == self.layout
        if not ok:
            error = error or f"layout {commit.layout!r} does not match this instance's {self.layout!r}"
            log.warning("KV hand-off %s failed (%s): recomputing the prompt here", rid, error)
            self.count("kv_handoff_failures", 1)
        else:
            self.count("kv_migrations_installed" if commit.migration else "kv_handoffs_installed", 1)
            self.count("kv_transfer_bytes", received_bytes)
        r = state.reservation
        self._stats[rid] = engine_pb2.DisaggStats(
            transfer_seconds=time.monotonic() - started if started is not None else 0.0,
            transfer_bytes=received_bytes if ok else 0,
            transferred_tokens=max((commit.num_tokens if commit.migration else r.num_tokens) - r.matched_tokens, 0)
            if ok else 0,
            transport=self.options.transport, recomputed=not ok, failure=error,
            overlapped_seconds=overlapped if ok else 0.0, store_blocks=store_blocks if ok else 0)
        await self.engine.install_kv(commit, received=ok)
        return ok

    def _staged(self, state: _Reserved, received_bytes: int, error: str, started: float | None) -> bool:
        """A migration's copy stage is written (or failed: the final commit then recomputes); the
        reservation waits for the next transfer, its expiry restarted."""
        state.receiving = False
        if error:
            state.stage_error = state.stage_error or error
            return False
        state.staged_bytes += received_bytes
        if state.staged_from is None:
            state.staged_from = started
        if state.expiry is not None:
            state.expiry.cancel()
        rid = state.reservation.request_id
        state.expiry = self._loop.call_later(self.options.reservation_timeout, self._expire, rid)
        return True

    def cancel_receive(self, transfer_id: str) -> None:
        state = self._reserved.get(transfer_id)
        if state is None:
            return
        state.receiving = False
        if state.abandoned:
            self._abandon(transfer_id)

    def _expire(self, request_id: str) -> None:
        state = self._reserved.get(request_id)
        if state is None or state.receiving:
            return
        del self._reserved[request_id]
        self.count("kv_reservations_expired", 1)
        log.warning("KV reservation %s expired: no prefill instance sent its KV", request_id)
        self._spawn(self.engine.release_kv(request_id))

    def _abandon(self, request_id: str) -> None:
        out = self._sending.get(request_id)
        if out is not None:  # prefill side
            if not out.task.done():  # a send under way releases the KV when it ends
                if not out.committed:  # no hand-off will come: stop streaming
                    out.cancel()
                return
            del self._sending[request_id]  # its stream failed before the first token
        state = self._reserved.get(request_id)
        if state is not None and state.receiving:
            state.abandoned = True  # released when the transfer ends
            return
        if state is not None:
            self._reserved.pop(request_id)
            if state.expiry is not None:
                state.expiry.cancel()
        self._spawn(self.engine.release_kv(request_id))  # either side: nothing reads it

    # ---- prefill side -------------------------------------------------------------------------------
    def sender(self, transport: str) -> KVSender:
        """This instance's sender of ``transport`` (one per transport, kept open)."""
        sender = self._senders.get(transport)
        if sender is None:
            options = {**self.options.transport_options, TIERS_OPTION: self.tiers}
            sender = self._senders[transport] = KV_TRANSPORTS.get(transport).sender(options)
        return sender

    def _streams_layers(self, transport: str) -> bool:
        try:
            return KV_TRANSPORTS.get(transport).sender.streams_layers
        except Exception:  # an unknown transport fails at the hand-off, with its error counted
            return False

    def _outgoing(self, request_id: str, target: engine_pb2.KVTarget, num_tokens: int,
                  pages: tuple[int, ...]) -> Outgoing:
        blocks = block_range(num_tokens, target.matched_tokens, self.block_size)
        out = self._sending[request_id] = Outgoing(request_id, blocks.start, tuple(pages[j] for j in blocks),
                                                   self.num_layers)
        out.task = self._spawn(self._send(request_id, target, out))
        return out

    def _start_streams(self, prompts: tuple[PromptFinishing, ...]) -> None:
        for p in prompts:
            self._outgoing(p.request_id, p.target, p.num_tokens, p.pages)

    def _layer_done(self, request_ids: tuple[str, ...], layer: int) -> None:
        for rid in request_ids:
            out = self._sending.get(rid)
            if out is not None:
                out.layer_done(layer)

    def _handoff_now(self, h: Handoff) -> None:
        # before the first token's chunk reaches the call (it was delivered after this report)
        self._stats[h.request_id] = engine_pb2.DisaggStats(
            queue_seconds=h.queue_seconds, prefill_seconds=h.prefill_seconds, transport=h.target.transport)
        out = self._sending.get(h.request_id)
        if out is not None and out.task.done():  # the stream failed before the first token (counted there)
            del self._sending[h.request_id]
            self._spawn(self.engine.release_kv(h.request_id))
            return
        if out is None:  # not streamed: every layer is final now
            out = self._outgoing(h.request_id, h.target, h.num_tokens, h.pages)
            out.all_layers_done()
        out.block_hashes = h.block_hashes[out.first_block:]
        out.commit_ready(engine_pb2.KVCommit(
            transfer_id=h.target.transfer_id, num_tokens=h.num_tokens, first_block=out.first_block,
            num_blocks=len(out.pages), first_token=h.first_token,
            layout=self.layout))

    async def _send(self, request_id: str, target: engine_pb2.KVTarget, out: Outgoing) -> None:
        sending = None
        try:
            if target.layout != self.layout:
                raise TransferError(f"the decode instance expects KV layout {target.layout!r}, "
                                    f"this one has {self.layout!r}")
            sending = asyncio.ensure_future(self.sender(target.transport).send(target, self.store, out))
            await asyncio.wait({sending, out.committed_future}, return_when=asyncio.FIRST_COMPLETED)
            result = await asyncio.wait_for(sending, self.options.handoff_timeout)  # from the commit on
            self.count("kv_handoffs_sent", 1)
            self.count("kv_handoff_store_blocks", result.store_blocks)
            self.count("kv_handoff_store_fallbacks", int(result.fallback))
            if not result.installed:
                log.info("KV hand-off %s: the decode side did not install it (%s)", request_id, result.error)
        except TimeoutError:
            self.count("kv_handoff_timeouts", 1)
            log.warning("KV hand-off %s: no answer from %s within %.0f s; releasing the KV", request_id,
                        target.address, self.options.handoff_timeout)
        except asyncio.CancelledError:
            if sending is not None:
                sending.cancel()
            self._sending.pop(request_id, None)
            raise  # the request ended without a hand-off, or the server stops
        except Exception as exc:  # unreachable, refused: the decode side's reservation expires
            self.count("kv_handoff_failures", 1)
            log.warning("KV hand-off %s to %s failed: %s", request_id, target.address, exc)
        if not out.committed:  # failed while the prefill ran: the KV is released when its hand-off comes
            return
        self._sending.pop(request_id, None)
        await self.engine.release_kv(request_id)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

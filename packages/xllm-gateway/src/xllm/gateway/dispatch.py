"""Dispatch and failover: each request to an instance (or a prefill/decode pair), and a broken
stream resumed elsewhere.

:class:`Dispatcher` resolves the model, asks the :class:`~xllm.gateway.router.Router` for an
instance and submits the request's choices there; a request an instance cannot take
(unreachable, draining) goes to the next choice. When the model has prefill and decode instances
(PD mode) each choice is placed on a pair instead: reserved on the decode instance, then sent to
the prefill instance with the reservation (:mod:`xllm.gateway.disagg`). :class:`RoutedStream` is
one request's chunks as the client sees them: if its instance breaks the stream off (it died, or
handed the request back while shutting down), the request is resumed on another instance from the
tokens already streamed (recompute), so the client sees one uninterrupted stream: the new instance
replays those tokens through its detokenizer and stop checks and knows how much of their text the
client has, so the text, finish reason and (for sampled requests, whose draws are keyed by (seed,
output index)) the tokens are exactly those of one uninterrupted run. A request on an instance that
drains, or whose decode instance flips to prefill (:mod:`xllm.gateway.roles`), is moved the same way
or with its KV, as the :class:`~xllm.gateway.moves.Mover` decides (:mod:`xllm.gateway.moves`).

The stream decides none of this itself: it keeps the request's state
(:class:`~xllm.gateway.progress.RequestProgress`) and asks the part that decides, each through
narrow methods (:class:`StreamParts`): the :class:`~xllm.gateway.failover.Failover` whether a broken
stream is resumed or failed, the :class:`~xllm.gateway.moves.Mover` how a request moves, the
:class:`~xllm.gateway.router.Router` to account each chunk. Each part counts its own metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from xllm.engine_api.client import EngineClient
from xllm.engine_api.errors import EngineOverloadedError
from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.disagg import PDStream, decodes, phase_request
from xllm.gateway.encode import EncodeStage
from xllm.gateway.failover import Failover, FailoverLimits
from xllm.gateway.metrics import PDMetrics
from xllm.gateway.moves import Migration, Mover, Recompute
from xllm.gateway.openai.errors import APIError, model_not_found, to_api_error
from xllm.gateway.progress import RequestProgress, StallLimits, watched
from xllm.gateway.registry import NoInstanceError, Registry
from xllm.gateway.roles import hands_over
from xllm.gateway.router import Router, Ticket
from xllm.gateway.tracing import NO_SPANS, RequestSpans
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.enums import finish_reason_name

log = logging.getLogger(__name__)

HANDED_OFF = engine_pb2.FINISH_REASON_HANDED_OFF


class Dispatcher:
    """Resolves the model, routes each request to an instance and submits it.

    Routing goes through :class:`~xllm.gateway.router.Router` (policy by name, the global KV
    index). A request an instance cannot take (unreachable, draining) is sent to the next one;
    a stream an instance breaks off (it died or handed the request back while shutting down)
    is resumed on another instance from the tokens already streamed (recompute), so the
    client sees one uninterrupted stream.
    """

    def __init__(self, registry: Registry, default_model: str, router: Router | None = None,
                 max_attempts: int = 3, max_resumes: int = 2, max_crash_strikes: int = 2,
                 pd_metrics: PDMetrics | None = None, handoff_grace: float = 5.0, mover: Mover | None = None,
                 stall: StallLimits | None = None, encoder: EncodeStage | None = None) -> None:
        """``max_attempts``: instances tried to take a request; ``max_resumes``: continuations of a
        broken stream; ``max_crash_strikes``: instance failures a request may be a suspect in before it
        is failed rather than replayed (see :class:`RoutedStream`); ``handoff_grace``: how long a decode
        instance may take to show it has the KV after its prefill instance failed past the first
        token, before the request is resumed elsewhere; ``mover``: answers the move offers of
        draining instances (default: by predicted cost); ``stall``: when a stream whose instance
        stopped stepping (SIGSTOP, gone from the registry) is broken off and resumed elsewhere; ``encoder``: where
        requests' images are encoded before their prefill (EPD, :mod:`xllm.gateway.encode`; default: by the
        instance that prefills)."""
        self.registry = registry
        self.default_model = default_model
        self.router = router or Router(registry)
        self.max_attempts = max_attempts
        self.failover = Failover(self.router, FailoverLimits(max_resumes, max_crash_strikes), self.router.metrics)
        self.pd_metrics = pd_metrics or PDMetrics()
        self.handoff_grace = handoff_grace
        self.mover = mover or Mover(self.router)
        self.encoder = encoder or EncodeStage(self.router)
        self._parts = StreamParts(self.router, self.failover, self.mover, self.resume, stall or StallLimits())
        self._background: set[asyncio.Future] = set()  # keeps detached tasks alive until they ran

    def resolve_model(self, requested: str | None) -> str:
        """The served name a request asked for (the default model without one): a model a live instance
        serves, or one of their LoRA adapters (404 otherwise)."""
        if requested is None or requested == "":
            return self.default_model
        if requested not in self.registry.served_models() and requested not in self.registry.adapters():
            raise model_not_found(requested)
        return requested

    def base_of(self, name: str) -> tuple[str, str]:
        """(the model whose instances serve ``name``, the adapter: "" for a model itself)."""
        base = self.registry.adapters().get(name)
        return (name, "") if base is None or name in self.registry.served_models() else (base, name)

    async def embed(self, model: str, prompts: list[list[int]], pooling: str, normalize: bool) -> list[list[float]]:
        """Each prompt's pooled hidden state from an instance of ``model`` (routed like a request; another one
        when it is unavailable); engine refusals raise as APIErrors naming the field."""
        async def one(prompt: list[int]) -> list[float]:
            exclude: set[str] = set()
            for _ in range(self.max_attempts):
                try:
                    state = self.router.route(model, prompt, exclude=exclude).state
                except NoInstanceError as exc:
                    raise APIError(503, str(exc), "server_unavailable") from exc
                try:
                    req = engine_pb2.EmbedRequest(prompt_token_ids=prompt, pooling=pooling, normalize=normalize)
                    return list((await state.client.embed(req)).embedding)
                except InstanceUnavailableError:
                    self.router.failed(state)
                    exclude.add(state.instance_id)
                except Exception as exc:
                    raise to_api_error(exc) from exc
            raise APIError(503, f"no instance of {model!r} could compute the embedding", "server_unavailable")

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def submit_all(self, model: str, reqs: list[engine_pb2.GenerateRequest], session: str | None = None,
                         spans: RequestSpans = NO_SPANS) -> tuple[EngineClient, list[RoutedStream]]:
        """Submit every request to one instance (choices of a request stay together).
        On failure the already submitted ones are aborted and an APIError raised. ``spans``: the request's
        trace (:mod:`xllm.gateway.tracing`): the routing decision and each instance's part go there."""
        prompt = list(reqs[0].prompt_token_ids) if reqs else []
        model, lora = self.base_of(model)
        for r in reqs:  # a sampled request always has a seed: a resumed stream then draws what one run would
            r.model, r.lora_name = model, lora  # (an adapter's requests run on its base model's instances)
            if not r.sampling.HasField("seed") and not (r.sampling.HasField("temperature") and
                                                        r.sampling.temperature == 0):
                r.sampling.seed = secrets.randbits(63)
            r.movable = self.mover.enabled and not r.sampling.HasField("beam_width")  # a search is not resumable
        await self.encoder.attach(model, reqs, spans)  # (EPD: images encoded elsewhere, embeddings attached)
        ticket, streams = await self._place(model, prompt, reqs, session, spans=spans)
        return ticket.state.client, [RoutedStream(self._parts, model, ticket, r, st, spans)
                                     for r, st in zip(reqs, streams)]

    async def _place(self, model: str, prompt: list[int], reqs: list[engine_pb2.GenerateRequest],
                     session: str | None, exclude: set[str] | None = None,
                     spans: RequestSpans = NO_SPANS) -> tuple[Ticket, list]:
        exclude = set(exclude or ())
        prefills, decodes = self.router.pd_pools(model, exclude, reqs[0].lora_name if reqs else "")
        if prefills and decodes:  # (a beam search's group decodes on the decode instance: xllm.core.engine_beams)
            return await self._place_pd(model, prompt, reqs, session, exclude, spans)
        last: BaseException | None = None
        for _ in range(self.max_attempts):
            try:
                with spans.phase("route") as span:
                    ticket = self.router.route(model, prompt, session, exclude, offline=all(r.offline for r in reqs),
                                               lora=reqs[0].lora_name)
                    spans.routed(span, ticket)
            except NoInstanceError as exc:
                if last is not None:
                    raise to_api_error(last) from last
                raise APIError(503, str(exc), "server_unavailable") from exc
            streams = await self._submit_whole(ticket, reqs, exclude, spans)
            if isinstance(streams, BaseException):
                last = streams
                continue
            return ticket, streams
        raise to_api_error(last) from last

    async def _submit_whole(self, ticket: Ticket, reqs: list[engine_pb2.GenerateRequest],
                            exclude: set[str], spans: RequestSpans = NO_SPANS) -> list | BaseException:
        """Submit ``reqs`` whole (prefill and decode) to the ticket's instance and account them: their
        streams, or the error to try another instance after (the instance is then in ``exclude``)."""
        client = ticket.state.client
        streams: list = []
        try:
            for r in reqs:
                streams.append(await client.submit(r, spans.engine_call(ticket, "whole", r.request_id)))
        except InstanceUnavailableError as exc:
            self._abort_later(client, reqs[: len(streams)])
            self.router.failed(ticket.state)
            exclude.add(ticket.state.instance_id)
            self._left_all(spans, ticket, len(streams) + 1, exc)
            return exc
        except EngineOverloadedError as exc:  # its queue is full: another instance may have room
            self._abort_later(client, reqs[: len(streams)])
            exclude.add(ticket.state.instance_id)
            self._left_all(spans, ticket, len(streams) + 1, exc)
            return exc
        except BaseException as exc:
            self._abort_later(client, reqs[: len(streams)])
            self._left_all(spans, ticket, len(streams) + 1, exc)
            raise to_api_error(exc) from exc
        self.router.dispatched(ticket, len(reqs))
        return streams

    @staticmethod
    def _left_all(spans: RequestSpans, ticket: Ticket, calls: int, exc: BaseException | None = None) -> None:
        """``calls`` calls on ``ticket``'s instance ended without a stream (their span says why)."""
        for _ in range(calls):
            spans.left(ticket, f"{type(exc).__name__}: {exc}" if exc is not None else None)

    async def _place_pd(self, model: str, prompt: list[int], reqs: list[engine_pb2.GenerateRequest],
                        session: str | None, exclude: set[str], spans: RequestSpans = NO_SPANS) -> tuple[Ticket, list]:
        """Reserve every choice on one decode instance, then send them to a prefill instance — or, when
        the placement overflows the prefill onto the decode instance (every prefill instance predicted
        to miss the TTFT objective: :class:`xllm.sched.PDPlacement`), submit them whole to it."""
        last: BaseException | None = None
        for _ in range(self.max_attempts):
            try:
                with spans.phase("route", **{"xllm.route.pd": True}) as span:
                    p_ticket, d_ticket = self.router.route_pd(model, prompt, reqs[0].sampling.max_tokens, session,
                                                              exclude, reqs[0].lora_name)
                    spans.routed(span, d_ticket, p_ticket)
            except NoInstanceError as exc:
                if last is not None:
                    raise to_api_error(last) from last
                raise APIError(503, str(exc), "server_unavailable") from exc
            if p_ticket is d_ticket:  # prefill overflow: prefilled and decoded there, no hand-off
                whole = await self._submit_whole(d_ticket, reqs, exclude, spans)
                if isinstance(whole, BaseException):
                    last = whole
                    continue
                self.pd_metrics.overflowed(model)
                return d_ticket, whole
            client, reserved = d_ticket.state.client, []
            try:
                for r in reqs:
                    it = aiter(await client.submit(phase_request(r, engine_pb2.DISAGG_PHASE_DECODE),
                                                   spans.engine_call(d_ticket, "decode", r.request_id)))
                    first = await anext(it)
                    if not first.HasField("kv_reservation"):
                        raise InstanceUnavailableError(f"decode instance {d_ticket.state.instance_id} reserved no "
                                                       f"KV ({first.error or 'no reservation'})",
                                                       d_ticket.state.instance_id)
                    reserved.append((r, it, first.kv_reservation))
            except InstanceUnavailableError as exc:
                await self._close_all([it for _, it, _ in reserved])
                self.router.failed(d_ticket.state)
                exclude.add(d_ticket.state.instance_id)
                self._left_all(spans, d_ticket, len(reserved) + 1, exc)
                last = exc
                continue
            except BaseException as exc:
                await self._close_all([it for _, it, _ in reserved])
                self._left_all(spans, d_ticket, len(reserved) + 1, exc)
                raise to_api_error(exc) from exc
            self.router.dispatched(d_ticket, len(reqs))
            streams = []
            try:
                for i, (r, it, target) in enumerate(reserved):
                    if i == 0:
                        p_ticket, p_stream, attempts = await self.submit_prefill(model, r, target, session,
                                                                                 exclude, p_ticket, spans)
                    else:  # the other choices follow the first to its prefill instance
                        p_stream = await p_ticket.state.client.submit(
                            phase_request(r, engine_pb2.DISAGG_PHASE_PREFILL, target),
                            spans.engine_call(p_ticket, "prefill", r.request_id))
                    streams.append(PDStream(self, self.router, self.pd_metrics, model, r, p_ticket, p_stream,
                                            d_ticket, it, target, session, self.handoff_grace, attempts, spans,
                                            self._parts.stall))
            except BaseException as exc:
                await self._close_all([it for _, it, _ in reserved])
                raise to_api_error(exc) from exc
            self.router.dispatched(p_ticket, len(reqs))
            return d_ticket, streams
        raise to_api_error(last) from last

    async def submit_prefill(self, model: str, req: engine_pb2.GenerateRequest, target: engine_pb2.KVTarget,
                             session: str | None, exclude: set[str], ticket: Ticket | None = None,
                             spans: RequestSpans = NO_SPANS) -> tuple[Ticket, object, int]:
        """Send the prefill phase of ``req`` (its decode side reserved as ``target``) to a prefill
        instance, trying others while they are unavailable (the caller accounts the dispatch).
        Returns the ticket, its stream and the instances tried (1 + the failed ones; each failure
        counts as a prefill retry, as one after the call was accepted does in :class:`PDStream`)."""
        tried = set(exclude)
        last: BaseException | None = None
        for attempt in range(1, self.max_attempts + 1):
            if ticket is None:
                try:
                    ticket = self.router.route_prefill(model, list(req.prompt_token_ids), session, tried,
                                                       req.lora_name)
                except NoInstanceError as exc:
                    raise InstanceUnavailableError(f"no prefill instance could take it ({last or exc})") from exc
            try:
                stream = await ticket.state.client.submit(phase_request(req, engine_pb2.DISAGG_PHASE_PREFILL, target),
                                                          spans.engine_call(ticket, "prefill", req.request_id))
            except InstanceUnavailableError as exc:
                spans.left(ticket, str(exc))
                self.router.failed(ticket.state)
                tried.add(ticket.state.instance_id)
                self.pd_metrics.prefill_retry(model, ticket.state.instance_id)
                ticket, last = None, exc
                continue
            return ticket, stream, attempt
        raise InstanceUnavailableError(f"no prefill instance could take it ({last})")

    @staticmethod
    async def _close_all(iterators: list) -> None:
        for it in iterators:  # closing an open call aborts its request (and frees its reservation)
            with contextlib.suppress(Exception):
                await it.aclose()

    def background(self, coro) -> asyncio.Future:
        """Run ``coro`` detached from the request that started it (kept alive until it ends)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _abort_later(self, client: EngineClient, reqs: list[engine_pb2.GenerateRequest]) -> None:
        for r in reqs:
            self.background(client.abort(r.request_id))

    async def resume(self, model: str, cont: engine_pb2.GenerateRequest, failed: set[str],
                     spans: RequestSpans = NO_SPANS) -> tuple[Ticket, object]:
        """Place ``cont``, a request continued from what its client has
        (:func:`xllm.gateway.progress.continuation`), on an instance not in ``failed`` (routed and
        accounted as a new request): its ticket and stream."""
        ticket, streams = await self._place(model, list(cont.prompt_token_ids), [cont], None, failed, spans)
        return ticket, streams[0]


@dataclass(frozen=True)
class StreamParts:
    """What a :class:`RoutedStream` asks, each part for what it decides: the router (per-instance
    accounting and latencies), the failover (a broken stream: resume or fail), the mover (move
    offers, role-flip hand-overs, their metrics), ``place`` (a continuation onto another instance:
    :meth:`Dispatcher.resume`) and ``stall`` (when its instance is taken for stopped:
    :func:`~xllm.gateway.progress.watched`)."""

    router: Router
    failover: Failover
    mover: Mover
    place: Callable[[str, engine_pb2.GenerateRequest, set[str], RequestSpans], Awaitable[tuple[Ticket, object]]]
    stall: StallLimits  # when a silent instance is taken for stopped (xllm.gateway.progress)


@dataclass
class _Placement:
    """One stretch of the request on one instance (its ticket), from placement to the stream's end."""

    ticket: Ticket
    got_first: bool = False      # its first chunk came (the router was told)
    accounted: bool = False      # its end was told to the router
    token_chunks: int = 0        # chunks with tokens (TPOT: the gaps from the third on)
    migration: Migration | None = None
    recompute: Recompute | None = None
    then: str = ""               # how the request goes on once this stream ended: "migrated" or "recompute"
    handed_over: bool = False    # offered to move for a role flip of its instance (once per placement)
    error: str | None = None     # why its stream broke (the instance span's error)

    def take(self, plan: Migration | Recompute | None) -> bool:
        """Adopt the mover's answer to a move offer; True when the request leaves now (recompute)."""
        if isinstance(plan, Migration):
            self.migration = plan
        elif isinstance(plan, Recompute):
            self.recompute, self.then = plan, "recompute"
            return True
        return False

    def tpot(self, chunk: engine_pb2.GenerateResponse, gap: float) -> float | None:
        """The TPOT sample of ``chunk`` (``gap`` after the previous chunk): per token, from the third
        chunk with tokens on (not the gap to the first chunk nor, in PD, the hand-off's)."""
        if not chunk.token_ids:
            return None
        self.token_chunks += 1
        return gap / len(chunk.token_ids) if self.token_chunks > 2 else None

    def end(self, router: Router) -> None:
        """Tell the router the request left this instance (once)."""
        if not self.accounted:
            self.accounted = True
            router.finished(self.ticket, self.got_first)


class RoutedStream:
    """The chunks of one request as the client sees them, across instance failures and moves.

    Iterating it yields the instance's chunks; if the instance breaks the stream off
    (``InstanceUnavailableError``) the :class:`~xllm.gateway.failover.Failover` decides: the request
    is resumed on another instance and the chunks continue exactly as one run would have produced
    them (the final chunk's usage counts the whole request), or, once it was a suspect in
    ``max_crash_strikes`` crashes (running when an engine crashed, in the failing step or on an
    instance that vanished), it is failed with an internal error instead of being replayed on yet
    another instance. A draining instance's move offer moves the request with its KV or by recompute
    as the :class:`~xllm.gateway.moves.Mover` decides, the same way unseen by the client; so does the
    offer the gateway makes itself when the request's decode instance flips to prefill
    (:func:`xllm.gateway.roles.hands_over`). Each chunk's gap to the previous one of the same
    instance is a TPOT sample of that instance (:meth:`Router.observe_tpot`). Leaving early closes
    the underlying stream (the engine aborts the request). The request's state across instances is
    one :class:`~xllm.gateway.progress.RequestProgress`; each stretch on one instance a
    :class:`_Placement`.
    """

    def __init__(self, parts: StreamParts, model: str, ticket: Ticket, req: engine_pb2.GenerateRequest,
                 stream, spans: RequestSpans = NO_SPANS) -> None:
        self._router, self._failover, self._mover, self._place = parts.router, parts.failover, parts.mover, parts.place
        self._stall = parts.stall
        self._model = model
        self._ticket = ticket
        self._stream = stream
        self.request_id = req.request_id
        self.progress = RequestProgress(req)
        self._arrived = time.monotonic()
        self._spans = spans

    @property
    def instance_id(self) -> str:
        return self._ticket.state.instance_id

    @property
    def resumes(self) -> int:
        return self.progress.resumes

    @property
    def moves(self) -> int:
        return self.progress.moves

    @property
    def crash_strikes(self) -> int:
        return self.progress.crash_strikes

    async def __aiter__(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        while True:
            at = _Placement(self._ticket)
            inner = watched(aiter(self._stream), at.ticket.state, self._stall)  # a stopped instance breaks it off
            try:
                async for chunk in inner:
                    if chunk.HasField("move_offer"):  # (ignored while already moving: handed over for a role flip)
                        if at.migration is None and at.take(self._offer(at, chunk.move_offer)):
                            break
                        continue
                    if self._migration_ended(at, chunk):
                        break
                    yield self._deliver(at, chunk)
                    if chunk.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                        return
                    if self._flips_away(at) and at.take(self._hand_over(at)):
                        break
                if not at.then:
                    return
            except InstanceUnavailableError as exc:
                at.error = str(exc)
                if not self._failover.broke(self._model, at.ticket, exc, self.progress):
                    raise
                at.end(self._router)
                started = time.time()
                await self._continue(self.progress.failed)
                self._spans.step("resume", started, **{
                    "xllm.resume.cause": "crashed" if exc.crashed else "unavailable", "xllm.resume.mode": "recompute",
                    "xllm.resume.error": str(exc), "xllm.resume.from": at.ticket.state.instance_id,
                    "xllm.resume.to": self._ticket.state.instance_id,
                    "xllm.resume.tokens_sent": len(self.progress.generated)})
                self._failover.resumed(self._model, at.ticket, self.progress)
                self.progress.left("resumed")
                continue
            finally:
                await self._close(at, inner)
            await self._move(at)

    def _deliver(self, at: _Placement, chunk: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        """Account ``chunk`` (the router's first token and TPOT, a KV transfer's measurement, the
        pause a move made) and count it as sent."""
        if not at.got_first:
            at.got_first = True
            self._router.served(at.ticket)
            self._spans.first_token(time.monotonic() - self._arrived)
        if chunk.HasField("disagg_stats") and chunk.disagg_stats.transfer_bytes:
            self._mover.observe_transfer(chunk.disagg_stats)
        now = time.monotonic()
        tpot = at.tpot(chunk, now - self.progress.last_chunk)
        if tpot is not None:
            self._router.observe_tpot(at.ticket.state, tpot)
        pause = self.progress.sent(chunk, now)
        if pause is not None:
            self._mover.paused(self._model, *pause)
        if chunk.finish_reason not in (engine_pb2.FINISH_REASON_UNSPECIFIED, HANDED_OFF):
            reason = finish_reason_name(chunk.finish_reason) or "stop"
            self._router.completed(at.ticket.state, reason, now - self._arrived)
            self._spans.finished(reason, len(self.progress.generated), now - self._arrived)
        return chunk

    def _migration_ended(self, at: _Placement, chunk: engine_pb2.GenerateResponse) -> bool:
        """Whether the request leaves the instance now: its migration handed it off (``chunk``) or
        failed (the mover logs and counts it; it is recomputed instead)."""
        if at.migration is None:
            return False
        if chunk.finish_reason == HANDED_OFF:
            at.then = "migrated"
        elif at.migration.failure:
            self._mover.migration_failed(self._model, self.request_id, at.migration)
            at.then = "recompute"
        return bool(at.then)

    def _flips_away(self, at: _Placement) -> bool:
        """Whether the request must leave its instance for a role flip (decode to prefill): moves
        are on, it is not moving yet nor was offered for this placement, and it decodes there (a PD
        request once its decode side streams). Marks the placement offered."""
        if (at.migration is not None or at.handed_over or not self._mover.enabled
                or not hands_over(at.ticket.state) or not decodes(self._stream)):
            return False
        at.handed_over = True
        return True

    def _offer(self, at: _Placement, offer: engine_pb2.MoveOffer) -> Migration | Recompute | None:
        """The mover's answer to the move offer of the request's instance."""
        return self._mover.offer(self._model, at.ticket, self.progress.instance_request_id,
                                 self.progress.next_continuation(), offer, self._spans)

    def _hand_over(self, at: _Placement) -> Migration | Recompute | None:
        """The mover's answer to the offer it makes itself for a role flip of the request's instance."""
        return self._mover.handover(self._model, at.ticket, self.progress.instance_request_id,
                                    self.progress.next_continuation(), self._spans)

    async def _close(self, at: _Placement, inner: AsyncIterator) -> None:
        """The end of a placement: a migration that did not happen is given up, the instance's call
        closed (an open one aborts the request there) and the router told."""
        if at.migration is not None and at.then != "migrated":
            await at.migration.cancel()
        with contextlib.suppress(Exception):
            await inner.aclose()
        at.end(self._router)
        self._spans.left(at.ticket, at.error, at.then or None)

    async def _move(self, at: _Placement) -> None:
        """Go on where the move of ``at`` leads: the migration's destination, or elsewhere by recompute."""
        self.progress.moves += 1
        started = time.time()
        if at.then == "migrated":
            self._ticket, self._stream = at.migration.ticket, await at.migration.destination()
            self.progress.instance_request_id = at.migration.cont.request_id
            how = "migrated"
        else:
            try:
                await self._continue(self.progress.failed | {at.ticket.state.instance_id})
            finally:
                if at.recompute is not None:
                    at.recompute.release()
            how = "recomputed"
        self._mover.moved(self._model, how)
        self._spans.step("move", started, **{"xllm.move.mode": how, "xllm.move.from": at.ticket.state.instance_id,
                                             "xllm.move.to": self._ticket.state.instance_id,
                                             "xllm.move.cause": "role_flip" if at.handed_over else "drain",
                                             "xllm.move.tokens_sent": len(self.progress.generated)})
        self.progress.left(how)

    async def _continue(self, exclude: set[str]) -> None:
        """Resume the request elsewhere by recompute (after a failure or for a move)."""
        cont = self.progress.next_continuation()
        self._ticket, self._stream = await self._place(self._model, cont, exclude, self._spans)
        self.progress.instance_request_id = cont.request_id

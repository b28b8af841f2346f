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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator

from xllm.core.errors import EngineOverloadedError
from xllm.engine.client import EngineClient
from xllm.engine.wire import InstanceUnavailableError, RequestFailedError
from xllm.gateway.disagg import PDStream, phase_request
from xllm.gateway.metrics import PDMetrics
from xllm.gateway.moves import Migration, Mover, Recompute, continuation
from xllm.gateway.openai.errors import APIError, model_not_found, to_api_error
from xllm.gateway.registry import NoInstanceError, Registry
from xllm.gateway.router import Router, Ticket
from xllm.proto.engine.v1 import engine_pb2

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
                 pd_metrics: PDMetrics | None = None, handoff_grace: float = 5.0, mover: Mover | None = None) -> None:
        """``max_attempts``: instances tried to take a request; ``max_resumes``: continuations of a
        broken stream; ``max_crash_strikes``: instance failures a request may be a suspect in before it
        is failed rather than replayed (see :class:`RoutedStream`); ``handoff_grace``: how long a decode
        instance may take to show it has the KV after its prefill instance failed past the first
        token, before the request is resumed elsewhere; ``mover``: answers the move offers of
        draining instances (default: by predicted cost)."""
        self.registry = registry
        self.default_model = default_model
        self.router = router or Router(registry)
        self.max_attempts = max_attempts
        self.max_resumes = max_resumes
        self.max_crash_strikes = max_crash_strikes
        self.pd_metrics = pd_metrics or PDMetrics()
        self.handoff_grace = handoff_grace
        self.mover = mover or Mover(self.router)
        self._background: set[asyncio.Future] = set()  # keeps detached tasks alive until they ran

    def resolve_model(self, requested: str | None) -> str:
        served = self.registry.served_models()
        if requested is None or requested == "":
            return self.default_model
        if requested not in served:
            raise model_not_found(requested)
        return requested

    async def submit_all(self, model: str, reqs: list[engine_pb2.GenerateRequest],
                         session: str | None = None) -> tuple[EngineClient, list[RoutedStream]]:
        """Submit every request to one instance (choices of a request stay together).
        On failure the already submitted ones are aborted and an APIError raised."""
        prompt = list(reqs[0].prompt_token_ids) if reqs else []
        for r in reqs:  # a sampled request always has a seed: a resumed stream then draws what one run would
            if not r.sampling.HasField("seed") and not (r.sampling.HasField("temperature") and
                                                        r.sampling.temperature == 0):
                r.sampling.seed = secrets.randbits(63)
            r.movable = self.mover.enabled and not r.sampling.HasField("beam_width")  # a search is not resumable
        ticket, streams = await self._place(model, prompt, reqs, session)
        return ticket.state.client, [RoutedStream(self, model, ticket, r, st) for r, st in zip(reqs, streams)]

    async def _place(self, model: str, prompt: list[int], reqs: list[engine_pb2.GenerateRequest],
                     session: str | None, exclude: set[str] | None = None) -> tuple[Ticket, list]:
        exclude = set(exclude or ())
        prefills, decodes = self.router.pd_pools(model, exclude)
        if prefills and decodes:  # (a beam search's group decodes on the decode instance: xllm.core.engine_beams)
            return await self._place_pd(model, prompt, reqs, session, exclude)
        last: BaseException | None = None
        for _ in range(self.max_attempts):
            try:
                ticket = self.router.route(model, prompt, session, exclude, offline=all(r.offline for r in reqs))
            except NoInstanceError as exc:
                if last is not None:
                    raise to_api_error(last) from last
                raise APIError(503, str(exc), "server_unavailable") from exc
            streams = await self._submit_whole(ticket, reqs, exclude)
            if isinstance(streams, BaseException):
                last = streams
                continue
            return ticket, streams
        raise to_api_error(last) from last

    async def _submit_whole(self, ticket: Ticket, reqs: list[engine_pb2.GenerateRequest],
                            exclude: set[str]) -> list | BaseException:
        """Submit ``reqs`` whole (prefill and decode) to the ticket's instance and account them: their
        streams, or the error to try another instance after (the instance is then in ``exclude``)."""
        client = ticket.state.client
        streams: list = []
        try:
            for r in reqs:
                streams.append(await client.submit(r))
        except InstanceUnavailableError as exc:
            self._abort_later(client, reqs[: len(streams)])
            self.router.failed(ticket.state)
            exclude.add(ticket.state.instance_id)
            return exc
        except EngineOverloadedError as exc:  # its queue is full: another instance may have room
            self._abort_later(client, reqs[: len(streams)])
            exclude.add(ticket.state.instance_id)
            return exc
        except BaseException as exc:
            self._abort_later(client, reqs[: len(streams)])
            raise to_api_error(exc) from exc
        self.router.dispatched(ticket, len(reqs))
        return streams

    async def _place_pd(self, model: str, prompt: list[int], reqs: list[engine_pb2.GenerateRequest],
                        session: str | None, exclude: set[str]) -> tuple[Ticket, list]:
        """Reserve every choice on one decode instance, then send them to a prefill instance — or, when
        the placement overflows the prefill onto the decode instance (every prefill instance predicted
        to miss the TTFT objective: :class:`xllm.sched.PDPlacement`), submit them whole to it."""
        last: BaseException | None = None
        for _ in range(self.max_attempts):
            try:
                p_ticket, d_ticket = self.router.route_pd(model, prompt, reqs[0].sampling.max_tokens, session, exclude)
            except NoInstanceError as exc:
                if last is not None:
                    raise to_api_error(last) from last
                raise APIError(503, str(exc), "server_unavailable") from exc
            if p_ticket is d_ticket:  # prefill overflow: prefilled and decoded there, no hand-off
                whole = await self._submit_whole(d_ticket, reqs, exclude)
                if isinstance(whole, BaseException):
                    last = whole
                    continue
                self.pd_metrics.overflowed(model)
                return d_ticket, whole
            client, reserved = d_ticket.state.client, []
            try:
                for r in reqs:
                    it = aiter(await client.submit(phase_request(r, engine_pb2.DISAGG_PHASE_DECODE)))
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
                last = exc
                continue
            except BaseException as exc:
                await self._close_all([it for _, it, _ in reserved])
                raise to_api_error(exc) from exc
            self.router.dispatched(d_ticket, len(reqs))
            streams = []
            try:
                for i, (r, it, target) in enumerate(reserved):
                    if i == 0:
                        p_ticket, p_stream, attempts = await self.submit_prefill(model, r, target, session,
                                                                                 exclude, p_ticket)
                    else:  # the other choices follow the first to its prefill instance
                        p_stream = await p_ticket.state.client.submit(
                            phase_request(r, engine_pb2.DISAGG_PHASE_PREFILL, target))
                    streams.append(PDStream(self, model, r, p_ticket, p_stream, d_ticket, it, target, session,
                                           self.handoff_grace, attempts))
            except BaseException as exc:
                await self._close_all([it for _, it, _ in reserved])
                raise to_api_error(exc) from exc
            self.router.dispatched(p_ticket, len(reqs))
            return d_ticket, streams
        raise to_api_error(last) from last

    async def submit_prefill(self, model: str, req: engine_pb2.GenerateRequest, target: engine_pb2.KVTarget,
                             session: str | None, exclude: set[str],
                             ticket: Ticket | None = None) -> tuple[Ticket, object, int]:
        """Send the prefill phase of ``req`` (its decode side reserved as ``target``) to a prefill
        instance, trying others while they are unavailable (the caller accounts the dispatch).
        Returns the ticket, its stream and the instances tried (1 + the failed ones; each failure
        counts as a prefill retry, as one after the call was accepted does in :class:`PDStream`)."""
        tried = set(exclude)
        last: BaseException | None = None
        for attempt in range(1, self.max_attempts + 1):
            if ticket is None:
                try:
                    ticket = self.router.route_prefill(model, list(req.prompt_token_ids), session, tried)
                except NoInstanceError as exc:
                    raise InstanceUnavailableError(f"no prefill instance could take it ({last or exc})") from exc
            try:
                stream = await ticket.state.client.submit(phase_request(req, engine_pb2.DISAGG_PHASE_PREFILL, target))
            except InstanceUnavailableError as exc:
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

    async def resume(self, model: str, req: engine_pb2.GenerateRequest, generated: list[int], sent_chars: int,
                     failed: set[str], attempt: int = 1) -> tuple[Ticket, engine_pb2.GenerateRequest, object]:
        """Continue ``req`` elsewhere after the client received ``generated`` tokens and the first
        ``sent_chars`` characters of their text: its prompt plus those tokens, marked as earlier
        output (``resumed_output_tokens``, ``resumed_sent_chars``: the instance replays them, so
        max_tokens, penalties, stop strings and held-back text continue exactly).

        The continuation runs under its own id, ``<id>#<attempt>``: an instance may still hold what
        is left of the earlier attempt (a decode instance whose prefill partner died keeps the
        abandoned reservation until the hand-off ends, and the abort of the broken call can arrive
        late), and the two must never be taken for one another."""
        cont = continuation(req, generated, sent_chars, attempt)
        ticket, streams = await self._place(model, list(cont.prompt_token_ids), [cont], None, failed)
        return ticket, cont, streams[0]


class RoutedStream:
    """The chunks of one request as the client sees them, across instance failures and moves.

    Iterating it yields the instance's chunks; if the instance breaks the stream off
    (``InstanceUnavailableError``) the request is resumed on another instance and the chunks
    continue exactly as one run would have produced them (the final chunk's usage counts the
    whole request). A request that was a suspect in ``max_crash_strikes`` crashes (it was running
    when an engine crashed, in the failing step or on an instance that vanished) is failed with
    an internal error instead of being replayed on yet another instance. A draining instance's
    move offer moves the request with its KV or by recompute (:mod:`xllm.gateway.moves`), the
    same way unseen by the client; so does the offer the gateway makes itself when the request's
    decode instance flips to prefill. Each chunk's gap to the previous one of the same instance
    is a TPOT sample of that instance (``Router.latency``). Leaving early closes the underlying
    stream (the engine aborts the request).
    """

    def __init__(self, dispatcher: Dispatcher, model: str, ticket: Ticket, req: engine_pb2.GenerateRequest,
                 stream) -> None:
        self._d = dispatcher
        self._model = model
        self._ticket = ticket
        self._req = req
        self._stream = stream
        self._instance_request_id = req.request_id  # the id it runs under on its instance
        self.request_id = req.request_id
        self.resumes = 0
        self.moves = 0
        self.crash_strikes = 0
        self._attempts = 0  # continuations named so far (<id>#<n>: each n once, moves that never happened too)

    @property
    def instance_id(self) -> str:
        return self._ticket.state.instance_id

    async def __aiter__(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        d, req = self._d, self._req
        generated: list[int] = []   # every token streamed so far, across instances
        sent_chars = 0              # characters of text streamed so far
        failed: set[str] = set()
        moved: tuple[str, float] | None = None  # how the request last moved, and its last chunk's time before
        last_chunk = 0.0
        while True:
            ticket, got_first, accounted = self._ticket, False, False
            inner = aiter(self._stream)
            migration: Migration | None = None
            recompute: Recompute | None = None
            then = ""  # how the stream goes on once this one ended: "migrated" or "recompute"
            handed_over = False  # offered to move for a role flip of its instance (once per placement)
            token_chunks = 0     # chunks with tokens from this placement (TPOT: the gaps from the second on)
            try:
                async for chunk in inner:
                    if chunk.HasField("move_offer"):
                        if migration is not None:  # already moving (handed over for a role flip)
                            continue
                        plan = self._offer(ticket, generated, sent_chars, chunk.move_offer)
                        if isinstance(plan, Migration):
                            migration = plan
                        elif isinstance(plan, Recompute):
                            recompute, then = plan, "recompute"
                            break
                        continue
                    if migration is not None and chunk.finish_reason == HANDED_OFF:
                        then = "migrated"
                        break
                    if migration is not None and migration.failure:
                        log.warning("request %s: migrating off %s failed (%s); recomputing elsewhere",
                                    req.request_id, ticket.state.instance_id, migration.failure)
                        d.mover.metrics.moved(self._model, "migration_failed")
                        then = "recompute"
                        break
                    if not got_first:
                        got_first = True
                        d.router.first_token(ticket)
                        d.router.succeeded(ticket.state)
                    if chunk.HasField("disagg_stats") and chunk.disagg_stats.transfer_bytes:
                        d.mover.observe_transfer(chunk.disagg_stats)
                    now = time.monotonic()
                    if chunk.token_ids:
                        token_chunks += 1
                        if token_chunks > 2:  # not the gap to the first chunk nor, in PD, the hand-off's
                            d.router.latency.tpot(ticket.state.instance_id, (now - last_chunk) / len(chunk.token_ids))
                    last_chunk = now
                    if moved is not None:
                        d.mover.metrics.paused(self._model, moved[0], last_chunk - moved[1])
                        moved = None
                    chunk.request_id = req.request_id  # a continuation's chunks too (it runs as <id>#<n>)
                    generated.extend(chunk.token_ids)
                    sent_chars += len(chunk.text)
                    yield chunk
                    if chunk.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                        return
                    if migration is None and not handed_over and self._handing_over(ticket):
                        handed_over = True  # its decode instance flips to prefill: moved as a draining one's are
                        plan = self._offer(ticket, generated, sent_chars, d.mover.handover_offer(
                            len(self._req.prompt_token_ids) + len(generated), ticket.state))
                        if isinstance(plan, Migration):
                            migration = plan
                        elif isinstance(plan, Recompute):
                            recompute, then = plan, "recompute"
                            break
                if not then:
                    return
            except InstanceUnavailableError as exc:
                if exc.instance_id and exc.instance_id != ticket.state.instance_id:
                    failed.add(exc.instance_id)  # another part of a PD pair (accounted there)
                else:
                    d.router.failed(ticket.state)
                    failed.add(ticket.state.instance_id)
                self.crash_strikes += exc.suspect
                if self.crash_strikes >= d.max_crash_strikes:
                    log.error("request %s failed: it was running when %d instances failed (%s); not replayed",
                              req.request_id, self.crash_strikes, ", ".join(sorted(failed)))
                    if d.router.metrics is not None:
                        d.router.metrics.poisoned(self._model)
                    raise RequestFailedError(f"the request was running on {self.crash_strikes} instances that "
                                             "failed; it is not retried") from exc
                if self.resumes >= d.max_resumes:
                    raise
                log.warning("request %s: %s; resuming after %d token(s) on another instance", req.request_id,
                            exc, len(generated))
                d.router.finished(ticket, got_first)
                accounted = True
                await self._continue(generated, sent_chars, failed)
                self.resumes += 1
                if d.router.metrics is not None:
                    d.router.metrics.resumed(self._model, ticket.state.instance_id)
                moved = ("resumed", last_chunk)
                continue
            finally:
                if migration is not None and then != "migrated":
                    await migration.cancel()
                with contextlib.suppress(Exception):
                    await inner.aclose()
                if not accounted:
                    d.router.finished(ticket, got_first)
            self.moves += 1
            if then == "migrated":
                self._ticket, self._stream = migration.ticket, await migration.destination()
                self._instance_request_id = migration.cont.request_id
            else:
                try:
                    await self._continue(generated, sent_chars, failed | {ticket.state.instance_id})
                finally:
                    if recompute is not None:
                        recompute.release()
                then = "recomputed"
            d.mover.metrics.moved(self._model, then)
            moved = (then, last_chunk)

    def _handing_over(self, ticket: Ticket) -> bool:
        """Whether the request must leave its instance for a role flip (decode to prefill): it
        decodes there (a PD request once its decode side streams) and moves are on."""
        flip = ticket.state.flip
        return (flip is not None and flip.to_role == "prefill" and self._d.mover.enabled
                and (not isinstance(self._stream, PDStream) or self._stream.decoding))

    def _offer(self, source: Ticket, generated: list[int], sent_chars: int,
               offer: engine_pb2.MoveOffer) -> Migration | Recompute | None:
        cont = continuation(self._req, generated, sent_chars, self._next_attempt())
        return self._d.mover.offer(self._model, source, self._instance_request_id, cont, offer)

    def _next_attempt(self) -> int:
        self._attempts += 1
        return self._attempts

    async def _continue(self, generated: list[int], sent_chars: int, exclude: set[str]) -> None:
        """Resume the request elsewhere by recompute (after a failure or for a move)."""
        self._ticket, cont, self._stream = await self._d.resume(self._model, self._req, generated, sent_chars,
                                                                exclude, attempt=self._next_attempt())
        self._instance_request_id = cont.request_id

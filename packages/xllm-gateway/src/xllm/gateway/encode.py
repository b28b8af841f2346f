"""The E of EPD at the gateway: a request's images encoded on other instances before its prefill (xLLM §3.3).

With ``--epd-strategy e+p+d`` (encode instances: ``xllm engine --role encode``) or ``ed+p`` (the decode
instances), the dispatcher hands a request with images to :class:`EncodeStage` before placing it: the stage
sends the images to one live instance of that role (``EngineService.Encode``; the fewest encodes this gateway
has in flight there first) and attaches each image's embeddings (float32 values, CRC-32, the weights identity)
to the request, for every choice of it. The instance that prefills uses them instead of its vision tower; it
checks them first and encodes an image itself when its embedding fails a check
(:func:`xllm.core.images.given_embedding`), so a bad hand-off costs time, never a wrong token. The embeddings
stay with the request: a stream resumed elsewhere carries them.

Failure rules, as for KV hand-offs: an instance that is unreachable, dies mid-encode or answers late
(``--encode-timeout``) is marked failed with the router (its circuit breaker) and, as one that is overloaded
or fails the call, passed over for the next one, up to
``attempts``; when none answers, or none of the role is live, the request goes on without embeddings and the
prefill instance encodes its images (``xllm:epd_encode_fallbacks``, by reason). An instance that refuses the
images (malformed) makes the request a 400 naming ``images``, as its prefill instance would. ``ep+d`` (the
default) passes requests through: the prefill instance encodes them in its encode phase
(:mod:`xllm.sched.encode`). ``auto`` picks one of the three per model from live measurements
(:mod:`xllm.gateway.epd_auto`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from xllm.engine_api.errors import EngineError, InvalidRequestError
from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.epd_auto import EPDChooser
from xllm.gateway.openai.errors import to_api_error
from xllm.gateway.registry import InstanceState
from xllm.gateway.router import Router
from xllm.gateway.tracing import NO_SPANS, RequestSpans
from xllm.proto.engine.v1 import engine_pb2
from xllm.sched.epd import EP_D, EPDStrategy

log = logging.getLogger(__name__)

ENCODE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class EPDOptions:
    """``--epd-strategy`` (an :class:`~xllm.sched.epd.EPDStrategy`; None: ``auto``, the profiler's choice from
    live measurements against ``slo_ttft_s`` / ``slo_tpot_s``, :mod:`xllm.gateway.epd_auto`), ``--encode-timeout``
    (seconds one encode call may take), ``attempts``: instances tried before the prefill instance encodes."""

    strategy: EPDStrategy | None = field(default_factory=lambda: EP_D)
    timeout_s: float = 30.0
    attempts: int = 2
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None

    def __post_init__(self) -> None:
        if self.strategy is None and (self.slo_ttft_s is None or self.slo_tpot_s is None):
            raise ValueError("--epd-strategy auto needs --slo-ttft-ms and --slo-tpot-ms (it picks by them)")


class EncodeMetrics:
    """What the encode stage did, per model: encodes per instance, their time and the embedding bytes they
    returned, and the requests whose images were left to the prefill instance (by reason)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.encodes = Counter("xllm:epd_encodes", "Requests whose images an instance encoded for another one's "
                               "prefill (EPD: e+p+d, ed+p).", ["model_name", "instance"], registry=r)
        self.images = Counter("xllm:epd_encoded_images", "Images encoded for another instance's prefill.",
                              ["model_name"], registry=r)
        self.seconds = Histogram("xllm:epd_encode_seconds", "Encode calls as the gateway timed them (the vision "
                                 "tower, its queue and the embeddings' trip).", ["model_name"],
                                 buckets=ENCODE_BUCKETS, registry=r)
        self.bytes = Counter("xllm:epd_embedding_bytes", "Image embedding bytes handed to prefill instances.",
                             ["model_name"], registry=r)
        self.fallbacks = Counter("xllm:epd_encode_fallbacks", "Requests whose images the prefill instance "
                                 "encoded because no encode call answered (no_instance, failed).",
                                 ["model_name", "reason"], registry=r)


class EncodeStage:
    """Encodes requests' images on the instances the strategy names (see the module docstring)."""

    def __init__(self, router: Router, options: EPDOptions | None = None, metrics: EncodeMetrics | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        """``registry``: where ``auto``'s gauge goes (the metrics' registry)."""
        self.router = router
        self.options = opts = options or EPDOptions()
        self.metrics = metrics or EncodeMetrics()
        self.chooser = None if opts.strategy is not None else EPDChooser(router, opts.slo_ttft_s, opts.slo_tpot_s,
                                                                         registry)
        self._inflight: dict[str, int] = {}  # instance id -> encode calls in flight from this gateway

    def strategy_for(self, model: str, req: engine_pb2.GenerateRequest) -> EPDStrategy:
        """The strategy for ``req`` (with ``auto``: the chooser's, ``req`` counted in its workload window)."""
        if self.chooser is None:
            assert self.options.strategy is not None
            return self.options.strategy
        self.chooser.observe(model, len(req.images), len(req.prompt_token_ids), req.sampling.max_tokens)
        return self.chooser.strategy(model)

    async def attach(self, model: str, reqs: Sequence[engine_pb2.GenerateRequest],
                     spans: RequestSpans = NO_SPANS) -> bool:
        """Encode the images of ``reqs`` (the choices of one request: the same images) on an instance of the
        strategy's role and attach the embeddings to every choice; whether they were attached (False: the
        prefill instance encodes them). Raises an ``APIError`` when the images are refused."""
        if not reqs:
            return False
        role = self.strategy_for(model, reqs[0]).encode_role
        if role is None or not reqs[0].images:
            return False
        images = list(reqs[0].images)
        request_id = reqs[0].request_id
        tried: set[str] = set()
        reason = "no_instance"
        for _ in range(self.options.attempts):
            state = self._pick(model, role, tried)
            if state is None:
                break
            tried.add(state.instance_id)
            with spans.phase("encode", **{"xllm.encode.instance": state.instance_id,
                                          "xllm.encode.images": len(images)}):
                got = await self._encode(model, state, images, request_id)
            if got is not None:
                for req in reqs:
                    for image, embedding in zip(req.images, got, strict=True):
                        image.embedding.CopyFrom(embedding)
                return True
            reason = "failed"
        self.metrics.fallbacks.labels(model, reason).inc()
        log.info("request %s: no encode instance answered (%s, tried %s): its prefill instance encodes the images",
                 request_id, reason, sorted(tried) or "none")
        return False

    def _pick(self, model: str, role: str, tried: set[str]) -> InstanceState | None:
        """The live instance of ``role`` with the fewest encodes in flight from here (ties: instance id)."""
        live = [s for s in self.router.registry.routable(model)
                if s.role == role and s.flip is None and s.instance_id not in tried]
        if not live:
            return None
        return min(live, key=lambda s: (self._inflight.get(s.instance_id, 0), s.instance_id))

    async def _encode(self, model: str, state: InstanceState, images: list[engine_pb2.ImageInput],
                      request_id: str) -> list[engine_pb2.ImageEmbedding] | None:
        """The embeddings ``state`` computed, or None when it could not answer (marked failed)."""
        iid = state.instance_id
        self._inflight[iid] = self._inflight.get(iid, 0) + 1
        t0 = time.monotonic()
        try:
            answer = await state.client.encode(engine_pb2.EncodeRequest(images=images, request_id=request_id),
                                               self.options.timeout_s)
        except InvalidRequestError as exc:  # the images themselves (the prefill instance would refuse them too)
            raise to_api_error(exc) from exc
        except EngineError as exc:  # unreachable, died, late, overloaded or failed: the next one, or the fallback
            log.warning("request %s: encode instance %s failed (%s)", request_id, iid, exc)
            if isinstance(exc, InstanceUnavailableError):
                self.router.failed(state)
            return None
        finally:
            self._inflight[iid] -= 1
            if not self._inflight[iid]:
                del self._inflight[iid]
        if len(answer.embeddings) != len(images):
            log.warning("request %s: encode instance %s answered %d embeddings for %d images", request_id, iid,
                        len(answer.embeddings), len(images))
            return None
        self.router.succeeded(state)
        self.metrics.encodes.labels(model, iid).inc()
        self.metrics.images.labels(model).inc(len(images))
        self.metrics.seconds.labels(model).observe(time.monotonic() - t0)
        self.metrics.bytes.labels(model).inc(sum(len(e.values) for e in answer.embeddings))
        return list(answer.embeddings)

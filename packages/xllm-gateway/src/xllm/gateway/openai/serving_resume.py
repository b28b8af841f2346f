"""``GET /v1/streams/{stream_id}``: the rest of a stream whose connection broke (its gateway died).

Any gateway of the cluster serves it: the stream id (:mod:`xllm.gateway.openai.stream_ids`) says how to
format the stream, the engine requests ``<stream id>-<k>`` of its choices are found by asking the live
instances of its model (``EngineService.Reattach``: only the instance that kept a detached request
accepts it), each is replayed from its first token through a fresh formatter (so usage and every
choice's state are exactly the first gateway's), and only what follows the client's ``Last-Event-ID``
is sent: every character once, the same chunk format, then the usage chunk when asked for and
``[DONE]``. A stream that finished and was delivered, was aborted, or whose grace period ended (the
engine's ``--detached-grace-s``) is a 404 naming the stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from fastapi.responses import StreamingResponse

from xllm.engine_api.errors import EngineError
from xllm.gateway.openai.errors import APIError, model_not_found
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from xllm.gateway.openai.serving import INSTANCE_HEADER, sse_stream
from xllm.gateway.openai.serving_chat import _ChatStream
from xllm.gateway.openai.serving_completion import _CompletionStream
from xllm.gateway.openai.stream_ids import StreamSeal, StreamTicket, parse_last_event_id
from xllm.gateway.registry import Registry
from xllm.models.tokenizer import Tokenizer


class ResumeServing:
    """Resumes streams whose ids ``seal`` issued (this gateway's or, with a cluster token, any's)."""

    def __init__(self, registry: Registry, tokenizers: Mapping[str, Tokenizer], seal: StreamSeal) -> None:
        """``tokenizers``: each served model's (a stream is detokenized with its own model's)."""
        self.registry = registry
        self.tokenizers = tokenizers
        self.seal = seal

    def _format(self, t: StreamTicket):
        """A formatter in the state the stream's first one started in (resumable streams have no
        logprobs, echo nor tools, so the ticket says all it needs)."""
        options = StreamOptions(include_usage=t.include_usage, continuous_usage_stats=t.continuous_usage)
        if t.prefix == "chatcmpl":
            req = ChatCompletionRequest.model_construct(n=t.per_prompt, logprobs=False, stream_options=options)
            return _ChatStream(req, self.tokenizers[t.model], t.prompt_tokens[0], t.choices)
        req = CompletionRequest.model_construct(n=t.per_prompt, logprobs=None, echo=False, prompt_logprobs=None,
                                                stream_options=options)
        lens = [n for n in t.prompt_tokens for _ in range(t.per_prompt)]
        return _CompletionStream(req, self.tokenizers[t.model], sum(t.prompt_tokens), [""] * t.choices, lens,
                                 [[] for _ in lens])

    async def _reattach(self, t: StreamTicket, request_id: str):
        """The replayed stream of one choice's detached request, from whichever instance kept it."""
        for client in self.registry.instances(t.model):
            reattach = getattr(client, "reattach", None)
            if reattach is None:
                continue
            with contextlib.suppress(LookupError, EngineError):  # not there (or unreachable): the next one
                return client.info.instance_id, await reattach(request_id, 0)
        return None

    async def resume(self, stream_id: str, last_event_id: str | None) -> StreamingResponse:
        """The rest of stream ``stream_id`` after ``last_event_id`` (404: unknown, over or expired)."""
        t = self.seal.open(stream_id)
        if t.model not in self.tokenizers:  # a stream of a model this gateway does not serve
            raise model_not_found(t.model)
        received = parse_last_event_id(stream_id, last_event_id, t.choices)
        found = []
        try:
            for k in range(t.choices):
                got = await self._reattach(t, f"{stream_id}-{k}")
                if got is None:
                    raise APIError(404, f"stream {stream_id[:200]!r} is over or was not kept (its grace period "
                                   "ended)", "not_found_error", "stream_id", "stream_not_found")
                found.append(got)
        except BaseException:
            for _, stream in found:
                stream.release()  # kept on its instance for another try (a broken Reattach detaches it again)
            raise
        body = sse_stream(self._format(t), stream_id, t.model, t.created, t.include_usage,
                          [stream for _, stream in found], t.service_tier, received=received)
        return StreamingResponse(body, media_type="text/event-stream", headers={INSTANCE_HEADER: found[0][0]})

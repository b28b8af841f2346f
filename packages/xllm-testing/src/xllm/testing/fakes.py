"""A scripted engine client, so the gateway can be tested without a model or a server process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.kvstore.v1 import kv_events_pb2
from xllm.proto.registry.v1 import instance_pb2

FAKE_MODEL = "fake-model"
FAKE_MAX_LEN = 128


def make_info(instance_id: str = "fake-0", model: str = FAKE_MODEL,
              max_model_len: int = FAKE_MAX_LEN) -> instance_pb2.InstanceInfo:
    return instance_pb2.InstanceInfo(instance_id=instance_id, role=instance_pb2.INSTANCE_ROLE_MIXED,
                                     model=instance_pb2.ModelInfo(served_name=model, max_model_len=max_model_len))


class FakeEngineClient:
    """A scripted :class:`xllm.engine_api.client.EngineClient`: emits ``tokens`` (cycled) up to
    ``max_tokens``, one token per chunk.

    ``submit_error`` is raised by ``submit``; ``stream_error`` is raised after ``error_after`` chunks.
    Records every submitted request and every request whose stream was left before its final chunk.
    """

    def __init__(self, tokenizer, tokens: list[int], info: instance_pb2.InstanceInfo | None = None) -> None:
        self.info = info or make_info()
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.submitted: list[engine_pb2.GenerateRequest] = []
        self.abandoned: list[str] = []
        self.aborted: list[str] = []
        self.submit_error: BaseException | None = None
        self.stream_error: BaseException | None = None
        self.error_after = 0
        self.chunk_delay = 0.0
        self.healthy = True
        self.load_report = instance_pb2.LoadReport(instance_id=self.info.instance_id)
        self.kv_event_requests: list[tuple[int, int, bool]] = []
        self.closed = False
        self.lora_requests: list[tuple[str, str]] = []  # (name, path) of each load ("": unload)

    def output_ids(self, n: int) -> list[int]:
        return [self.tokens[k % len(self.tokens)] for k in range(n)]

    async def submit(self, req: engine_pb2.GenerateRequest,
                     trace: dict[str, str] | None = None) -> AsyncIterator[engine_pb2.GenerateResponse]:
        if self.submit_error is not None:
            raise self.submit_error
        self.submitted.append(req)
        return self._generate(req)

    async def _generate(self, req: engine_pb2.GenerateRequest) -> AsyncIterator[engine_pb2.GenerateResponse]:
        n = req.sampling.max_tokens
        ids = self.output_ids(n)
        finished = False
        try:
            for k, tok in enumerate(ids):
                if self.stream_error is not None and k == self.error_after:
                    finished = True
                    raise self.stream_error
                await asyncio.sleep(self.chunk_delay)
                chunk = engine_pb2.GenerateResponse(request_id=req.request_id, token_ids=[tok],
                                                    text=self.tokenizer.decode([tok]))
                if req.sampling.logprobs:
                    lp = chunk.logprobs.add(token_id=tok, logprob=-0.5)
                    for j in range(req.sampling.top_logprobs):
                        lp.top.add(token_id=tok if j == 0 else self.tokens[(j + 1) % len(self.tokens)],
                                   logprob=-0.5 - j)
                if k == n - 1:
                    finished = True
                    chunk.finish_reason = engine_pb2.FINISH_REASON_LENGTH
                    chunk.usage.prompt_tokens = len(req.prompt_token_ids)
                    chunk.usage.completion_tokens = n
                yield chunk
        finally:
            if not finished:
                self.abandoned.append(req.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def load_lora(self, name: str, path: str) -> engine_pb2.LoadLoraResponse:
        self.lora_requests.append((name, path))
        return engine_pb2.LoadLoraResponse(ok=False, error="this scripted engine serves no LoRA adapters",
                                           param="lora_path")

    async def control(self, req: engine_pb2.ControlRequest) -> engine_pb2.ControlResponse:
        """A scripted engine neither sleeps nor updates weights (it only says it is awake)."""
        if req.action == engine_pb2.CONTROL_ACTION_IS_SLEEPING:
            return engine_pb2.ControlResponse(ok=True)
        return engine_pb2.ControlResponse(ok=False, error="this scripted engine neither sleeps nor updates weights",
                                          param="model")

    async def embed(self, req: engine_pb2.EmbedRequest) -> engine_pb2.EmbedResponse:
        """A scripted embedding: the prompt's length and token sum (and the pooling's name length)."""
        ids = list(req.prompt_token_ids)
        return engine_pb2.EmbedResponse(embedding=[float(len(ids)), float(sum(ids)), float(len(req.pooling))])

    async def encode(self, req: engine_pb2.EncodeRequest, timeout: float) -> engine_pb2.EncodeResponse:
        """A scripted engine takes no images."""
        raise InvalidRequestError("this scripted engine takes no images", "images")

    async def health(self) -> engine_pb2.HealthResponse:
        return engine_pb2.HealthResponse(healthy=self.healthy, status="ok" if self.healthy else "broken")

    async def load(self) -> instance_pb2.LoadReport:
        return self.load_report

    async def kv_events(self, since_version: int, epoch: int, snapshot: bool = False) -> kv_events_pb2.KVCacheEvents:
        self.kv_event_requests.append((since_version, epoch, snapshot))
        return kv_events_pb2.KVCacheEvents(instance_id=self.info.instance_id)

    async def close(self) -> None:
        self.closed = True

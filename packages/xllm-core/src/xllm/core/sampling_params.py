"""Engine-side sampling parameters, built from the ``SamplingParams`` proto and checked against
the API bounds (:mod:`xllm.engine_api.bounds`). The sizes of the proto's repeated fields (stop
strings, stop ids, ``logit_bias``, the output constraint) are checked before it is converted here
(:func:`xllm.core.validation.check_sizes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from xllm.engine_api.bounds import MAX_BEAM_WIDTH, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, MIN_TEMPERATURE
from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2


@dataclass(frozen=True)
class SamplingParams:
    """Validated per-request sampling and stopping settings (OpenAI semantics)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # the prompt's logprobs with this many alternatives (None: not asked)
    # beam search (xllm.core.beam): deterministic, HF generate(num_beams) semantics; None: not a beam request
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    item_catalog: bool = False  # decode only items of the engine's catalogue (beam search over it)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a finite number", name)
        if any(not math.isfinite(v) for v in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be finite numbers", "logit_bias")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0 <= self.temperature <= 100:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables), got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                                      f"{self.repetition_penalty}", "repetition_penalty")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})",
                                      "min_tokens")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "prompt_logprobs")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if self.beam_width is not None or self.item_catalog:
            self._check_beam()

    def _check_beam(self) -> None:
        """What beam search supports: deterministic scoring of the model's log-probabilities (no
        sampling, penalties, biases, stop strings or per-token logprobs), as HF's num_beams search."""
        if self.beam_width is None:
            raise InvalidRequestError("item_catalog decoding is a beam search: set beam_width", "beam_width")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidRequestError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}",
                                      "beam_width")
        if not math.isfinite(self.length_penalty):
            raise InvalidRequestError("length_penalty must be a finite number", "length_penalty")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}",
                                      "early_stopping")
        unsupported = {
            "temperature": self.temperature != 0.0,
            "top_p": self.top_p != 1.0, "min_p": self.min_p != 0.0,
            "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0, "logit_bias": bool(self.logit_bias),
            "stop": bool(self.stop), "logprobs": self.logprobs or self.top_logprobs > 0,
            "prompt_logprobs": self.prompt_logprobs is not None,
        }
        for name, bad in unsupported.items():
            if bad:
                raise InvalidRequestError(f"{name} is not supported with beam search (deterministic: the beams "
                                          "score the model's log-probabilities)", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @classmethod
    def from_proto(cls, msg: engine_pb2.SamplingParams) -> SamplingParams:
        def opt(name: str, default):
            return getattr(msg, name) if msg.HasField(name) else default

        return cls(
            max_tokens=int(msg.max_tokens),
            temperature=float(opt("temperature", 0.0 if msg.HasField("beam_width") else 1.0)),
            top_p=float(opt("top_p", 1.0)),
            top_k=int(opt("top_k", 0)),
            min_p=float(opt("min_p", 0.0)),
            presence_penalty=float(opt("presence_penalty", 0.0)),
            frequency_penalty=float(opt("frequency_penalty", 0.0)),
            repetition_penalty=float(opt("repetition_penalty", 1.0)),
            seed=int(msg.seed) if msg.HasField("seed") else None,
            min_tokens=int(msg.min_tokens),
            stop=tuple(msg.stop),
            stop_token_ids=frozenset(int(t) for t in msg.stop_token_ids),
            ignore_eos=bool(msg.ignore_eos),
            logprobs=bool(msg.logprobs),
            top_logprobs=int(msg.top_logprobs),
            logit_bias={int(k): float(v) for k, v in msg.logit_bias.items()},
            include_stop_str_in_output=bool(msg.include_stop_str_in_output),
            skip_special_tokens=bool(opt("skip_special_tokens", True)),
            prompt_logprobs=int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None,
            beam_width=int(msg.beam_width) if msg.HasField("beam_width") else None,
            length_penalty=float(opt("length_penalty", 1.0)),
            early_stopping=_EARLY_STOPPING.get(msg.early_stopping, msg.early_stopping),
            item_catalog=bool(msg.item_catalog),
        )


_EARLY_STOPPING: dict[str, bool | str] = {"": False, "false": False, "true": True, "never": "never"}

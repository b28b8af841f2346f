"""The API bounds of a request, defined once: what the engine accepts
(:class:`xllm.core.sampling_params.SamplingParams` and :class:`xllm.core.validation.RequestLimits`
check them) and what the gateway refuses with a 400 before it submits
(:class:`xllm.gateway.openai.limits.ApiLimits` takes its defaults from here).

It also derives the largest protobuf message each kind of ``EngineService`` call can need from
those bounds (:func:`generate_message_bytes`, :func:`kv_message_bytes`): the engine service refuses
anything larger before it parses it (:mod:`xllm.engine.intake`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MAX_TOP_LOGPROBS = 20
MIN_TEMPERATURE = 1e-2  # a positive temperature below this is raised to it (vLLM's floor): 1/T overflows below
MAX_REPETITION_PENALTY = 100.0
MAX_BEAM_WIDTH = 1024  # beams of one request (xllm.core.beam; xLLM's recommendation design goes to 512)

# Request limits the gateway applies (ApiLimits' defaults) and the engine applies again (RequestBounds)
MAX_STOP = 16                 # stop strings of a request
MAX_STOP_CHARS = 256          # characters of one stop string
MAX_STOP_TOKEN_IDS = 256      # stop token ids of a request
MAX_LOGIT_BIAS = 300          # logit_bias entries of a request
MAX_PROMPT_CHARS = 1_000_000  # characters before tokenization; also bounds an output constraint (grammar)

# The largest KV hand-off payload of one KVPages message (TransferKV): a sender splits a (layer, K|V) range's
# pages into messages of at most this many bytes (one page at least), so a message's size does not grow
# with the prompt's length.
KV_MESSAGE_BYTES = 4 << 20

# Protobuf framing allowances, generous upper bounds (bytes)
_FIXED = 64 << 10        # every scalar and short string of a message (ids, model name, KV target, layout)
_PER_TOKEN = 5           # a non-negative int32 varint (packed)
_PER_ID = 11             # an int32 varint of any sign (negative ones take 10 bytes) and its share of framing
_PER_STRING = 6          # a string's tag and length varint
_PER_BIAS_ENTRY = 20     # a map<int32, float> entry: tag, length, key (any sign), value
_PER_UTF8_CHAR = 4       # bytes of one character in UTF-8
_PER_IMAGE = 128         # an ImageInput's framing, grid and content hash


@dataclass(frozen=True)
class RequestBounds:
    """What one request may ask of an engine beyond its context length (the engine's own
    :class:`~xllm.core.validation.RequestLimits` add ``max_model_len`` and the KV capacity).

    - ``max_stop`` stop strings of at most ``max_stop_chars`` characters each;
    - ``max_stop_token_ids`` stop token ids; ``max_logit_bias`` ``logit_bias`` entries;
    - ``max_grammar_chars``: characters of an output constraint (a JSON schema's text, a regex, a
      grammar, or the choices of a ``choice`` constraint with 4 more per choice: what their JSON array,
      which the gateway counts, holds at least).

    Defaults are the gateway's defaults (:class:`~xllm.gateway.openai.limits.ApiLimits`); logprobs
    and beam widths are bounded by :data:`MAX_TOP_LOGPROBS` and :data:`MAX_BEAM_WIDTH`.
    """

    max_stop: int = MAX_STOP
    max_stop_chars: int = MAX_STOP_CHARS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_logit_bias: int = MAX_LOGIT_BIAS
    max_grammar_chars: int = MAX_PROMPT_CHARS

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class GenerateAllowance:
    """The bytes each part of a valid serialized ``GenerateRequest`` can take (generous upper bounds,
    :func:`generate_allowance`), and the counts that bound its repeated fields: the engine checks a
    message's parts against them before it parses it (:mod:`xllm.engine.intake`)."""

    prompt: int            # the packed prompt_token_ids
    stop: int              # one stop string
    stop_token_ids: int    # the packed stop ids
    logit_bias_entry: int  # one logit_bias entry
    constraint: int        # the StructuredOutput
    max_stop: int
    max_logit_bias: int
    fixed: int = _FIXED    # every other field of a message, together
    images: int = 0        # the images of a multimodal model's request, together (0: a text model)

    @property
    def sampling(self) -> int:
        return (self.fixed + self.max_stop * self.stop + self.stop_token_ids
                + self.max_logit_bias * self.logit_bias_entry + self.constraint)

    @property
    def total(self) -> int:
        return self.fixed + self.prompt + self.sampling + self.images


def generate_allowance(max_model_len: int, bounds: RequestBounds | None = None,
                       image_token_bytes: int = 0) -> GenerateAllowance:
    """What a request within ``bounds`` and a context of ``max_model_len`` tokens can need: its prompt
    (a resumed request's earlier output included, which also fits the context), stop strings and ids,
    ``logit_bias`` and output constraint, plus a fixed allowance for everything else; with a multimodal
    model (``image_token_bytes``: the pixel bytes behind one image token), its images: their tokens fit the
    context too, each image at least one (so its framing, grid and hash count per token)."""
    bounds = bounds or RequestBounds()
    return GenerateAllowance(
        prompt=_PER_STRING + _PER_TOKEN * max_model_len,
        stop=_PER_STRING + _PER_UTF8_CHAR * bounds.max_stop_chars,
        stop_token_ids=_PER_STRING + _PER_ID * bounds.max_stop_token_ids,
        logit_bias_entry=_PER_BIAS_ENTRY,
        # a string: 4 bytes a character; a choice: 4 a character and 6 a string, with characters + 4 * strings
        # <= max_grammar_chars (so at most 4 bytes a counted character too)
        constraint=_FIXED + _PER_UTF8_CHAR * bounds.max_grammar_chars,
        max_stop=bounds.max_stop, max_logit_bias=bounds.max_logit_bias,
        images=_FIXED + (image_token_bytes + _PER_IMAGE) * max_model_len if image_token_bytes > 0 else 0)


def generate_message_bytes(max_model_len: int, bounds: RequestBounds | None = None) -> int:
    """The largest serialized ``GenerateRequest`` a request within ``bounds`` and a context of
    ``max_model_len`` tokens can need (:func:`generate_allowance`): a larger message cannot be a valid
    request."""
    return generate_allowance(max_model_len, bounds).total


def kv_message_bytes(max_model_len: int, block_size: int, page_bytes: tuple[int, ...] | list[int]) -> int:
    """The largest serialized ``KVTransferMessage`` of a hand-off to an engine whose KV layout has
    these per-range ``page_bytes`` (0 without KV to receive): a ``KVPages`` of at most
    :data:`KV_MESSAGE_BYTES` (one page at least), or a ``KVCommit`` naming every block of a
    ``max_model_len`` context (CRCs, store hashes) and a migration's appended tokens."""
    blocks = -(-max_model_len // block_size)
    pages = max(KV_MESSAGE_BYTES, max(page_bytes, default=0))
    commit = blocks * (_PER_TOKEN + 9) + _PER_TOKEN * max_model_len  # uint32 CRC + fixed64 hash per block
    return _FIXED + max(pages, commit)

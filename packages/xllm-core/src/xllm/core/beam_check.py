"""What the engine checks of a beam request, and loading its item catalogue (xllm.core.beam)."""

from __future__ import annotations

import logging
import time

from xllm.core.sampling_params import SamplingParams
from xllm.engine_api.errors import ConfigError, InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2
from xllm.recsys.catalog import ItemCatalog

log = logging.getLogger(__name__)


def load_catalog(path: str, vocab_size: int) -> ItemCatalog:
    """The ``--item-catalog`` file as a trie; a bad file or a token outside the vocabulary is a
    :class:`ConfigError` naming it."""
    began = time.perf_counter()
    try:
        catalog = ItemCatalog.load(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if catalog.max_token >= vocab_size:
        raise ConfigError(f"item catalogue {path}: token {catalog.max_token} is outside the model's vocabulary "
                          f"of {vocab_size}")
    log.info("item catalogue %s: %d items of %d tokens, %.1f MB, loaded in %.2f s", path, catalog.num_items,
             catalog.item_len, catalog.nbytes / 1e6, time.perf_counter() - began)
    return catalog


def check_beam_request(params: SamplingParams, prefill_side: bool, req: engine_pb2.GenerateRequest,
                       catalog: ItemCatalog | None, max_model_len: int, capacity_tokens: int) -> None:
    """Refuse what this engine cannot beam-search (:class:`InvalidRequestError` naming the field): a
    grammar, a resumed search, a catalogue request without a catalogue, positions past the context,
    or beams' own KV beyond the KV capacity (it lives outside the page pool). The prefill side of a
    hand-off (``prefill_side``) computes the prompt only: the search, and so the catalogue and the
    beams' KV, are the decode side's."""
    if req.sampling.HasField("structured"):
        raise InvalidRequestError("beam search cannot be combined with structured output", "response_format")
    if req.resumed_output_tokens:
        raise InvalidRequestError("a beam search cannot be resumed", "resumed_output_tokens")
    if prefill_side:
        return
    steps = params.max_tokens
    if params.item_catalog:
        if catalog is None:
            raise InvalidRequestError("this engine has no item catalogue (start it with --item-catalog FILE)",
                                      "item_catalog")
        steps = catalog.item_len
        if len(req.prompt_token_ids) + steps > max_model_len:
            raise InvalidRequestError(f"the prompt ({len(req.prompt_token_ids)} tokens) plus an item "
                                      f"({steps} tokens) exceeds the context length {max_model_len}", "prompt")
    if params.beam_width * (steps - 1) > capacity_tokens:
        raise InvalidRequestError(f"beam_width ({params.beam_width}) x max_tokens ({steps}) exceeds the KV "
                                  f"capacity of {capacity_tokens} tokens", "beam_width")

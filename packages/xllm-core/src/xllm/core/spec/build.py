"""Building the engine's :class:`~xllm.core.spec.speculator.Speculator` from its config."""

from __future__ import annotations

import torch

from xllm.core.config import EngineConfig
from xllm.core.model_api import CausalLM
from xllm.core.model_runner import ModelRunner
from xllm.core.spec.base import ProposerContext
from xllm.core.spec.mtp import MTPProposer
from xllm.core.spec.speculator import Speculator
from xllm.engine_api.errors import ConfigError
from xllm.engine_api.names import PROPOSERS


def build_speculator(config: EngineConfig, max_model_len: int, device: torch.device, vocab_size: int,
                     draft_model: CausalLM | None = None, target: CausalLM | None = None,
                     runner: ModelRunner | None = None) -> Speculator:
    """The speculator ``config.speculative`` names (``draft``: over ``draft_model``, which the
    loader built from ``config.draft_model_path``; its vocabulary must be the target's. ``self`` and
    ``mtp``: from ``target``; ``mtp`` hears the target's hidden states from its ``runner``)."""
    if config.speculative == "draft":
        if draft_model is None:
            raise ConfigError("the draft proposer needs its draft model (--draft-model DIR)")
        if int(draft_model.vocab_size) != vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({int(draft_model.vocab_size)} tokens) is not the "
                              f"served model's ({vocab_size}): it needs the same tokenizer")
    if config.speculative == "mtp" and config.async_scheduling:
        raise ConfigError("--speculative mtp drafts from the previous step's hidden states, which an "
                          "asynchronous step has not landed yet: not with --async-scheduling")
    if config.speculative in ("self", "mtp") and target is None:
        raise ConfigError(f"the {config.speculative} proposer drafts from the served model: none was given")
    proposer = PROPOSERS.create(config.speculative,
                                ProposerContext(config, max_model_len, device, draft_model, target))
    if isinstance(proposer, MTPProposer):
        if runner is None:
            raise ConfigError("the mtp proposer needs the target's model runner (its hidden states)")
        runner.hidden_sink = proposer.on_target_hidden
    return Speculator(proposer, config.num_speculative_tokens, config.speculative_max_batch)

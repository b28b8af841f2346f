"""Architecture registry: ``config.json`` ``architectures[0]`` -> implementation.

Entries are ``module:Class`` strings imported on first use, so registering a
model costs nothing until it is served.
"""

from __future__ import annotations

import importlib

from xllm.models.config import ModelConfigError

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "xllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "xllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "xllm.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "xllm.models.qwen:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "xllm.models.qwen_moe:Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "xllm.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "xllm.models.deepseek:DeepseekV3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(architecture: str) -> type:
    """The model class for ``architecture``; raises :class:`ModelConfigError` naming
    the supported ones when it is unknown."""
    target = _ARCHITECTURES.get(architecture)
    if target is None:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)

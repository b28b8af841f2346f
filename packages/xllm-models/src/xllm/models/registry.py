"""Architecture registry: ``config.json`` ``architectures[0]`` -> implementation.

Entries are ``module:Class`` strings imported on first use, so registering a
model costs nothing until it is served.
"""

from __future__ import annotations

from xllm.common import NameRegistry, UnknownNameError
from xllm.models.config import ModelConfigError

ARCHITECTURES: NameRegistry[type] = NameRegistry("architecture", {
    "LlamaForCausalLM": "xllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "xllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "xllm.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "xllm.models.qwen:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "xllm.models.qwen_moe:Qwen3MoeForCausalLM",
    "Qwen2VLForConditionalGeneration": "xllm.models.qwen_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "xllm.models.qwen_vl:Qwen2_5_VLForConditionalGeneration",
    "LlavaForConditionalGeneration": "xllm.models.llava:LlavaForConditionalGeneration",
    "DeepseekV2ForCausalLM": "xllm.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "xllm.models.deepseek:DeepseekV3ForCausalLM",
})


def model_class(architecture: str) -> type:
    """The model class for ``architecture``; :class:`ModelConfigError` names the supported ones
    when it is unknown (a model directory's problem, reported like its other config errors)."""
    try:
        return ARCHITECTURES.get(architecture)
    except UnknownNameError:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None

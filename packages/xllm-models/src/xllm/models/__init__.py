"""Model definitions, weight loading and tokenizers of xLLM.

Public API:

- :func:`load_model`: build and load a model directory (file-order safetensors).
- :func:`resolve_model`: ``--model`` value -> model directory (bundled SmolLM2 and
  GGUF files are converted once into the cache).
- :class:`Tokenizer`: text <-> tokens and the chat template.
- :class:`ModelConfig`, :func:`supported_architectures`.
"""

from xllm.models.config import ModelConfig, ModelConfigError
from xllm.models.loader import load_model
from xllm.models.registry import model_class, supported_architectures
from xllm.models.source import DEFAULT_MODEL, ModelNotFoundError, cache_dir, resolve_model
from xllm.models.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "ChatTemplateError",
    "ModelConfig",
    "ModelConfigError",
    "ModelNotFoundError",
    "Tokenizer",
    "cache_dir",
    "load_model",
    "model_class",
    "resolve_model",
    "supported_architectures",
]

"""Model definitions, weight loading and tokenizers of xLLM.

Public API (imported on first use: the tokenizer, ``config.json`` reading and model-spec
resolution work without loading torch, which a cluster gateway relies on):

- :func:`load_model`: build and load a model directory (file-order safetensors).
- :func:`resolve_model`: ``--model`` value -> model directory (bundled SmolLM2 and
  GGUF files are converted once into the cache); :func:`served_name`: the name it is served as.
- :class:`Tokenizer`: text <-> tokens and the chat template.
- :class:`ModelConfig`, :data:`ARCHITECTURES` (architecture name -> implementation).
"""

from typing import TYPE_CHECKING

from xllm.common.lazy import lazy_exports

if TYPE_CHECKING:
    from xllm.models.config import ModelConfig, ModelConfigError
    from xllm.models.loader import load_model
    from xllm.models.registry import ARCHITECTURES, model_class
    from xllm.models.source import DEFAULT_MODEL, ModelNotFoundError, resolve_model, served_name
    from xllm.models.tokenizer import ChatTemplateError, Tokenizer

_EXPORTS = {
    "ModelConfig": "config", "ModelConfigError": "config",
    "load_model": "loader",
    "ARCHITECTURES": "registry", "model_class": "registry",
    "DEFAULT_MODEL": "source", "ModelNotFoundError": "source", "resolve_model": "source", "served_name": "source",
    "ChatTemplateError": "tokenizer", "Tokenizer": "tokenizer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

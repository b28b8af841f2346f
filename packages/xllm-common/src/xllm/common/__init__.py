"""What every xLLM package shares (no torch, no third-party imports).

- :class:`NameRegistry`: names -> implementations imported on first use (every name table).
- :func:`cache_dir`: the cache root (``$XLLM_CACHE_DIR``, default ``~/.cache/xllm``).
"""

from xllm.common.paths import cache_dir
from xllm.common.registry import NameRegistry, UnknownNameError

__all__ = ["NameRegistry", "UnknownNameError", "cache_dir"]

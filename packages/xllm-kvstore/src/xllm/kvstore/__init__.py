"""Prefix block hashing, the global KV index and KV tiers of xLLM.

The hashing/index half (this top-level API) imports without torch:

- :func:`block_hashes`: chained hashes of full token blocks, identical in every
  process (used by the prefix cache and by KV-aware routing).
"""

from xllm.kvstore.hashing import ROOT_HASH, block_hashes, hash_block

__all__ = ["ROOT_HASH", "block_hashes", "hash_block"]

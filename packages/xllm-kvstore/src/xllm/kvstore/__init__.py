"""Prefix block hashing, the global KV index and KV tiers of xLLM.

The hashing/index half (this top-level API) imports without torch:

- :func:`block_hashes`: chained hashes of full token blocks, identical in every
  process (used by the prefix cache and by KV-aware routing).
- :class:`KVEventLog`: an engine instance's cache content as versioned deltas/snapshots.
- :class:`GlobalKVIndex`: one hash map from block hash to the instances holding it, fed by
  those events; prefix matching for all instances in one pass (RTP-LLM Algorithm 2).

The tiers below an engine's KV memory are in submodules: :mod:`xllm.kvstore.tier` (the
``KVTier`` protocol, the checked block record), :mod:`xllm.kvstore.file_tier` (T1 host, T2 disk),
:mod:`xllm.kvstore.mooncake_tier` (T3) and :mod:`xllm.kvstore.tiered` (``TieredStore``).
"""

from xllm.kvstore.events import KVEventLog, new_epoch
from xllm.kvstore.hashing import ROOT_HASH, block_hashes, hash_block
from xllm.kvstore.index import APPLIED, GAP, STALE, GlobalKVIndex

__all__ = ["APPLIED", "GAP", "ROOT_HASH", "STALE", "GlobalKVIndex", "KVEventLog", "block_hashes", "hash_block",
           "new_epoch"]

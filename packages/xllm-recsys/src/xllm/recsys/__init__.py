"""Generative recommendation for xLLM (xLLM §4.5).

- :class:`ItemTrie`: the valid-item vocabulary (items as token-id tuples) and
  the additive logit masks that keep beam search on existing items.
- :func:`beam_topk`: the beam-search candidate selection with a min-heap and
  early termination over per-beam sorted log-probs.
"""

from xllm.recsys.beam_topk import BeamCandidate, beam_topk
from xllm.recsys.item_trie import ItemTrie

__all__ = ["BeamCandidate", "ItemTrie", "beam_topk"]

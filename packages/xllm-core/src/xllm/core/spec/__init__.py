"""Speculative decoding (xLLM §4.4.1, RTP-LLM §6): proposers guess the next tokens of a decoding
sequence, one forward verifies them all, rejection sampling keeps the output distribution exact.

Torch-free at this level: :data:`xllm.engine_api.names.PROPOSERS` is read by the engine flags;
the proposers (``ngram``, ``self``, ``draft``, ``mtp``) and the engine side (``speculator``) import torch.
"""

"""Generative recommendation for xLLM (xLLM §4.5)."""

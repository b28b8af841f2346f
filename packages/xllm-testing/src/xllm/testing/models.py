"""Helpers for model tests: random HF checkpoints (``save_tiny_llama``: the integration tests' and the
reliability benchmark's tiny model), and a greedy engine run that records every chunk
(the no-cache reference forward is :mod:`xllm.testing.reference`)."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.engine_api.stats import StepStats
from xllm.proto.engine.v1 import engine_pb2


def save_random_hf_model(path: pathlib.Path, config, seed: int = 0, std: float = 0.15,
                         max_shard_size: str = "100MB"):
    """A transformers model with ``config`` and random weights large enough for sharp
    attention (HF's default init is nearly uniform), saved with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 routing bias (a buffer, zero-initialized)
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_tiny_llama(path: pathlib.Path, tokenizer_dir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A 2-layer random-weight Llama (hidden 64, GQA 4:2, SmolLM2's vocabulary) saved in ``path``
    with the tokenizer files of ``tokenizer_dir`` (SmolLM2's): fast to load in every engine process.

    Initialised wider than HF's default (0.5, not 0.02) so that its greedy text varies from token
    to token with clear top-2 margins: with the default it repeats one token forever, and a lost or
    repeated token in a moved stream would not show in the text. Deterministic (``seed``: other weights)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    path = pathlib.Path(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5,
                      initializer_range=0.5)
    LlamaForCausalLM(cfg).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (pathlib.Path(tokenizer_dir) / name).is_file():
            shutil.copy(pathlib.Path(tokenizer_dir) / name, path / name)
    return path



def save_random_lora(base_dir: pathlib.Path, out: pathlib.Path, rank: int, alpha: int, targets: list[str],
                     rslora: bool = False, seed: int = 0, parameters: list[str] | None = None) -> pathlib.Path:
    """A PEFT adapter on the HF model in ``base_dir`` with random A and B (std 0.3: PEFT starts B at zero, which
    would change nothing), made and saved by PEFT itself in ``out``; ``parameters``: PEFT's ``target_parameters``
    (a MoE block's expert parameters, ``mlp.experts.down_proj``)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, target_parameters=parameters,
                          use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(hf, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return pathlib.Path(out)


def save_llama_9q3kv(path: pathlib.Path, tokenizer_dir: pathlib.Path) -> pathlib.Path:
    """A 2-layer random Llama with SmolLM2's head counts (9 query, 3 KV heads of 16: over 2 ranks they split
    unevenly, 6+3 / 2+1) and vocabulary, saved in ``path`` with ``tokenizer_dir``'s tokenizer files: the
    tensor-parallel tests' model. Weights wide enough (std 0.3) for clear greedy margins; seed 0."""
    import shutil

    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=144, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    save_random_hf_model(path, cfg, std=0.3)
    for name in TOKENIZER_FILES:
        if (pathlib.Path(tokenizer_dir) / name).is_file():
            shutil.copy(pathlib.Path(tokenizer_dir) / name, pathlib.Path(path) / name)
    return pathlib.Path(path)

class IdTokenizer:
    """The tokenizer of random models: no EOS, a token's text is its id."""

    eos_token_ids = frozenset()

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


_TINY = dict(max_position_embeddings=512, rms_norm_eps=1e-6)


def tiny_qwen3_config():
    """A dense Qwen3 (q/k norms, head_dim 48 > hidden/heads, GQA 4:2), transformers config."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=997, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, head_dim=48,
                       tie_word_embeddings=False)


def tiny_deepseek_v2_config():
    """DeepSeek-V2-Lite in miniature (MLA without q LoRA: the cache holds the latent and the rope
    key; greedy top-2 of 8 experts, 2 shared, first layer dense), transformers config."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=1001, hidden_size=96, intermediate_size=80, moe_intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20,
        topk_method="greedy", **_TINY)


@dataclass
class EngineRun:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    top: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # with top_logprobs > 0
    text: dict[str, str] = field(default_factory=dict)
    finish: dict[str, int] = field(default_factory=dict)
    stats: list[StepStats] = field(default_factory=list)
    counters: object = None
    native_decode_steps: int = 0  # decode steps the fused native step ran
    mode_steps: dict[str, int] = field(default_factory=dict)  # steps per forward mode (ModelRunner.mode_steps)
    greedy_head_steps: int = 0  # steps whose tokens came from the model's greedy head (ModelRunner)


class _Recorder:
    """A :class:`~xllm.core.StatsObserver` keeping every step's stats."""

    def __init__(self, into: list[StepStats]) -> None:
        self.into = into

    def on_step(self, stats: StepStats) -> None:
        self.into.append(stats)


def run_engine(model, tokenizer, prompts: list[list[int]], max_tokens: int, dtype=torch.float32,
               top_logprobs: int = 0, logprobs: bool = True, **config) -> EngineRun:
    """Submit every prompt at once (greedy, ignore_eos, logprobs unless ``logprobs`` is False; the
    ``top_logprobs`` most likely tokens of every position in ``EngineRun.top``) and step until done.
    Without logprobs the steps take the model's greedy head (``EngineRun.greedy_head_steps``)."""
    config.setdefault("max_model_len", 512)
    config.setdefault("max_num_seqs", 16)
    config.setdefault("num_threads", 1)  # tests share 2 cores: one torch thread (see xllm.testing.engine)
    run = EngineRun()
    engine = LLMEngine(model, tokenizer, EngineConfig(dtype=dtype, **config),
                       observers=[_Recorder(run.stats)])
    for i, p in enumerate(prompts):
        engine.add_request(engine_pb2.GenerateRequest(
            request_id=f"p{i}", prompt_token_ids=p,
            sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                               logprobs=logprobs, top_logprobs=top_logprobs)))
    for _ in range(10000):
        if not engine.has_work():
            break
        for c in engine.step():
            run.tokens.setdefault(c.request_id, []).extend(c.token_ids)
            run.logprobs.setdefault(c.request_id, []).extend(lp.logprob for lp in c.logprobs)
            run.top.setdefault(c.request_id, []).extend({t.token_id: t.logprob for t in lp.top} for lp in c.logprobs)
            run.text[c.request_id] = run.text.get(c.request_id, "") + c.text
            if c.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                run.finish[c.request_id] = c.finish_reason
    assert not engine.has_work(), "engine did not finish"
    run.counters = engine.counters
    run.native_decode_steps = engine.runner.native_decode_steps
    run.mode_steps = dict(engine.runner.mode_steps)
    run.greedy_head_steps = engine.runner.greedy_head_steps
    return run


def run_ranks(target, args: tuple, out: pathlib.Path, size: int) -> list:
    """Run ``target(rank, port, *args, out_dir)`` on ``size`` spawned processes (a free loopback port for their
    gloo group; joined before returning, a rank's failure raises here); each rank saves its results as
    ``out_dir/rank{r}.pt``, returned in rank order."""
    import torch.multiprocessing as mp

    from xllm.common.net import free_port

    out.mkdir()
    mp.spawn(target, args=(free_port(), *args, str(out)), nprocs=size, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(size)]


def tiny_tp_arch_configs() -> dict[str, object]:
    """name -> transformers config of the tensor-parallel engine tests' tiny models beyond Llama (SmolLM2's
    vocabulary, 2 layers, 512 positions): over 2 ranks Qwen2's one KV head is replicated (2 query heads each),
    Qwen3's 6 query / 3 KV heads split 4+2 / 2+1, DeepSeek-V2's 3 MLA heads split 2+1 (greedy top-2 of 6
    experts, 2 shared), DeepSeek-V3 has q LoRA, sigmoid routing with correction bias and 4 groups (top 2)."""
    import transformers as t

    common = dict(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    return {
        "qwen2": t.Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
                               tie_word_embeddings=True, **common),
        "qwen3": t.Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3,
                               head_dim=16, tie_word_embeddings=False, **common),
        "qwen3_moe": t.Qwen3MoeConfig(hidden_size=64, intermediate_size=80, moe_intermediate_size=48,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                                      num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                      tie_word_embeddings=False, **common),
        "deepseek_v2": t.DeepseekV2Config(hidden_size=72, intermediate_size=96, moe_intermediate_size=32,
                                          num_attention_heads=3, n_routed_experts=6, num_experts_per_tok=2,
                                          n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None,
                                          kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                                          topk_method="greedy", tie_word_embeddings=True, **common),
        "deepseek_v3": t.DeepseekV3Config(hidden_size=72, intermediate_size=88, moe_intermediate_size=36,
                                          num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                                          num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
                                          n_group=4, topk_group=2, q_lora_rank=40, kv_lora_rank=20,
                                          qk_nope_head_dim=20, qk_rope_head_dim=12, v_head_dim=28,
                                          routed_scaling_factor=2.5, **common),
    }


def save_tp_arch_model(path: pathlib.Path, name: str, tokenizer_dir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """The random model ``name`` of :func:`tiny_tp_arch_configs` (std 0.3: clear greedy margins) saved in
    ``path`` with ``tokenizer_dir``'s tokenizer files (SmolLM2's)."""
    import shutil

    save_random_hf_model(path, tiny_tp_arch_configs()[name], seed=seed, std=0.3)
    for file in TOKENIZER_FILES:
        if (pathlib.Path(tokenizer_dir) / file).is_file():
            shutil.copy(pathlib.Path(tokenizer_dir) / file, pathlib.Path(path) / file)
    return pathlib.Path(path)


# ---- tiny random Qwen2-VL / Qwen2.5-VL (xllm.models.qwen_vl) -------------------------------------------------
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def tiny_qwen_vl_config(family: str, vocab: int, ids: dict[str, int]):
    """HF's config of a tiny ``family`` ("qwen2_vl" or "qwen2_5_vl") model with ``vocab`` tokens and the vision
    special tokens' ``ids`` (2.5: windows of 2 merged tokens, so images split into several padded windows)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    special = dict(vision_start_token_id=ids["<|vision_start|>"], image_token_id=ids["<|image_pad|>"],
                   vision_end_token_id=ids["<|vision_end|>"], video_token_id=ids["<|video_pad|>"])
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **special)
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)


def save_random_vl(config, path: pathlib.Path, seed: int = 0):
    """HF's image-text model for ``config`` with random weights wide enough for sharp attention (norms near 1),
    saved with ``save_pretrained``; returns it (eval mode)."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and ("norm" in name or "ln_q" in name):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model


def flatten_vl_config(src: pathlib.Path, dst: pathlib.Path) -> dict:
    """Write ``src``'s ``config.json`` into ``dst`` with the text fields at the top (as older checkpoints lay them
    out, and as the engine's loader reads them); returns the original."""
    import json

    raw = json.loads((src / "config.json").read_text())
    flat = {k: v for k, v in raw.items() if k != "text_config"} | raw["text_config"]
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": flat.pop("rope_parameters")["mrope_section"]}
    flat["rope_theta"] = 10000.0
    (dst / "config.json").write_text(json.dumps(flat))
    return raw


@torch.inference_mode()
def hf_greedy_with_images(hf, ids: list[int], pixel_values: torch.Tensor | None, grid: torch.Tensor | None,
                          image_token_id: int, n: int) -> list[int]:
    """HF's greedy continuation of ``ids`` by full forwards (its own M-RoPE positions from the token types and
    the images' grids; no images: ``pixel_values`` None)."""
    out: list[int] = []
    for _ in range(n):
        cur = torch.tensor([list(ids) + out])
        if pixel_values is None:
            logits = hf(input_ids=cur).logits
        else:
            logits = hf(input_ids=cur, pixel_values=pixel_values, image_grid_thw=grid,
                        mm_token_type_ids=(cur == image_token_id).int()).logits
        out.append(int(logits[0, -1].argmax()))
    return out

"""Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3 against Hugging Face transformers on tiny random
checkpoints written by ``save_pretrained`` and read by our loader.

Oracle (fp32 both sides):

- full-sequence logits of one plain forward: ``max |ours - HF| < 1e-4 * max |HF|`` and the
  same argmax at every position;
- the engine, several prompts batched, 32 greedy steps (``ignore_eos``), through both KV
  backends (xtensor with one prefill per prompt; paged with a 16-token budget, i.e. chunked
  prefill mixed with decodes), checked by teacher forcing: HF's argmax at every generated
  position is our token and ``|our logprob - HF log_softmax| < 1e-3``. Every HF step must
  have a top-2 logit margin of at least ``MIN_MARGIN`` (asserted, so a near-tie can never
  make the comparison flaky: a case with a tie would fail loudly and need another seed).

Odd sizes: head_dim 40 with a single KV head, 3 heads, vocabularies 997/999/1001, latent
and rope widths that are not powers of two, and a YaRN-scaled V3 with ``mscale_all_dim``
(softmax scale and cos/sin magnitude both differ from 1).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from xllm.models import ARCHITECTURES, load_model
from xllm.models.config import ModelConfigError
from xllm.models.registry import model_class
from xllm.models.weights import WeightLoadError
from xllm.testing.models import IdTokenizer, run_engine, save_random_hf_model, tiny_deepseek_v2_config
from xllm.testing.reference import full_logits

transformers = pytest.importorskip("transformers")

NEW = 32
LOGIT_TOL = 1e-4     # relative to max |HF logit|; observed <= 1.4e-5 absolute (2e-6 relative)
LOGPROB_TOL = 1e-3   # absolute, per generated token; observed <= 8.4e-6
MIN_MARGIN = 1e-3    # HF top-1 minus top-2 logit at every checked step

_MOE = dict(max_position_embeddings=512, rms_norm_eps=1e-6)


def qwen3_moe_config():
    # head_dim 40 (not a power of two), one KV head, a dense layer amid sparse ones, renormalized top-2
    return transformers.Qwen3MoeConfig(
        vocab_size=997, hidden_size=96, intermediate_size=80, moe_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=40, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], **_MOE)


def qwen3_moe_step2_config():
    # sparse every second layer, 12 experts top-4 without renormalization, tied embeddings, qkv/o bias
    return transformers.Qwen3MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=12, num_experts_per_tok=4,
        norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True, attention_bias=True, **_MOE)


def deepseek_v2_group_config():
    # q LoRA, group-limited greedy (2 of 4 groups), scaled weights, MLP biases, tied embeddings, all layers MoE
    return transformers.DeepseekV2Config(
        vocab_size=1001, hidden_size=96, intermediate_size=80, moe_intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=0,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0, mlp_bias=True,
        tie_word_embeddings=True, **_MOE)


def deepseek_v3_yarn_config():
    # 3 heads, sigmoid + correction bias, 2 of 4 groups by top-2 sums, YaRN with mscale != mscale_all_dim
    return transformers.DeepseekV3Config(
        vocab_size=999, hidden_size=72, intermediate_size=88, moe_intermediate_size=36, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=3, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=20,
        qk_rope_head_dim=12, v_head_dim=28, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "beta_fast": 32, "beta_slow": 1},
        **_MOE)


def deepseek_v3_rotate_half_config():
    # rope_interleave=false (rotate-half), num_key_value_heads left at its default (128: unused by MLA)
    return transformers.DeepseekV3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=0, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=1.5, rope_interleave=False, norm_topk_prob=False,
        **_MOE)


# name -> (config, weight seed). Seeds were picked so that HF's greedy path on the prompts below
# keeps a top-2 margin of at least 3e-3 (random MoE models can have near-tied logits; other seeds
# gave margins down to 2e-4, which MIN_MARGIN rejects instead of letting the test depend on luck).
CONFIGS = {
    "qwen3_moe": (qwen3_moe_config, 10),
    "qwen3_moe_step2": (qwen3_moe_step2_config, 10),
    "deepseek_v2_lite": (tiny_deepseek_v2_config, 12),
    "deepseek_v2_group": (deepseek_v2_group_config, 12),
    "deepseek_v3_yarn": (deepseek_v3_yarn_config, 10),
    "deepseek_v3_rotate_half": (deepseek_v3_rotate_half_config, 11),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (model dir, HF model in fp32)."""
    out = {}
    for name, (make, seed) in CONFIGS.items():
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, save_random_hf_model(path, make(), seed=seed))
    return out


@pytest.fixture(scope="module")
def ours(saved):
    return {name: load_model(path, torch.float32, progress=False) for name, (path, _) in saved.items()}


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(vocab)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 6, 19, 41)]


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_hf(saved, ours, name):
    _, hf = saved[name]
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    got = full_logits(ours[name], ids.tolist())
    assert got.shape == ref.shape == (100, vocab)
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    print(f"{name}: max |logit - HF| = {diff:.2e} (max |logit| {scale:.2f})")
    assert scale > 1.0
    assert diff < LOGIT_TOL * scale
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("backend,budget", [("xtensor", 2048), ("paged", 16)])
@pytest.mark.parametrize("name", CONFIGS)
def test_engine_greedy_equals_hf(saved, ours, name, backend, budget):
    _, hf = saved[name]
    prompts = prompts_for(hf.config.vocab_size)
    run = run_engine(ours[name], IdTokenizer(), prompts, NEW, kv_cache_backend=backend,
                          max_num_batched_tokens=budget, max_model_len=256)
    assert run.counters.max_batch_size >= 3  # sequences really ran together
    worst = 0.0
    for i, p in enumerate(prompts):
        toks, lps = run.tokens[f"p{i}"], run.logprobs[f"p{i}"]
        assert len(toks) == len(lps) == NEW
        with torch.no_grad():
            rows = hf(torch.tensor([p + toks[:-1]])).logits[0, len(p) - 1:].float()
        top2 = rows.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        assert margin >= MIN_MARGIN, f"prompt {i}: HF has a near-tie ({margin:.1e}); choose another seed"
        hf_greedy = rows.argmax(-1).tolist()
        first = next((j for j, (a, b) in enumerate(zip(toks, hf_greedy)) if a != b), None)
        assert first is None, f"prompt {i}: token {first} is {toks[first]}, HF says {hf_greedy[first]}"
        lp = rows.log_softmax(-1)[torch.arange(NEW), torch.tensor(toks)]
        diff = (lp - torch.tensor(lps)).abs().max().item()
        assert diff < LOGPROB_TOL, f"prompt {i}: logprob differs from HF by {diff}"
        worst = max(worst, diff)
    if budget < 2048:
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in run.stats)  # chunks mixed with decodes
    print(f"{name}/{backend}: max |logprob - HF| = {worst:.2e}")


# ---- the latent cache ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v3_yarn"])
def test_mla_caches_only_the_compressed_latent(saved, ours, name):
    from xllm.core import EngineConfig, LLMEngine

    _, hf = saved[name]
    c = hf.config
    spec = ours[name].kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.v_head_dim) == (
        c.num_hidden_layers, 1, c.kv_lora_rank + c.qk_rope_head_dim, 0)
    assert spec.bytes_per_token(torch.float32) == 4 * c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim)
    # what per-head K and V would cost
    full_kv = c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    assert spec.bytes_per_token(torch.float32) < 4 * full_kv
    eng = LLMEngine(ours[name], IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=64, num_threads=1))
    k, v = eng.kv.layer_kv(0)
    assert v is None and k.shape[-2:] == (1, c.kv_lora_rank + c.qk_rope_head_dim)
    eng.close()


# ---- loading -------------------------------------------------------------------------------
def test_registry_names_the_moe_architectures():
    for arch in ("Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert arch in ARCHITECTURES.names()
        assert model_class(arch).__name__ == arch
    with pytest.raises(ModelConfigError, match=r"DeepseekV3ForCausalLM.*Qwen3MoeForCausalLM"):
        model_class("MixtralForCausalLM")


def test_experts_are_the_stacked_checkpoint_tensors(saved, ours):
    path, hf = saved["deepseek_v3_yarn"]
    ckpt = load_file(str(path / "model.safetensors"))
    moe = ours["deepseek_v3_yarn"].model.layers[2].mlp
    p = "model.layers.2.mlp."
    for e in range(hf.config.n_routed_experts):
        gate_up = torch.cat([ckpt[f"{p}experts.{e}.gate_proj.weight"], ckpt[f"{p}experts.{e}.up_proj.weight"]])
        assert torch.equal(moe.experts.w13[e], gate_up)
        assert torch.equal(moe.experts.w2[e], ckpt[f"{p}experts.{e}.down_proj.weight"])
    assert torch.equal(moe.gate.correction_bias, ckpt[f"{p}gate.e_score_correction_bias"])
    assert moe.gate.correction_bias.abs().max() > 0  # the test checkpoints carry a real bias
    shared = torch.cat([ckpt[f"{p}shared_experts.gate_proj.weight"], ckpt[f"{p}shared_experts.up_proj.weight"]])
    assert torch.equal(moe.shared_experts.gate_up_proj.weight, shared)
    attn = ours["deepseek_v3_yarn"].model.layers[0].self_attn
    qkv_a = torch.cat([ckpt["model.layers.0.self_attn.q_a_proj.weight"],
                       ckpt["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]])
    assert torch.equal(attn.qkv_a_proj.weight, qkv_a)


def test_bf16_load_keeps_the_routing_bias_in_fp32(saved):
    path, _ = saved["deepseek_v3_yarn"]
    model = load_model(path, torch.bfloat16, progress=False)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.correction_bias.dtype == torch.float32
    ckpt = load_file(str(path / "model.safetensors"))
    assert torch.equal(gate.correction_bias, ckpt["model.layers.1.mlp.gate.e_score_correction_bias"])


def _rewrite(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_stacked_expert_layout_and_mtp_layers_load(saved, ours, tmp_path):
    """transformers 5's in-memory layout (``experts.gate_up_proj`` ``[E, 2I, H]``) loads too, and a
    V3 checkpoint's extra MTP layer (index ``num_hidden_layers``) is skipped."""
    src, hf = saved["deepseek_v3_yarn"]
    layers, experts = hf.config.num_hidden_layers, hf.config.n_routed_experts

    def edit(t):
        for layer in range(1, layers):
            p = f"model.layers.{layer}.mlp.experts."
            gate_up = [torch.cat([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")])
                       for e in range(experts)]
            t[p + "gate_up_proj"] = torch.stack(gate_up)
            t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(experts)])
        t[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(4, 4)
        t[f"model.layers.{layers}.self_attn.kv_b_proj.weight"] = torch.zeros(4, 4)

    model = load_model(_rewrite(src, tmp_path / "stacked", edit), torch.float32, progress=False)
    ids = list(range(3, 40))
    assert torch.equal(full_logits(model, ids), full_logits(ours["deepseek_v3_yarn"], ids))


@pytest.mark.parametrize("drop,match", [
    ("model.layers.1.mlp.experts.5.up_proj.weight", r"missing \['model\.layers\.1\.mlp\.experts\.5\.up_proj"),
    ("model.layers.2.mlp.gate.e_score_correction_bias", r"missing \['model\.layers\.2\.mlp\.gate\.e_score"),
    ("model.layers.1.mlp.gate.weight", r"missing \['model\.layers\.1\.mlp\.gate\.weight"),
    ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", r"missing \['model\.layers\.0\.self_attn\.qkv_a_proj"),
])
def test_incomplete_moe_checkpoints_are_rejected(saved, tmp_path, drop, match):
    src, _ = saved["deepseek_v3_yarn"]
    bad = _rewrite(src, tmp_path / "bad", lambda t: t.pop(drop))
    with pytest.raises(WeightLoadError, match=match):
        load_model(bad, torch.float32, progress=False)


def test_unexpected_and_misshapen_expert_tensors(saved, tmp_path):
    src, hf = saved["qwen3_moe"]
    e = hf.config.num_experts
    extra = _rewrite(src, tmp_path / "extra",
                     lambda t: t.update({f"model.layers.0.mlp.experts.{e}.up_proj.weight": torch.zeros(48, 96)}))
    with pytest.raises(WeightLoadError, match=rf"unexpected \['model\.layers\.0\.mlp\.experts\.{e}\.up_proj"):
        load_model(extra, torch.float32, progress=False)
    bad = _rewrite(src, tmp_path / "bad",
                   lambda t: t.update({"model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(96, 47)}))
    with pytest.raises(WeightLoadError, match=r"experts\.0\.down_proj.*checkpoint shape \(96, 47\)"):
        load_model(bad, torch.float32, progress=False)


def test_unsupported_moe_options_are_clear_errors(saved, tmp_path):
    import json

    src, _ = saved["qwen3_moe"]
    cfg = json.loads((src / "config.json").read_text())
    cfg["use_sliding_window"] = True
    cfg["sliding_window"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.raises(ModelConfigError, match="use_sliding_window"):
        load_model(tmp_path, torch.float32, progress=False)

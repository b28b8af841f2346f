"""benchmarks.w8a8_checkpoint: the compressed-tensors checkpoint vLLM serves in ``serve-client --w8a8``
holds exactly xLLM's w8a8 integers, scales and smoothed norms under HF's names."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.w8a8_checkpoint import QUANTIZATION_CONFIG, write

transformers = pytest.importorskip("transformers")


def test_checkpoint_holds_xllms_w8a8_weights(tmp_path):
    from safetensors.torch import load_file

    from xllm.models import load_model
    from xllm.testing.models import save_random_hf_model

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    src = tmp_path / "tiny"
    save_random_hf_model(src, cfg, seed=3)
    out = write(src, root=tmp_path / "ckpt")
    assert out.name == src.name and write(src, root=tmp_path / "ckpt") == out  # written once
    assert json.loads((out / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG
    got = load_file(str(out / "model.safetensors"))
    model = load_model(src, torch.bfloat16, progress=False, quantization="w8a8")
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}."
        for fused, names in ((layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             (layer.self_attn.o_proj, ("self_attn.o_proj",)),
                             (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
                             (layer.mlp.down_proj, ("mlp.down_proj",))):
            q = torch.cat([got[f"{pre}{n}.weight"] for n in names])
            s = torch.cat([got[f"{pre}{n}.weight_scale"] for n in names])
            assert q.dtype == torch.int8 and s.shape == (fused.qweight.n, 1)
            assert torch.equal(q, fused.qweight.data.view(torch.int8))
            assert torch.equal(s[:, 0], fused.qweight.scales)
        assert got[f"{pre}self_attn.q_proj.weight"].shape == (64, 64)  # 4 heads x 16, the rows split right
        assert torch.equal(got[f"{pre}input_layernorm.weight"], layer.input_layernorm.weight)  # smoothed
    ref = load_file(str(next(src.glob("*.safetensors"))))
    assert torch.equal(got["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])  # float, as stored
    assert not torch.equal(got["model.layers.0.input_layernorm.weight"].float(),
                           ref["model.layers.0.input_layernorm.weight"].float())

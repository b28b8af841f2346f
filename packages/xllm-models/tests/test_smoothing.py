"""SmoothQuant for w8a8 (xllm.models.smoothing): the folded scales leave the float model's function
unchanged, and on a model with an outlier channel they cut the w8a8 model's error against the float one."""

from __future__ import annotations

import pytest
import torch

from xllm.kernels.quant import quantize
from xllm.models import load_model
from xllm.models.layers import QuantLinear
from xllm.models.quantize import quantize_model
from xllm.models.smoothing import calibration_ids, smooth_for_w8a8, smoothing_scales
from xllm.testing.models import save_random_hf_model
from xllm.testing.reference import full_logits

transformers = pytest.importorskip("transformers")

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama with GQA (4 query heads on 2 KV heads), qkv bias, no tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                   attention_bias=True)
    path = tmp_path_factory.mktemp("tiny-llama-smooth")
    save_random_hf_model(path, cfg, seed=9)
    return path


def with_outlier(model) -> None:
    """Channel 5 of every norm's output 40x larger (the systematic outlier channel of trained LLMs), the
    weight columns that read it 40x smaller: the same function, activations int8 rounds badly."""
    with torch.inference_mode():
        for layer in model.model.layers:
            for norm, lin in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                              (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                norm.weight[5] *= 40
                lin.weight[:, 5] /= 40
    model.drop_packed()  # (loading packed the weights: written in place since)


def test_scales_follow_smoothquant():
    act, w = torch.tensor([8.0, 1.0, 0.0, 4.0]), torch.tensor([2.0, 1.0, 3.0, 0.0])
    s = smoothing_scales(act, w, alpha=0.5)
    assert torch.allclose(s, torch.tensor([2.0, 1.0, 1.0, 1.0]))  # sqrt(8 / 2); unused channels keep 1


def test_smoothing_keeps_the_function_and_cuts_w8a8_error(tiny_dir):
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    base = load_model(tiny_dir, torch.float32, progress=False)
    with_outlier(base)
    want = full_logits(base, ids)

    smoothed = load_model(tiny_dir, torch.float32, progress=False)
    with_outlier(smoothed)
    before = smoothed.model.layers[0].self_attn.qkv_proj.weight.clone()
    calib = calibration_ids(tiny_dir, VOCAB, max_tokens=64)
    assert len(calib) == 64 and calib == calibration_ids(tiny_dir, VOCAB, max_tokens=64)  # no tokenizer: fixed ids
    assert smooth_for_w8a8(smoothed, calib) == 2
    smoothed.post_load()
    assert not torch.equal(before, smoothed.model.layers[0].self_attn.qkv_proj.weight)
    torch.testing.assert_close(full_logits(smoothed, ids), want, rtol=1e-4, atol=1e-4)  # the same function

    def w8a8_error(model) -> float:
        quantize_model(model, "w8a8")
        model.post_load()
        assert all(m.qweight.fmt == "w8a8" for m in model.modules() if isinstance(m, QuantLinear))
        return float((full_logits(model, ids) - want).abs().max())

    plain = w8a8_error(base)
    smooth = w8a8_error(smoothed)
    assert smooth < 0.5 * plain, (smooth, plain)


def test_load_model_smooths_w8a8(tiny_dir):
    """``--quantization w8a8`` folds the scales in before quantizing: the loaded weight is the smoothed
    float weight quantized, not the checkpoint's."""
    model = load_model(tiny_dir, torch.float32, progress=False, quantization="w8a8")
    ref = load_model(tiny_dir, torch.float32, progress=False)
    smooth_for_w8a8(ref, calibration_ids(tiny_dir, VOCAB))
    got = model.model.layers[1].mlp.down_proj.qweight
    want = quantize(ref.model.layers[1].mlp.down_proj.weight, "w8a8")
    assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)

"""RMSNorm, rotary embedding and SiLU-and-mul against the Hugging Face Llama reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xllm.kernels import RotaryTable, apply_rotary, rms_norm, silu_and_mul


def hf_llama():
    return pytest.importorskip("transformers.models.llama.modeling_llama")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 576, 97])
def test_rms_norm_matches_hf_llama_rmsnorm_bitwise(dtype, dim):
    llama = hf_llama()
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(5, 3, dim, generator=g) * 4).to(dtype)
    ref = llama.LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(dim, generator=g))
    ref = ref.to(dtype)
    expected = ref(x)
    out, res = rms_norm(x, ref.weight.detach(), 1e-5)
    assert res is None
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_returns_normed_sum_and_sum(dtype):
    llama = hf_llama()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 32, generator=g).to(dtype)
    r = torch.randn(7, 32, generator=g).to(dtype)
    ref = llama.LlamaRMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(32, generator=g) + 0.5)
    out, new_res = rms_norm(x, ref.weight.detach(), 1e-6, residual=r)
    assert torch.equal(new_res, x + r)
    assert torch.equal(out, ref(x + r))


def test_rms_norm_statistics_in_float32_for_bf16_input():
    # Large values whose square overflows nothing in fp32 but whose mean in bf16 would be coarse.
    g = torch.Generator().manual_seed(2)
    x64 = torch.randn(4, 256, generator=g, dtype=torch.float64) * 50
    x = x64.to(torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    out, _ = rms_norm(x, w, 1e-6)
    xd = x.to(torch.float64)
    exact = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    # Only the final cast to bf16 loses precision: half an ulp of bf16 (2^-8 relative).
    assert torch.allclose(out.double(), exact, rtol=2**-8 * 1.01, atol=0)
    assert out.pow(2).double().mean(-1).sub(1).abs().max() < 0.02


def _hf_rotary_cos_sin(head_dim: int, positions: torch.Tensor, theta: float):
    llama = hf_llama()
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                      max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": theta})
    rope = llama.LlamaRotaryEmbedding(cfg)
    return rope(torch.zeros(1, dtype=torch.float32), positions.unsqueeze(0))


@pytest.mark.parametrize("head_dim,theta", [(64, 100000.0), (48, 10000.0), (40, 500000.0)])
def test_rotary_table_and_apply_match_hf(head_dim, theta):
    llama = hf_llama()
    positions = torch.tensor([0, 1, 2, 3, 17, 511, 2047, 4095])
    table = RotaryTable.build(head_dim, 4096, theta)
    cos, sin = table.lookup(positions, torch.float32)
    hf_cos, hf_sin = _hf_rotary_cos_sin(head_dim, positions, theta)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])

    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(len(positions), 6, head_dim, generator=g)   # [T, H, D]
    k = torch.randn(len(positions), 2, head_dim, generator=g)
    hq, hk = llama.apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                        hf_cos, hf_sin)            # HF layout [B, H, T, D]
    assert torch.allclose(apply_rotary(q, cos, sin), hq[0].transpose(0, 1), atol=1e-6, rtol=0)
    assert torch.allclose(apply_rotary(k, cos, sin), hk[0].transpose(0, 1), atol=1e-6, rtol=0)


def test_rotary_is_a_rotation_by_relative_position():
    table = RotaryTable.build(32, 256, 10000.0)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 32, generator=g, dtype=torch.float32)
    k = torch.randn(1, 1, 32, generator=g, dtype=torch.float32)

    def rot(x, p):
        c, s = table.lookup(torch.tensor([p]), torch.float32)
        return apply_rotary(x, c, s)

    assert torch.allclose(rot(q, 0), q)  # position 0 is the identity
    assert torch.allclose(rot(q, 77).norm(), q.norm(), rtol=1e-5)
    dots = [float((rot(q, p + 5) * rot(k, p)).sum()) for p in (0, 10, 100, 200)]
    assert max(dots) - min(dots) < 1e-4  # depends only on the offset (5)
    assert abs(float((rot(q, 6) * rot(k, 0)).sum()) - dots[0]) > 1e-3


def test_partial_rotary_leaves_the_tail_untouched():
    table = RotaryTable.build(16, 64, 10000.0)
    cos, sin = table.lookup(torch.arange(9), torch.float32)
    x = torch.randn(9, 3, 24)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 16:], x[..., 16:])
    assert torch.allclose(out[..., :16], apply_rotary(x[..., :16].contiguous(), cos, sin))
    assert not torch.allclose(out[1:, :, :16], x[1:, :, :16])


def test_rotary_table_errors_and_dtype():
    with pytest.raises(ValueError, match="even"):
        RotaryTable.build(15, 8, 10000.0)
    table = RotaryTable.build(8, 16, 10000.0, attention_scaling=2.0)
    with pytest.raises(ValueError, match="beyond"):
        table.lookup(torch.tensor([3, 16]), torch.float32)
    cos, sin = table.lookup(torch.tensor([5]), torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    assert torch.allclose((cos.float() ** 2 + sin.float() ** 2), torch.full((1, 8), 4.0), rtol=1e-2)
    inv = torch.tensor([1.0, 0.5, 0.25, 0.125])
    custom = RotaryTable.build(8, 4, 10000.0, inv_freq=inv)
    assert torch.allclose(custom.cos[3], torch.cos(3 * torch.cat([inv, inv])))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(4)
    gate = torch.randn(3, 5, 48, generator=g).to(dtype)
    up = torch.randn(3, 5, 48, generator=g).to(dtype)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    assert out.shape == (3, 5, 48) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out, F.silu(gate) * up, rtol=tol, atol=tol)
    g32, u32 = gate.float(), up.float()
    assert torch.allclose(out.float(), g32 * torch.sigmoid(g32) * u32, rtol=2e-2, atol=1e-2)

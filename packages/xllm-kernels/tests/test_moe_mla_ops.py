"""MoE routing and experts against dense references and hand-computed cases; the MLA
helpers (interleaved RoPE, weight absorption) against their expanded definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xllm.kernels import (
    RotaryTable,
    RoutingConfig,
    absorb_query,
    apply_rotary_interleaved,
    expand_values,
    moe_experts,
    select_experts,
)
from xllm.kernels.moe import moe_reference


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def experts(e: int, h: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * i, h, generator=g) * h**-0.5, torch.randn(e, h, i, generator=g) * i**-0.5


# ---- experts --------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (7, 2), (33, 3), (64, 8)])
def test_moe_experts_equal_the_dense_reference(tokens, top_k):
    e, h, i = 8, 24, 20
    w13, w2 = experts(e, h, i, seed=tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, h, generator=g)
    weights, ids = select_experts(torch.randn(tokens, e, generator=g), RoutingConfig(top_k, renormalize=True))
    out = moe_experts(x, w13, w2, weights, ids)
    ref = moe_reference(x, w13, w2, weights, ids)
    assert out.shape == (tokens, h) and out.dtype == x.dtype
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_moe_experts_by_hand_one_token_two_experts():
    e, h, i = 4, 6, 5
    w13, w2 = experts(e, h, i, seed=3)
    x = torch.randn(1, h)

    def mlp(ex):
        gate, up = (x @ w13[ex].T).split(i, dim=-1)
        return (F.silu(gate) * up) @ w2[ex].T

    out = moe_experts(x, w13, w2, torch.tensor([[0.7, 0.3]]), torch.tensor([[3, 1]]))
    assert torch.allclose(out, 0.7 * mlp(3) + 0.3 * mlp(1), atol=1e-6)


def test_idle_experts_are_never_touched_and_empty_batches_work():
    e, h, i = 6, 8, 4
    w13, w2 = experts(e, h, i)
    w13[2].fill_(float("nan"))  # an expert nobody picks may hold anything
    w2[2].fill_(float("nan"))
    x = torch.randn(5, h)
    ids = torch.tensor([[0, 1], [1, 3], [4, 5], [0, 5], [3, 4]])
    out = moe_experts(x, w13, w2, torch.full((5, 2), 0.5), ids)
    assert torch.isfinite(out).all()
    assert moe_experts(x[:0], w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long)).shape == (0, h)


def test_moe_experts_bf16_close_to_fp32():
    e, h, i = 8, 32, 16
    w13, w2 = experts(e, h, i, seed=5)
    x = torch.randn(9, h)
    weights, ids = select_experts(torch.randn(9, e), RoutingConfig(2))
    ref = moe_experts(x, w13, w2, weights, ids)
    out = moe_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max()


# ---- routing --------------------------------------------------------------------------------
def test_softmax_top_k_with_and_without_renormalization():
    logits = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    probs = logits.softmax(-1)
    w, ids = select_experts(logits, RoutingConfig(4))
    assert torch.equal(ids.sort(-1).values, probs.topk(4).indices.sort(-1).values)
    assert torch.allclose(w, probs.gather(1, ids))
    w, ids = select_experts(logits, RoutingConfig(4, renormalize=True, scaling=2.5))
    assert torch.allclose(w.sum(-1), torch.full((10,), 2.5))
    assert torch.allclose(w / w.sum(-1, keepdim=True), probs.gather(1, ids) / probs.gather(1, ids).sum(-1, True))
    # the original DeepSeek-V2 rule: renormalized weights are not scaled
    w, _ = select_experts(logits, RoutingConfig(4, renormalize=True, scaling=2.5, scale_after_renormalize=False))
    assert torch.allclose(w.sum(-1), torch.ones(10))


def test_group_limited_routing_by_hand():
    # 8 experts in 4 groups of 2; group maxima: g0 .30, g1 .25, g2 .20, g3 .40 (softmax of log-probs)
    p = torch.tensor([[0.30, 0.01, 0.02, 0.25, 0.20, 0.01, 0.05, 0.40]])
    p = p / p.sum()
    cfg = RoutingConfig(3, num_groups=4, topk_groups=2, group_score="max")
    w, ids = select_experts(p.log(), cfg)
    assert set(ids[0].tolist()) == {7, 0, 6}  # groups 3 and 0 only, though experts 3 and 4 beat 6
    assert torch.allclose(w, p.gather(1, ids))


@pytest.mark.parametrize("group_score", ["max", "top2_sum"])
def test_group_limited_routing_keeps_the_best_groups(group_score):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(50, 32, generator=g) * 2
    cfg = RoutingConfig(6, scoring="sigmoid", num_groups=8, topk_groups=3, group_score=group_score)
    _, ids = select_experts(logits, cfg)
    scores = logits.sigmoid().view(50, 8, 4)
    gs = scores.max(-1).values if group_score == "max" else scores.topk(2, -1).values.sum(-1)
    best = gs.topk(3).indices
    for t in range(50):
        groups = set((ids[t] // 4).tolist())
        assert groups <= set(best[t].tolist())
        # within the kept groups, the chosen experts are the top-6
        allowed = torch.cat([torch.arange(4) + 4 * int(b) for b in best[t]])
        top = allowed[scores.view(50, 32)[t, allowed].topk(6).indices]
        assert set(ids[t].tolist()) == set(top.tolist())


def test_correction_bias_changes_the_choice_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    cfg = RoutingConfig(2, scoring="sigmoid", renormalize=True, scaling=2.0)
    _, ids = select_experts(logits, cfg)
    assert set(ids[0].tolist()) == {0, 1}
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids = select_experts(logits, cfg, correction_bias=bias)
    assert set(ids[0].tolist()) == {0, 3}
    s = logits.sigmoid()[0]
    expect = {0: s[0] / (s[0] + s[3]) * 2.0, 3: s[3] / (s[0] + s[3]) * 2.0}
    for j, e in enumerate(ids[0].tolist()):
        assert float(w[0, j]) == pytest.approx(float(expect[e]), rel=1e-6)


def test_routing_rejects_bad_configs():
    with pytest.raises(ValueError, match="scoring"):
        RoutingConfig(2, scoring="relu")
    with pytest.raises(ValueError, match="topk_groups"):
        RoutingConfig(2, num_groups=2, topk_groups=3)
    with pytest.raises(ValueError, match="groups"):
        select_experts(torch.randn(2, 6), RoutingConfig(2, num_groups=4, topk_groups=2))
    with pytest.raises(ValueError, match="exceeds"):
        select_experts(torch.randn(2, 3), RoutingConfig(4))


# ---- MLA helpers ----------------------------------------------------------------------------
def test_interleaved_rope_equals_the_complex_form_up_to_layout():
    d, t = 8, 11
    table = RotaryTable.build(d, 32, 10000.0)
    pos = torch.arange(3, 3 + t)
    cos, sin = table.lookup(pos, torch.float32)
    x = torch.randn(t, 3, d)
    ours = apply_rotary_interleaved(x, cos, sin)
    # DeepSeek-V2: pairs as complex numbers times e^{i * pos * f}
    freqs = torch.polar(torch.ones(t, d // 2), pos[:, None].float() * (10000.0 ** -(torch.arange(0, d, 2) / d)))
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(t, 3, d // 2, 2)) * freqs[:, None]).flatten(2)
    deinterleaved = torch.cat([ref[..., 0::2], ref[..., 1::2]], dim=-1)
    assert torch.allclose(ours, deinterleaved, atol=1e-5)
    # dot products between positions are what matter: they agree in either layout
    q, k = torch.randn(t, 3, d), torch.randn(t, 3, d)
    qr = torch.view_as_real(torch.view_as_complex(q.reshape(t, 3, d // 2, 2)) * freqs[:, None]).flatten(2)
    kr = torch.view_as_real(torch.view_as_complex(k.reshape(t, 3, d // 2, 2)) * freqs[:, None]).flatten(2)
    s_ref = torch.einsum("thd,shd->hts", qr, kr)
    s_ours = torch.einsum("thd,shd->hts", apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin))
    assert torch.allclose(s_ours, s_ref, atol=1e-4)


def test_weight_absorption_equals_expanded_keys_and_values():
    t, h, nope, v, r = 6, 3, 10, 7, 12
    kv_b = torch.randn(h * (nope + v), r)
    per_head = kv_b.view(h, nope + v, r)
    w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]
    q_nope = torch.randn(t, h, nope)
    latent = torch.randn(t, r)
    k_nope = torch.einsum("hnr,sr->shn", w_uk, latent)   # expanded keys [S, H, nope]
    values = torch.einsum("hvr,sr->shv", w_uv, latent)   # expanded values [S, H, v]
    scores_expanded = torch.einsum("thn,shn->hts", q_nope, k_nope)
    scores_absorbed = torch.einsum("thr,sr->hts", absorb_query(q_nope, w_uk), latent)
    assert torch.allclose(scores_absorbed, scores_expanded, atol=1e-4)
    probs = scores_expanded.softmax(-1)
    out_expanded = torch.einsum("hts,shv->thv", probs, values)
    out_latent = torch.einsum("hts,sr->thr", probs, latent)
    assert torch.allclose(expand_values(out_latent, w_uv), out_expanded, atol=1e-5)

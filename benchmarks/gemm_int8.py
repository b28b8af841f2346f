"""An accuracy check of the "w8a8" format's int8 GEMM (``kernels/cpu/gemm_w8a8.h``, ``--quantization w8a8``;
:func:`benchmarks.gemm_common.w8a8_linear`) on SmolLM2's real layer inputs.

    python -m benchmarks gemm_int8          # accuracy: relative error vs the bf16 GEMM per layer kind
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gemm_common import w8a8_linear
from benchmarks.scenario import Output, Scenario


def accuracy(text: str = "The quick brown fox jumps over the lazy dog. " * 8) -> dict[str, dict[str, float]]:
    """Per projection kind of SmolLM2 (bf16): the int8 GEMM's error against the bf16 GEMM on the layer's
    real inputs for ``text`` (captured with forward hooks), as ||y8 - y|| / ||y|| (Frobenius, over all
    layers) and the worst per-layer value; the bf16 GEMM's own error vs fp32 for scale."""
    from xllm.models import load_model, resolve_model

    model = load_model(resolve_model(), dtype=torch.bfloat16)
    tok_ids = _token_ids(text)
    captured: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    hooks = []
    for name, mod in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            hooks.append(mod.register_forward_hook(
                lambda m, inp, out, kind=kind: captured.setdefault(kind, []).append((inp[0].detach(), m.weight))))
    try:
        with torch.no_grad():
            _prefill(model, tok_ids)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for kind, pairs in captured.items():
        num = den = num16 = 0.0
        worst = 0.0
        for x, w in pairs:
            x2 = x.reshape(-1, x.shape[-1])
            ref = x2.float() @ w.float().T
            y = w8a8_linear(w)(x2).float()
            y16 = (x2 @ w.T).float()
            e, d = (y - ref).norm().item() ** 2, ref.norm().item() ** 2
            num, den, num16 = num + e, den + d, num16 + (y16 - ref).norm().item() ** 2
            worst = max(worst, (e / d) ** 0.5)
        out[kind] = {"int8_rel_err": (num / den) ** 0.5, "int8_worst_layer": worst,
                     "bf16_rel_err": (num16 / den) ** 0.5, "layers": len(pairs),
                     "rows": int(pairs[0][0].reshape(-1, pairs[0][0].shape[-1]).shape[0])}
    return out


def _token_ids(text: str) -> list[int]:
    from transformers import AutoTokenizer

    from xllm.models import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model())).encode(text)


def _prefill(model, ids: list[int]) -> None:
    """``ids`` through every layer (see :func:`_layer_forward`), for the hooks to capture inputs."""
    h = model.model.embed_tokens(torch.tensor(ids))
    for layer in model.model.layers:
        h = _layer_forward(layer, h)


def _layer_forward(layer, h: torch.Tensor) -> torch.Tensor:
    """MLP and projections of one decoder layer without attention state: enough to capture realistic
    projection inputs (attention is replaced by the value rows, which keeps the scale of o_proj's input)."""
    x = layer.input_layernorm(h)
    qkv = layer.self_attn.qkv_proj(x)
    a = layer.self_attn
    v = qkv[:, (a.num_heads + a.num_kv_heads) * a.head_dim:]
    v = v.reshape(-1, a.num_kv_heads, a.head_dim).repeat_interleave(a.num_heads // a.num_kv_heads, dim=1)
    h = h + a.o_proj(v.reshape(v.shape[0], -1))
    x = layer.post_attention_layernorm(h)
    gu = layer.mlp.gate_up_proj(x)
    g, u = gu.chunk(2, dim=-1)
    return h + layer.mlp.down_proj(torch.nn.functional.silu(g) * u)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No flags."""


def run(args: argparse.Namespace, output: Output) -> int:
    for kind, r in accuracy().items():
        print(f"{kind:13s} int8 rel err {r['int8_rel_err']:.4f} (worst layer {r['int8_worst_layer']:.4f}), "
              f"bf16 rel err {r['bf16_rel_err']:.4f}; {r['layers']} layers x {r['rows']} rows")
    return 0


SCENARIO = Scenario("gemm_int8", "the w8a8 int8 GEMM's error vs the bf16 GEMM per layer kind", __doc__,
                    add_arguments, run)

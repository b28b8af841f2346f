"""The engine-free reference forward: a model run over a whole sequence with plain causal attention
and no KV cache. KV-cached, batched, chunked and fused paths are checked against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseContext:
    """Attention for one sequence with no KV cache: plain causal attention over the forward's tokens.
    A latent (MLA) call passes ``v=None`` and ``v_dim``: the values are the keys' first ``v_dim`` channels."""

    def attention(self, layer, q, k, v, scale, v_dim=None):
        if v is None:
            v = k[..., :v_dim]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, scale=scale)
        return o.transpose(0, 1)


class FakeQuantKVContext(DenseContext):
    """:class:`DenseContext` whose K/V are quantized and dequantized first (the torch reference of
    :mod:`xllm.kernels.kv_quant`, per token and head): the oracle of a quantized KV cache (``kind``
    ``int8`` or ``fp8_e4m3``), since each row quantizes on its own whatever the batching or chunking."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def attention(self, layer, q, k, v, scale, v_dim=None):
        from xllm.kernels.kv_quant import KVQuantFormat, decode_rows, encode_rows, row_bytes

        f = KVQuantFormat(self.kind, k.shape[1], k.shape[2], row_bytes(k.shape[1], k.shape[2]))
        return super().attention(layer, q, decode_rows(encode_rows(k, f), f), decode_rows(encode_rows(v, f), f),
                                 scale)


@torch.inference_mode()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Our model's float32 logits at every position of ``ids`` (one forward, no engine)."""
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), DenseContext())
    return model.compute_logits(hidden)


@torch.inference_mode()
def hf_greedy_tokens(hf, prompt: list[int], n: int) -> list[int]:
    """Hugging Face ``generate``'s greedy continuation of ``prompt``: exactly ``n`` tokens, EOS not stopping it
    (what engine requests with ``ignore_eos`` produce)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def recompute_greedy(model, prompt: list[int], n: int,
                     context: DenseContext | None = None) -> tuple[list[int], list[float]]:
    """Greedy decoding by re-running the whole sequence every step (no KV cache, no batching):
    the generated tokens and their logprobs. ``context``: the attention (default plain causal)."""
    ids, lps = list(prompt), []
    for _ in range(n):
        hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), context or DenseContext())
        logprobs = model.compute_logits(hidden[-1:])[0].log_softmax(-1)
        tok = int(logprobs.argmax())
        ids.append(tok)
        lps.append(float(logprobs[tok]))
    return ids[len(prompt):], lps

"""Logit processing and sampling ops (batched, per-row parameters).

All ops take float32 logits ``[B, V]`` and per-row parameter tensors ``[B]``;
a row whose parameter is at its neutral value is left unchanged.
"""

from __future__ import annotations

import torch


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF/vLLM repetition penalty: for tokens in ``seen`` (bool ``[B, V]``, prompt
    and output), divide positive logits by ``penalty`` and multiply negative ones.
    ``penalty`` is ``[B]`` (1.0 = off)."""
    p = penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor, output_counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """OpenAI penalties on generated tokens: ``logit -= frequency * count +
    presence * (count > 0)``; ``output_counts`` is ``[B, V]`` of generated-token counts."""
    counts = output_counts.to(logits.dtype)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Mask (set to ``-inf``) tokens outside each row's top-k, nucleus and min-p set.

    ``top_k`` int ``[B]`` (0 or >= V = off), ``top_p`` float ``[B]`` in (0, 1]
    (1 = off), ``min_p`` float ``[B]`` in [0, 1] (0 = off). Applied in that order,
    each on the distribution left by the previous one; the most likely token is
    always kept.
    """
    if top_k is None and top_p is None and min_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k).clamp(max=vocab)
        drop |= ranks >= k.unsqueeze(1)
    if top_p is not None or min_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        if top_p is not None:
            # Drop a token when the mass strictly before it already reaches top_p. Rows at
            # top_p = 1 are exempt: float32 cumsum can exceed 1.0 and would cut their tail.
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        if min_p is not None:
            drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked_sorted)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, index: int) -> int:
    """The seed of draw ``index`` (the output position) of a request seeded ``seed``: a 64-bit
    mix of both (SplitMix64), the same in every process. Draws depend only on (seed, index), never
    on how many draws came before on this instance, so a stream continued elsewhere draws exactly
    the tokens one run would have."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64))


def draw_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for draw ``index`` of a request seeded ``seed`` (see :func:`draw_seed`)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(draw_seed(seed, index))
    return gen


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row from ``probs`` ``[B, V]`` with row ``b``'s generator.

    Uses the exponential race (argmax of ``p / E`` with ``E ~ Exp(1)``), which is
    an exact categorical sample; each row consumes only its own generator, so a
    seeded row's draw does not depend on the rest of the batch. A row without a
    generator (``None``: its result is not used) draws nothing.
    """
    noise = torch.ones_like(probs)
    for b, gen in enumerate(generators):
        if gen is not None:
            noise[b].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for float32 ``[B, V]`` (the native kernel when available:
    rows in parallel, vectorized; first index on ties like torch; a row with NaN gets an
    arbitrary index instead of the NaN's)."""
    from xllm.kernels import native

    lib = native.for_tensors(logits) if logits.dim() == 2 and logits.dtype == torch.float32 else None
    if lib is None:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.lib.xllm_argmax_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


# byte b of a bitmask row -> its 8 tokens' additive mask (bit j set: token allowed, 0; else -inf)
_BYTE_MASKS = torch.where((torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1, 0.0, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``logits`` (float ``[B, V]``) with every token that ``bitmask`` does not allow at ``-inf``, as a
    new tensor: ``bitmask[i]`` (int32 words, bit ``j`` of word ``w`` = token ``32 w + j`` allowed, the
    grammar engine's layout) masks row ``rows[i]``; other rows are copied unchanged. Native kernel for
    contiguous float32 logits (masked 16-token stores), else the bitmask expanded to an additive mask."""
    import ctypes

    from xllm.kernels import native

    out = logits.clone()
    lib = native.for_tensors(out) if out.dim() == 2 and out.dtype == torch.float32 and out.is_contiguous() else None
    vocab = out.shape[1]
    if lib is not None:
        bits = bitmask.contiguous()
        idx = rows.to(torch.int64).contiguous()
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.fn("xllm_apply_token_bitmask_f32", [vp, i64, vp, i64, vp, i64, i64])(
            out.data_ptr(), out.stride(0), bits.data_ptr(), bits.shape[1], idx.data_ptr(), len(idx), vocab)
        return out
    additive = _BYTE_MASKS[bitmask.contiguous().view(torch.uint8).long()].reshape(len(rows), -1)[:, :vocab]
    out[rows] = out[rows] + additive.to(out.dtype)
    return out

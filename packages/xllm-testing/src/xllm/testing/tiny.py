"""Hermetic stand-ins for a real model: a tiny random causal LM that satisfies
:class:`xllm.core.model_api.CausalLM` (built from the same kernels as the real models) and
byte-piece tokenizers whose pieces split multi-byte characters across tokens.

xllm-core must not depend on xllm-models, so its engine tests run this model; the real SmolLM2
parity tests live in xllm-models.
"""

from __future__ import annotations

import torch
from torch import nn

from xllm.core.model_api import KVCacheSpec
from xllm.kernels import RotaryTable, apply_rotary, rms_norm, silu_and_mul


class PieceTokenizer:
    """Decodes ids by joining byte pieces as UTF-8 (errors -> U+FFFD), like byte-level BPE."""

    def __init__(self, pieces: list[bytes], special: frozenset[int] = frozenset(),
                 eos_token_ids: frozenset[int] = frozenset(), strip_leading_space: bool = False) -> None:
        self.pieces = list(pieces)
        self.special = special
        self.eos_token_ids = eos_token_ids
        self.strip_leading_space = strip_leading_space  # sentencepiece-style decode
        self.decode_calls = 0

    def piece_id(self, piece: bytes) -> int:
        if piece not in self.pieces:
            self.pieces.append(piece)
        return self.pieces.index(piece)

    def encode_pieces(self, pieces: list[str | bytes]) -> list[int]:
        return [self.piece_id(p.encode() if isinstance(p, str) else p) for p in pieces]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decode_calls += 1
        data = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))
        text = data.decode("utf-8", errors="replace")
        if self.strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text


EOS = 0
# Vocabulary of the tiny engine model: EOS, ASCII pieces, and multi-byte characters split across tokens.
TINY_PIECES = [b"<eos>"] + [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz .,!?\n"] + [
    b" the", b" and", b"ing", b"\xc3", b"\xa9", b"\xe6\x97", b"\xa5", b"\xf0\x9f", b"\x98\x80", b"\xe4\xb8\x96",
    b"\xe7\x95\x8c", b" cafe", b"\xf0\x9f\x91", b"\x8d", b"STOP", b"ST", b"OP", b"!!", b"ab", b"cd", b"ef", b"gh",
    b"ij", b"kl", b"mn", b"op", b"qr", b"st", b"uv", b"wx",
]


def tiny_tokenizer() -> PieceTokenizer:
    return PieceTokenizer(TINY_PIECES, special=frozenset({EOS}), eos_token_ids=frozenset({EOS}))


class TinyLM(nn.Module):
    """A 2-layer Llama-style decoder with random weights (GQA, RoPE, SwiGLU)."""

    def __init__(self, vocab: int = len(TINY_PIECES), hidden: int = 32, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2, head_dim: int = 8, max_context_len: int = 160, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape, scale=1.0):
            return nn.Parameter(torch.randn(*shape, generator=g) * scale, requires_grad=False)

        self.vocab_size, self.max_context_len = vocab, max_context_len
        self.heads, self.kv_heads, self.head_dim, self.num_layers = heads, kv_heads, head_dim, layers
        self.embed = rnd(vocab, hidden)
        self.wq = nn.ParameterList([rnd(heads * head_dim, hidden, scale=hidden**-0.5) for _ in range(layers)])
        self.wk = nn.ParameterList([rnd(kv_heads * head_dim, hidden, scale=hidden**-0.5) for _ in range(layers)])
        self.wv = nn.ParameterList([rnd(kv_heads * head_dim, hidden, scale=hidden**-0.5) for _ in range(layers)])
        self.wo = nn.ParameterList([rnd(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5)
                                    for _ in range(layers)])
        self.w_gate_up = nn.ParameterList([rnd(4 * hidden, hidden, scale=hidden**-0.5) for _ in range(layers)])
        self.w_down = nn.ParameterList([rnd(hidden, 2 * hidden, scale=(2 * hidden) ** -0.5) for _ in range(layers)])
        self.lm_head = rnd(vocab, hidden, scale=4 * hidden**-0.5)  # peaked distributions: no near-ties
        self.norm_w = torch.ones(hidden)
        self.rotary = RotaryTable.build(head_dim, max_context_len, 10000.0)
        self.forward_calls = 0

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.num_layers, self.kv_heads, self.head_dim, self.head_dim)

    def forward(self, input_ids, positions, ctx):
        self.forward_calls += 1
        t = input_ids.shape[0]
        h = self.embed[input_ids]
        cos, sin = self.rotary.lookup(positions, h.dtype)
        for i in range(self.num_layers):
            x, _ = rms_norm(h, self.norm_w, 1e-6)
            q = (x @ self.wq[i].T).view(t, self.heads, self.head_dim)
            k = (x @ self.wk[i].T).view(t, self.kv_heads, self.head_dim)
            v = (x @ self.wv[i].T).view(t, self.kv_heads, self.head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            a = ctx.attention(i, q, k, v, self.head_dim**-0.5)
            h = h + a.reshape(t, -1) @ self.wo[i].T
            x, _ = rms_norm(h, self.norm_w, 1e-6)
            h = h + silu_and_mul(x @ self.w_gate_up[i].T) @ self.w_down[i].T
        return rms_norm(h, self.norm_w, 1e-6)[0]

    def compute_logits(self, hidden):
        return (hidden @ self.lm_head.T).float()

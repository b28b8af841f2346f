"""The fused native decode step for Llama-family models (kernels/cpu/llama_decode.c).

:class:`FusedLlamaDecoder` packs a loaded model's weight pointers and a KV
backend's per-layer cache pointers into the C structs once, then runs a whole
decode step (every layer) in one native call for up to 8 sequences. It applies
only where the C kernel's layout assumptions hold; :meth:`model_supported` says so and
the caller falls back to the eager module path otherwise.

It is the :class:`xllm.core.model_api.FusedDecoder` of Llama-family models.
"""

from __future__ import annotations

import ctypes

import torch

from xllm.core.model_api import SlotKV
from xllm.kernels import native, rms_norm
from xllm.kernels.linear import MAX_NATIVE_ROWS


class FusedLlamaDecoder:
    """Decode steps of a :class:`~xllm.models.llama.LlamaForCausalLM` through one native call."""

    max_batch = MAX_NATIVE_ROWS  # the kernel's GEMMs stream each weight once for up to this many rows

    def __init__(self, model) -> None:
        self.model = model
        self._kv_key: tuple | None = None
        self._layers = None
        self._cfg = None
        self._work: torch.Tensor | None = None

    @staticmethod
    def model_supported(model) -> bool:
        from xllm.models.llama import LlamaMLP

        cfg = model.cfg
        if not all(isinstance(layer.mlp, LlamaMLP) for layer in model.model.layers):
            return False  # MoE or other MLPs: the kernel implements the dense SwiGLU block only
        attn = model.model.layers[0].self_attn
        mult = 32 if model.dtype == torch.bfloat16 else 16
        return (
            native.library() is not None
            and model.dtype in (torch.bfloat16, torch.float32)
            and cfg.hidden_size % mult == 0
            and (attn.num_heads * attn.head_dim) % mult == 0
            and int(cfg.raw["intermediate_size"]) % mult == 0
            and attn.head_dim <= 512
            and attn.o_proj.bias is None
            and model.rotary.cos.shape[-1] == attn.head_dim
        )

    def _bind(self, kv: SlotKV) -> None:
        """(Re)build the C structs for ``kv``'s tensors (they never move: bound once per backend)."""
        m = self.model
        layers = m.model.layers
        if self._kv_key is not None and self._kv_key[0] is kv:
            return
        kvs = [kv.layer_kv(i) for i in range(len(layers))]
        key = (kv, tuple((k.data_ptr(), v.data_ptr()) for k, v in kvs))
        if key == self._kv_key:
            return
        attn0 = layers[0].self_attn
        k0, v0 = kvs[0]
        for k, v in kvs:
            if k.dim() != 4 or k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride() != k0.stride():
                raise ValueError("fused decode needs [slots, max_len, kv_heads, head_dim] KV tensors")
        cfg = native.LlamaCfg(
            hidden=m.cfg.hidden_size, n_heads=attn0.num_heads, n_kv_heads=attn0.num_kv_heads,
            head_dim=attn0.head_dim, inter=int(m.cfg.raw["intermediate_size"]), n_layers=len(layers),
            k_slot_stride=k0.stride(0), k_tok_stride=k0.stride(1), v_slot_stride=v0.stride(0),
            v_tok_stride=v0.stride(1), eps=float(layers[0].input_layernorm.eps), scale=float(attn0.scale),
            qk_norm=int(attn0.q_norm is not None), rotary_dim=m.rotary.cos.shape[-1])
        arr = (native.LlamaLayer * len(layers))()
        for i, layer in enumerate(layers):
            a = layer.self_attn

            def ptr(t):
                return None if t is None else t.data_ptr()

            arr[i] = native.LlamaLayer(
                ln1=ptr(layer.input_layernorm.weight), qkv_w=ptr(a.qkv_proj.weight), qkv_b=ptr(a.qkv_proj.bias),
                q_norm=ptr(a.q_norm.weight) if a.q_norm is not None else None,
                k_norm=ptr(a.k_norm.weight) if a.k_norm is not None else None,
                o_w=ptr(a.o_proj.weight), o_b=ptr(a.o_proj.bias), ln2=ptr(layer.post_attention_layernorm.weight),
                gate_up_w=ptr(layer.mlp.gate_up_proj.weight), down_w=ptr(layer.mlp.down_proj.weight),
                k_cache=kvs[i][0].data_ptr(), v_cache=kvs[i][1].data_ptr())
        self._cfg, self._layers, self._kv_key = cfg, arr, key
        # cos/sin tables must stay float32 and contiguous for the kernel
        self._cos = m.rotary.cos.contiguous()
        self._sin = m.rotary.sin.contiguous()

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 kv: SlotKV) -> torch.Tensor:
        """Final hidden states ``[B, hidden]`` for one decode token per sequence.

        ``positions[b]`` is the position of sequence ``b``'s token (its context
        then spans ``[0, positions[b]]`` in slot ``slots[b]``); its K/V are
        written by the kernel.
        """
        m = self.model
        self._bind(kv)
        b = input_ids.shape[0]
        if b > self.max_batch:
            raise ValueError(f"fused decode handles at most {self.max_batch} sequences")
        c = self._cfg
        hidden = m.model.embed_tokens(input_ids).contiguous()
        residual = torch.empty_like(hidden)
        qkv_dim = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        need = b * (c.hidden + qkv_dim + c.n_heads * c.head_dim + c.inter)  # r_alt, qkv, attn, act
        if self._work is None or self._work.numel() < need or self._work.dtype != hidden.dtype:
            self._work = torch.empty(self.max_batch * (need // b), dtype=hidden.dtype)
        slots = slots.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        fn = native.library().lib.xllm_llama_decode_bf16 if hidden.dtype == torch.bfloat16 else \
            native.library().lib.xllm_llama_decode_f32
        fn(ctypes.byref(c), self._layers, b, slots.data_ptr(), positions.data_ptr(), self._cos.data_ptr(),
           self._sin.data_ptr(), hidden.data_ptr(), residual.data_ptr(), self._work.data_ptr())
        norm = m.model.norm
        out, _ = rms_norm(hidden, norm.weight, norm.eps, residual)
        return out

"""Quantized-model test support: a tiny llama-architecture GGUF written from a random HF checkpoint
(``write_llama_gguf``: llama.cpp's tensor names and Q/K row interleave, 2-D weights in a GGUF block
format), and a quantized model's float twin over the same (dequantized) weights (``dequantized_twin``)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch

from xllm.models.gguf_import import hf_tensor_name


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF -> GGUF)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_names(num_layers: int) -> dict[str, str]:
    """HF name -> GGUF name of every tensor a llama GGUF can hold."""
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for i in range(num_layers):
        names += [f"blk.{i}.{p}.weight" for p in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v",
                                                    "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    return {hf_tensor_name(n): n for n in names}


def write_llama_gguf(hf_dir: pathlib.Path, path: pathlib.Path, qtype: str) -> pathlib.Path:
    """``hf_dir``'s Llama weights as a GGUF at ``path``: every 2-D weight in ``qtype`` (``"Q8_0"``,
    ``"Q4_0"``, ``"Q4_1"``: ``gguf.quants.quantize``, ggml's reference quantizers), norms F32, Q/K rows
    interleaved as llama.cpp stores them. Only the tensors and the architecture: the config comes from
    ``hf_dir`` (what :func:`xllm.models.loader.load_model` reads with ``gguf_file``)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    names = _gguf_names(cfg["num_hidden_layers"])
    kind = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), "llama")
    for hf_name, t in tensors.items():
        data = t.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            data = llamacpp_permute(data, cfg["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            data = llamacpp_permute(data, cfg["num_key_value_heads"])
        data = np.ascontiguousarray(data, dtype=np.float32)
        if data.ndim == 2:
            writer.add_tensor(names[hf_name], gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(names[hf_name], data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_twin(quantized: torch.nn.Module, model_dir: pathlib.Path) -> torch.nn.Module:
    """``model_dir``'s float32 model with every weight ``quantized`` holds quantized (its
    ``QuantLinear`` / ``QuantEmbedding`` modules) replaced by the dequantized values, and its float
    parameters (norms, biases: w8a8's smoothing changed some) copied: the same model computed in float,
    the oracle of the quantized one."""
    from xllm.kernels.quant import dequantize
    from xllm.models import load_model
    from xllm.models.layers import QuantEmbedding, QuantLinear
    from xllm.models.placement import StreamsWeights

    twin = load_model(model_dir, torch.float32, progress=False)
    for path, module in quantized.named_modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            target = twin.get_submodule(path).weight
            target.data.copy_(dequantize(module.qweight).view(target.shape))
    for name, param in quantized.named_parameters():
        twin.get_parameter(name).data.copy_(param)
    if isinstance(twin, StreamsWeights):
        twin.drop_packed()  # loading packed the checkpoint's weights
    return twin

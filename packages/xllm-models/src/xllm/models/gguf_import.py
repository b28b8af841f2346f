"""Import a GGUF checkpoint (llama.cpp format) as a HF safetensors model directory.

Weights are dequantized tensor by tensor in file order with the ``gguf``
package and renamed to the HF layout (undoing llama.cpp's Q/K row permutation);
config and tokenizer are read from the GGUF metadata through ``transformers``.
The result is an ordinary model directory that :func:`xllm.models.load_model`
and HF ``from_pretrained`` both read. Serving the GGUF's weights as stored
(:mod:`xllm.models.gguf_weights`) needs only the config and tokenizer: the
conversion can stop there (``weights=False``) and add the weights later.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import shutil

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFImportError(RuntimeError):
    """The GGUF file cannot be imported (unsupported architecture or tensor)."""


def hf_tensor_name(gguf_name: str) -> str:
    """HF name of a llama-architecture GGUF tensor."""
    if gguf_name in _LLAMA_NAMES:
        return _LLAMA_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LLAMA_BLOCK:
        return f"model.layers.{m.group(1)}.{_LLAMA_BLOCK[m.group(2)]}.{m.group(3)}"
    raise GGUFImportError(f"no HF name for GGUF tensor {gguf_name!r}")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K projections (back to HF's
    rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qk_heads(name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """The head count whose rows llama.cpp interleaved in HF tensor ``name`` (Q or K projection), else None."""
    if name.endswith("self_attn.q_proj.weight"):
        return num_heads
    return num_kv_heads if name.endswith("self_attn.k_proj.weight") else None


def dequantize_float32(data: np.ndarray, ggml_type: int, heads: int | None = None) -> torch.Tensor:
    """A GGUF tensor's stored bytes dequantized by ``gguf``'s reference code to a float32 tensor (exact for
    every GGML format), its rows un-interleaved per :func:`qk_heads` when ``heads`` is given."""
    import gguf

    out = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(ggml_type))
    if heads is not None:
        out = unpermute_rows(out, heads)
    return torch.from_numpy(np.array(out, dtype=np.float32, order="C", copy=True))


def convert_gguf(gguf_path: str | pathlib.Path, out_dir: str | pathlib.Path, progress: bool = True,
                 weights: bool = True) -> pathlib.Path:
    """Write a HF model directory for ``gguf_path`` at ``out_dir`` (atomically).

    Weights are stored as float32 safetensors (dequantized values are exact in
    fp32). With ``weights`` False only the config, tokenizer and generation
    config are written (what serving the GGUF's weights as stored needs); a
    later call with ``weights`` adds the safetensors to such a directory
    (atomically too). Returns ``out_dir``.
    """
    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    if (out_dir / "config.json").is_file():  # the metadata is there: add the weights only
        if weights and not any(out_dir.glob("*.safetensors")):
            _write_weights(gguf_path, out_dir, progress)
        return out_dir
    from transformers import AutoConfig, TokenizersBackend

    from xllm.models.gguf_weights import gguf_tensors

    meta, _ = gguf_tensors(gguf_path)  # the architecture without parsing every metadata array
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"GGUF architecture {arch!r} is not supported for import (supported: llama)")
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        config.architectures = ["LlamaForCausalLM"]
        config.dtype = "float32"
        config.save_pretrained(tmp)
        # the class AutoTokenizer picks for a GGUF (transformers 5 builds the backend from the file's tokenizer
        # type), called directly: AutoTokenizer parses the metadata again for a config first (~6 s)
        tokenizer = TokenizersBackend.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(tmp)
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
               "pad_token_id": getattr(config, "pad_token_id", None)}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if weights:
            _write_weights(gguf_path, tmp, progress)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s -> %s%s", gguf_path, out_dir, "" if weights else " (config and tokenizer)")
    return out_dir


def _write_weights(gguf_path: pathlib.Path, out_dir: pathlib.Path, progress: bool) -> None:
    """``out_dir/model.safetensors``: every tensor dequantized to float32, HF names, Q/K rows un-interleaved
    (written to a temporary name, then renamed). The tensors come from gguf_weights' reader (gguf.GGUFReader
    would first spend ~7 s building objects for the vocabulary arrays)."""
    from xllm.models.gguf_weights import gguf_tensors

    _, stored = gguf_tensors(gguf_path)
    config = json.loads((out_dir / "config.json").read_text())
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(stored, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress):
        name = hf_tensor_name(t.name)
        tensors[name] = dequantize_float32(t.data, t.ggml_type, qk_heads(name, n_head, n_kv))
    tmp = out_dir / f".model.safetensors.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt", "source": gguf_path.name})
    tmp.rename(out_dir / "model.safetensors")

"""xLLM's ``--quantization w8a8`` weights as a compressed-tensors checkpoint, for vLLM.

vLLM serves W8A8 int8 from a compressed-tensors checkpoint (``int-quantized``: int8 weights with a
per-output-channel scale, activations quantized per token at run time: on a CPU without AMX it runs
oneDNN's int8 GEMM). :func:`write` loads a model as ``xllm serve --quantization w8a8`` does (SmoothQuant
scales folded in, weights rounded per channel) and stores exactly those int8 weights and scales under HF's
names, with the smoothed norms, so both servers multiply the same integers: the comparison of the two
engines on one quantized model (``python -m benchmarks serve-client --w8a8``). The LM head stays float in
vLLM's checkpoint (compressed-tensors' ``ignore``; the tied embedding is the float one), where xLLM runs
it in w8a8 too.

    python -m benchmarks w8a8_checkpoint            # write it for the bundled SmolLM2, print its dir
"""

from __future__ import annotations

import json
import pathlib
import shutil

from benchmarks.peers.venv import cache_root

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                        "dynamic": False, "group_size": None},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True, "group_size": None},
        },
    },
    "ignore": ["lm_head"],
}
_VERSION = 1  # bump when the layout written here changes (the cache is keyed on it)


def write(model_dir: pathlib.Path, root: pathlib.Path | None = None) -> pathlib.Path:
    """The checkpoint dir for ``model_dir`` (a Llama-family HF dir; written once under ``root``, default
    ``$XLLM_CACHE_DIR/bench/w8a8``, in a dir named like ``model_dir`` so both servers serve one name)."""
    import torch
    from safetensors.torch import load_file, save_file

    from xllm.models import load_model

    out = (root or cache_root() / "w8a8") / f"v{_VERSION}" / model_dir.name
    done = out / ".complete"
    if done.exists():
        return out
    model = load_model(model_dir, torch.bfloat16, progress=False, quantization="w8a8")
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        pre = f"model.layers.{i}."
        parts = {"self_attn.q_proj": (attn.qkv_proj, 0, attn.q_size),
                 "self_attn.k_proj": (attn.qkv_proj, attn.q_size, attn.kv_size),
                 "self_attn.v_proj": (attn.qkv_proj, attn.q_size + attn.kv_size, attn.kv_size),
                 "self_attn.o_proj": (attn.o_proj, 0, attn.o_proj.out_features),
                 "mlp.gate_proj": (mlp.gate_up_proj, 0, mlp.down_proj.in_features),
                 "mlp.up_proj": (mlp.gate_up_proj, mlp.down_proj.in_features, mlp.down_proj.in_features),
                 "mlp.down_proj": (mlp.down_proj, 0, mlp.down_proj.out_features)}
        for name, (module, r0, n) in parts.items():
            qw = module.qweight
            if qw.fmt != "w8a8":
                raise ValueError(f"{pre}{name}: expected w8a8 weights, got {qw.fmt}")
            tensors[f"{pre}{name}.weight"] = qw.data[r0:r0 + n].view(torch.int8).contiguous()
            tensors[f"{pre}{name}.weight_scale"] = qw.scales[r0:r0 + n].float().reshape(n, 1).contiguous()
        for norm in ("input_layernorm", "post_attention_layernorm"):  # smoothed
            tensors[f"{pre}{norm}.weight"] = getattr(layer, norm).weight.detach().contiguous()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in model_dir.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("generation_config.json",
                                                                         "special_tokens_map.json", "vocab.json",
                                                                         "merges.txt")):
            shutil.copy2(f, out / f.name)
    done.write_text("ok\n")
    return out

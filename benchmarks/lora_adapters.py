"""The ``lora`` benchmark's helpers: random PEFT LoRA adapters for a model (written with safetensors + torch,
no PEFT needed, cached), the servers' step time off their ``/metrics`` histograms, and each model's greedy text.

An adapter is what ``peft.LoraConfig(r, lora_alpha, target_modules).save_pretrained`` writes:
``adapter_config.json`` and ``adapter_model.safetensors`` holding, per decoder layer and target projection,
``base_model.model.model.layers.N.<self_attn|mlp>.<proj>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]`` (float32). A is drawn with std ``1/sqrt(in)`` (PEFT's Kaiming init has the same scale) and B with
std ``b_std``, not zero as PEFT starts it, so each adapter changes the model's outputs.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil

# target projection -> (decoder-layer block, (in, out) in terms of the config: "h" hidden, "i" intermediate,
# "q" query width (heads * head_dim), "kv" key/value width)
TARGETS: dict[str, tuple[str, tuple[str, str]]] = {
    "q_proj": ("self_attn", ("h", "q")), "k_proj": ("self_attn", ("h", "kv")),
    "v_proj": ("self_attn", ("h", "kv")), "o_proj": ("self_attn", ("q", "h")),
    "gate_proj": ("mlp", ("h", "i")), "up_proj": ("mlp", ("h", "i")), "down_proj": ("mlp", ("i", "h")),
}


def _widths(cfg: dict) -> dict[str, int]:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return {"h": cfg["hidden_size"], "i": cfg["intermediate_size"], "q": heads * head_dim,
            "kv": cfg.get("num_key_value_heads", heads) * head_dim}


def adapter_tensors(cfg: dict, rank: int, seed: int, b_std: float) -> dict:
    """PEFT's tensors of one random adapter on every target of every layer of the model ``cfg`` (its
    ``config.json``): ``{key: float32 tensor}``, the same for the same arguments."""
    import torch

    w = _widths(cfg)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, (block, (fan_in, fan_out)) in TARGETS.items():
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, w[fan_in], generator=g) / w[fan_in] ** 0.5
            out[f"{key}.lora_B.weight"] = torch.randn(w[fan_out], rank, generator=g) * b_std
    return out


def adapter_config(rank: int, alpha: int, base: str) -> dict:
    """``adapter_config.json`` of PEFT LoRA on every attention and dense MLP projection."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": list(TARGETS), "base_model_name_or_path": base, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "inference_mode": True}


def make_adapters(model_dir: pathlib.Path, root: pathlib.Path, n: int, rank: int = 8, alpha: int = 16,
                  seed: int = 0, b_std: float = 0.08) -> list[pathlib.Path]:
    """``n`` adapter directories for the model in ``model_dir``, adapter ``i`` seeded ``seed + i``, made once
    under ``root/<model>-<shape hash>/r<rank>-a<alpha>-b<b_std>-s<seed + i>`` (written beside, then renamed:
    a directory that exists is complete)."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    shape = hashlib.sha256(json.dumps(_widths(cfg) | {"layers": cfg["num_hidden_layers"]},
                                      sort_keys=True).encode()).hexdigest()[:10]
    home = root / f"{model_dir.name}-{shape}"
    dirs = []
    for i in range(n):
        path = home / f"r{rank}-a{alpha}-b{b_std:g}-s{seed + i}"
        if not (path / "adapter_model.safetensors").is_file():
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(adapter_tensors(cfg, rank, seed + i, b_std), str(tmp / "adapter_model.safetensors"),
                      metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(rank, alpha, str(model_dir)),
                                                                indent=1))
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        dirs.append(path)
    return dirs


# the servers' per-token histograms (seconds between a request's consecutive tokens, i.e. its decode steps)
STEP_HISTOGRAMS = ("xllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:time_per_output_token_seconds")


def step_buckets(base_url: str) -> tuple[str, dict[float, float]] | None:
    """The first of :data:`STEP_HISTOGRAMS` that ``base_url``'s ``/metrics`` exposes, as ``(name, {upper
    bound: cumulative count})`` summed over its label sets; None when it has none of them."""
    from benchmarks.metrics import scrape

    samples = scrape(base_url)
    for name in STEP_HISTOGRAMS:
        rows = samples.get(name + "_bucket")
        if rows:
            buckets: dict[float, float] = {}
            for labels, value in rows:
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + value
            return name, buckets
    return None


def step_quantiles(before: tuple[str, dict] | None, after: tuple[str, dict] | None) -> dict | None:
    """p50/p90 (ms) and count of the histogram's observations between two :func:`step_buckets` scrapes."""
    from benchmarks.metrics import histogram_quantile

    if before is None or after is None or before[0] != after[0]:
        return None
    delta = [(le, after[1][le] - before[1].get(le, 0.0)) for le in sorted(after[1])]
    count = delta[-1][1] if delta else 0
    if not count:
        return None
    return {"metric": after[0], "n": count, "p50_ms": histogram_quantile(delta, 0.5) * 1e3,
            "p90_ms": histogram_quantile(delta, 0.9) * 1e3}


def greedy_texts(base_url: str, models: list[str], prompt: list[int], tokens: int) -> dict[str, str]:
    """Each model's (base or adapter) greedy completion of ``prompt`` (token ids), ``tokens`` long, all sent
    at once: ``{model: text}``."""
    import asyncio

    import httpx

    async def one(client, model: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        resp = await client.post(base_url + "/v1/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {resp.status_code}: {resp.text[:200]}")
        return resp.json()["choices"][0]["text"]

    async def everyone() -> list[str]:
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            return await asyncio.gather(*(one(client, m) for m in models))

    return dict(zip(models, asyncio.run(everyone()), strict=True))

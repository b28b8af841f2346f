"""What the image benchmarks (``multimodal``, ``epd``) share: the random-weight Qwen2-VL models they serve (made once,
cached under ``$XLLM_CACHE_DIR/bench-models``; text ids are SmolLM2's, the vision tokens follow them) and their
plot of TTFT / TPOT p90 per configuration and kind of request."""

from __future__ import annotations

import shutil

SIZES = {  # (vision depth, width, heads), (LM layers, width, heads, KV heads, MLP)
    "small": ((12, 512, 8), (8, 576, 9, 3, 1536)),
    "tiny": ((2, 32, 2), (2, 64, 4, 2, 96)),
}
VOCAB = 49152  # text ids; the vision tokens follow
IMAGE_PAD = VOCAB + 1


def model_dir(size: str):
    """The random Qwen2-VL of ``size`` (made once, cached)."""
    import torch
    import transformers

    from xllm.common.paths import cache_dir
    from xllm.testing.models import flatten_vl_config, save_random_vl

    path = cache_dir() / "bench-models" / f"qwen2-vl-{size}-random"
    if (path / "config.json").is_file():
        return path
    (depth, dim, heads), (layers, hidden, qh, kvh, mlp) = SIZES[size]
    text = dict(vocab_size=VOCAB + 4, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                num_attention_heads=qh, num_key_value_heads=kvh, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3] if hidden == 64 else [8, 12, 12],
                                 "rope_theta": 10000.0})
    vision = dict(depth=depth, embed_dim=dim, hidden_size=hidden, num_heads=heads, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, vision_start_token_id=VOCAB,
                                     image_token_id=IMAGE_PAD, vision_end_token_id=VOCAB + 2,
                                     video_token_id=VOCAB + 3)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"[multimodal] making the random {size} Qwen2-VL (once) ...", flush=True)
    torch.manual_seed(0)
    save_random_vl(cfg, tmp)
    flatten_vl_config(tmp, tmp)
    tmp.rename(path)
    return path


def latency_bars_by_kind(axes, configs: dict) -> None:
    """On ``axes`` (two): TTFT p90 and TPOT p90 of each configuration in ``configs`` (name -> its row, with a
    ``serving_summary`` per kind), image and text requests side by side."""
    names = list(configs)
    for ax, metric, title in ((axes[0], "ttft_ms", "TTFT p90 (ms)"), (axes[1], "tpot_ms", "TPOT p90 (ms)")):
        for k, (kind, colour) in enumerate((("image", "#1f77b4"), ("text", "#ff7f0e"))):
            ys = [configs[n].get(kind, {}).get(metric, {}).get("p90") or 0 for n in names]
            ax.bar([i + (k - 0.5) * 0.35 for i in range(len(names))], ys, 0.35, color=colour, label=kind)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_title(title)
        ax.legend()

"""GGUF import: a fresh conversion of the bundled SmolLM2 GGUF holds exactly the
weights transformers' own GGUF loader produces, plus config, tokenizer and chat template."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from xllm.models import Tokenizer, resolve_model
from xllm.models.gguf_import import GGUFImportError, hf_tensor_name, unpermute_rows
from xllm.models.source import DEFAULT_MODEL, bundled_gguf, spec_needs_conversion


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF -> GGUF)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads,head_dim", [(9, 64), (3, 64), (1, 8), (4, 6)])
def test_unpermute_inverts_llamacpp_permutation(heads, head_dim):
    w = np.arange(heads * head_dim * 5, dtype=np.float32).reshape(heads * head_dim, 5)
    permuted = llamacpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rows(permuted, heads), w)
    b = np.arange(heads * head_dim, dtype=np.float32)  # 1-D (bias) rows too
    assert np.array_equal(unpermute_rows(llamacpp_permute(b, heads), heads), b)


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_tensor_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert hf_tensor_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    with pytest.raises(GGUFImportError, match=r"blk\.0\.ssm_in\.weight"):
        hf_tensor_name("blk.0.ssm_in.weight")


@pytest.fixture(scope="module")
def fresh_conversion(tmp_path_factory):
    """resolve_model() into an empty cache: the real bundled GGUF converted now, by this code (in a child
    process, as a torch-free cluster gateway converts it)."""
    cache = tmp_path_factory.mktemp("xcache")
    mp = pytest.MonkeyPatch()
    mp.setenv("XLLM_CACHE_DIR", str(cache))
    try:
        assert spec_needs_conversion(None)
        path = resolve_model(progress=False, isolated=True)
        assert not spec_needs_conversion("smollm2")
        again = resolve_model("smollm2", progress=False)  # alias, already converted: no second conversion
        mtime = (path / "model.safetensors").stat().st_mtime_ns
        assert again == path and (again / "model.safetensors").stat().st_mtime_ns == mtime
    finally:
        mp.undo()
    assert path == cache / "models" / DEFAULT_MODEL
    assert not list(path.parent.glob("*.tmp-*"))  # the temporary conversion dir was renamed away
    yield path
    shutil.rmtree(cache, ignore_errors=True)  # 0.5 GB of float32 weights


def _transformers_gguf_state_dict(auto_model) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loading of the bundled file (the oracle), float32. Its Python
    dequantization takes ~17 s, so its result is kept under the xLLM cache, keyed by the GGUF's
    SHA-256 and the transformers version (a new file or loader recomputes it; every fresh venv
    installs the file anew, so not its mtime)."""
    import transformers
    from safetensors.torch import load_file, save_file

    from xllm.common.paths import cache_dir

    gguf = bundled_gguf()
    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    key = f"{gguf.stem}-{digest}-tf{transformers.__version__}"
    cached = cache_dir("test-oracles", f"{key}.safetensors")
    if cached.is_file():
        return load_file(str(cached))
    hf = auto_model.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp-{os.getpid()}")
    save_file({k: v.clone() for k, v in state.items()}, str(tmp))  # tied tensors saved as copies
    tmp.replace(cached)
    return state


@pytest.mark.real_model
@pytest.mark.slow
def test_weights_equal_transformers_gguf_loader(fresh_conversion):
    from transformers import AutoModelForCausalLM

    expected = _transformers_gguf_state_dict(AutoModelForCausalLM)
    gguf = bundled_gguf()
    with safe_open(str(fresh_conversion / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata().get("source") == gguf.name
        # every HF tensor is there except the tied lm_head (HF ties it to the embedding: checked below)
        assert names == set(expected) - {"lm_head.weight"}
        for name in sorted(names):
            ours = f.get_tensor(name)
            assert ours.dtype == torch.float32
            assert torch.equal(ours, expected[name]), name
    assert torch.equal(expected["lm_head.weight"], expected["model.embed_tokens.weight"])


@pytest.mark.real_model
def test_converted_dir_has_config_tokenizer_and_chat_template(fresh_conversion):
    path = fresh_conversion
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    tok = Tokenizer(path)
    assert tok.has_chat_template and tok.vocab_size == 49152
    assert 2 in tok.eos_token_ids and tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                               "<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"

"""Model config parsing, the architecture registry and model-spec resolution (no weights needed)."""

from __future__ import annotations

import json

import pytest
import torch

from xllm.common import cache_dir
from xllm.models import (
    ARCHITECTURES,
    ModelConfig,
    ModelConfigError,
    ModelNotFoundError,
    load_model,
    model_class,
    resolve_model,
)
from xllm.models.config import rope_parameters
from xllm.models.layers import build_rotary
from xllm.models.llama import LlamaForCausalLM

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 96}


def write_config(path, **overrides):
    cfg = {**LLAMA, **overrides}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    assert {"LlamaForCausalLM", "MistralForCausalLM"} <= set(ARCHITECTURES.names())
    with pytest.raises(ModelConfigError) as err:
        model_class("GPT2LMHeadModel")
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and all(a in msg for a in ARCHITECTURES.names())
    write_config(tmp_path, architectures=["FalconForCausalLM"])
    with pytest.raises(ModelConfigError, match=r"FalconForCausalLM.*supported: .*LlamaForCausalLM"):
        load_model(tmp_path, progress=False)
    assert model_class("MistralForCausalLM") is LlamaForCausalLM


def test_config_fields_and_defaults():
    cfg = ModelConfig.from_dict(dict(LLAMA))
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps) == (16, 2, 10000.0, 1e-6)
    assert cfg.max_position_embeddings == 2048 and not cfg.tie_word_embeddings
    cfg = ModelConfig.from_dict({**LLAMA, "head_dim": 40, "num_key_value_heads": None, "dtype": "bfloat16",
                                 "rope_theta": 5e5, "tie_word_embeddings": True})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == (40, 4, 5e5)
    assert cfg.tie_word_embeddings and cfg.get("missing", 3) == 3


@pytest.mark.parametrize("raw,match", [
    ({**LLAMA, "architectures": []}, "architectures"),
    ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, "vocab_size"),
    ({**LLAMA, "num_key_value_heads": 3}, "multiple"),
])
def test_bad_configs(raw, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_rope_parameters_old_and_new_style():
    assert rope_parameters({"rope_theta": 7.0}) == {"rope_theta": 7.0, "rope_type": "default"}
    old = rope_parameters({"rope_theta": 7.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old == {"rope_type": "linear", "factor": 2.0, "rope_theta": 7.0}
    new = rope_parameters({"rope_parameters": {"rope_type": "llama3", "rope_theta": 9.0}, "rope_theta": 1.0})
    assert new == {"rope_type": "llama3", "rope_theta": 9.0}


def test_unsupported_activation_and_rope_type():
    with pytest.raises(ModelConfigError, match="gelu"):
        LlamaForCausalLM(ModelConfig.from_dict({**LLAMA, "hidden_act": "gelu"}))
    cfg = ModelConfig.from_dict({**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelConfigError, match="yarn"):
        build_rotary(cfg, cfg.head_dim)


def test_linear_rope_divides_the_frequencies():
    plain = build_rotary(ModelConfig.from_dict(dict(LLAMA)), 16)
    lin = build_rotary(ModelConfig.from_dict({**LLAMA, "rope_scaling": {"type": "linear", "factor": 4.0}}), 16)
    assert torch.allclose(lin.cos[40], plain.cos[10], atol=1e-5)  # position 40 scaled = position 10


def test_kv_cache_spec_of_llama():
    spec = LlamaForCausalLM(ModelConfig.from_dict({**LLAMA, "head_dim": 24})).kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.v_head_dim) == (2, 2, 24, 24)


def test_resolve_model_specs(tmp_path, monkeypatch):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    write_config(model_dir)
    assert resolve_model(str(model_dir)) == model_dir
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match=r"without config\.json"):
        resolve_model(str(empty))
    with pytest.raises(ModelNotFoundError, match="never downloaded"):
        resolve_model("some-org/some-model")
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("XLLM_CACHE_DIR")
    assert cache_dir().parts[-2:] == (".cache", "xllm")

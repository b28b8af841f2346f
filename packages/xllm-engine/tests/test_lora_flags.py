"""``--lora-modules NAME=PATH ...``, ``--max-loras``, ``--max-lora-rank``: the engine flags of multi-LoRA
(xllm.core.lora) into the EngineConfig, passed on to spawned engines, and the combinations refused."""

from __future__ import annotations

import argparse

import pytest

from xllm.core.config import EngineConfig
from xllm.engine.config import engine_config
from xllm.engine_api.errors import ConfigError
from xllm.engine_api.flags import add_engine_flags, add_handoff_flags, engine_args


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    add_handoff_flags(p)
    return p.parse_args(list(argv))


def test_flags_into_the_engine_config():
    cfg = engine_config(parse("--lora-modules", "sql=/a/sql", "chat=/b/chat=x", "--max-loras", "2",
                              "--max-lora-rank", "8"))
    assert cfg.lora_modules == {"sql": "/a/sql", "chat": "/b/chat=x"}  # (a path may hold '=')
    assert (cfg.max_loras, cfg.max_lora_rank) == (2, 8)
    default = engine_config(parse())
    assert (default.lora_modules, default.max_loras, default.max_lora_rank) == ({}, 4, 16)


def test_spawned_engines_get_the_same_flags():
    args = parse("--lora-modules", "sql=/a/sql", "chat=/b/chat", "--max-loras", "3")
    argv = engine_args(args, instances=1)
    i = argv.index("--lora-modules")
    assert argv[i + 1:i + 3] == ["sql=/a/sql", "chat=/b/chat"]
    again = parse(*argv)
    assert engine_config(again).lora_modules == engine_config(args).lora_modules
    assert again.max_loras == 3 and "--lora-modules" not in engine_args(parse(), instances=1)


@pytest.mark.parametrize("argv", [["--lora-modules", "sql"], ["--lora-modules", "=/a"], ["--max-loras", "0"],
                                  ["--max-lora-rank", "-1"]])
def test_malformed_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--lora-modules", "a=/x", "a=/y"], "given twice"),
    (["--lora-modules", "a=/x", "--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--lora-modules", "a=/x", "--compile-decode"], "--compile-decode"),
])
def test_refused_combinations(argv, message):
    with pytest.raises(ConfigError, match=message):
        engine_config(parse(*argv))


def test_config_bounds():
    with pytest.raises(ConfigError, match="max_loras"):
        EngineConfig(max_loras=0)
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineConfig(max_lora_rank=0)


def test_registration_lists_the_adapters(tmp_path):
    """The instance info an engine registers names its adapters and their KV hash roots (for gateways)."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from xllm.engine.loader import load_engine
    from xllm.models import resolve_model
    from xllm.models.lora import read_peft_adapter
    from xllm.testing.models import save_llama_9q3kv

    model_dir = save_llama_9q3kv(tmp_path / "llama", resolve_model(None, progress=False))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "sql")
    cfg = engine_config(parse("--lora-modules", f"sql={tmp_path / 'sql'}", "--dtype", "float32",
                              "--kv-cache-memory", "0.1", "--threads", "1"))
    loaded = load_engine(str(model_dir), "tiny", cfg, "lora-0", progress=False)
    try:
        assert list(loaded.info.model.lora_names) == ["sql"]
        assert list(loaded.info.model.lora_hash_roots) == [read_peft_adapter(tmp_path / "sql", 16).identity]
    finally:
        loaded.compute.call(loaded.engine.close)
        loaded.compute.shutdown()

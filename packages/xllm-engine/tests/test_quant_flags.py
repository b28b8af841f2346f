"""``--quantization`` and ``--dtype``: what weights an engine loads (issue 17; README "Quantized weights").

The bundled default and any GGUF keep their stored Q8_0/Q4_0/Q4_1 weights unless ``--dtype`` (or
``--quantization none``) asks for dequantized ones; ``int8`` / ``int4`` / ``int4_g128`` quantize a float
checkpoint at load; combinations quantized weights cannot run are refused with a message naming the flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from xllm.core.config import EngineConfig
from xllm.engine.config import engine_config
from xllm.engine.loader import stored_gguf, weights_suffix
from xllm.engine_api.errors import ConfigError
from xllm.engine_api.flags import add_engine_flags
from xllm.models.source import bundled_gguf


def config(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return engine_config(p.parse_args(list(argv)))


@pytest.mark.parametrize("argv, dtype, quantization", [
    ([], torch.bfloat16, "auto"),  # a GGUF keeps its stored weights, bf16 activations
    (["--dtype", "float32"], torch.float32, "none"),  # an explicit dtype: dequantized weights in it
    (["--dtype", "bfloat16", "--quantization", "auto"], torch.bfloat16, "none"),
    (["--quantization", "none"], torch.bfloat16, "none"),
    (["--quantization", "int8"], torch.bfloat16, "int8"),
    (["--quantization", "int4_g32", "--dtype", "float32"], torch.float32, "int4"),  # alias of int4
    (["--quantization", "int4_g128"], torch.bfloat16, "int4_g128"),
    (["--quantization", "w8a8"], torch.bfloat16, "w8a8"),
])
def test_flags_pick_the_weights(argv, dtype, quantization):
    cfg = config(*argv)
    assert (cfg.dtype, cfg.quantization) == (dtype, quantization)


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "int8", "--dtype", "float16"], "bfloat16 or float32"),
    (["--quantization", "int4", "--compile-decode"], "--compile-decode"),
])
def test_impossible_combinations_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        config(*argv)


def test_unknown_quantization_exits_2(capsys):
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    with pytest.raises(SystemExit) as exit_info:
        p.parse_args(["--quantization", "int3"])
    assert exit_info.value.code == 2 and "--quantization" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown quantization 'int3'"):
        EngineConfig(quantization="int3")


def test_which_gguf_is_loaded_as_stored(tmp_path):
    assert stored_gguf(None, config()) == bundled_gguf()  # the bundled default: its Q4_1 weights
    assert stored_gguf(None, config("--dtype", "bfloat16")) is None  # dequantized
    assert stored_gguf(str(tmp_path), config()) is None  # a model directory: float weights
    with pytest.raises(ConfigError, match="--compile-decode"):
        stored_gguf(None, config("--compile-decode"))
    assert stored_gguf(None, config("--dtype", "float32", "--compile-decode")) is None
    # KV tiers share blocks only between engines serving the same weights
    suffixes = {weights_suffix(config(*a), stored_gguf(None, config(*a)))
                for a in ([], ["--dtype", "bfloat16"], ["--quantization", "int8"], ["--quantization", "int4"])}
    assert len(suffixes) == 4

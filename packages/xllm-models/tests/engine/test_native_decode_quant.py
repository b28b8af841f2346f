"""The fused native steps (decode kernel and general step) on quantized weights against the eager module
path of the same model, for every format of xllm.kernels.quant: the layer structs carry each projection's
format tag and pointers and the kernels call the quantized GEMV (<= 8 rows) or the panel-dequantizing GEMM,
the kernels the eager QuantLinear calls one projection at a time."""

from __future__ import annotations

import contextlib

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.kernels import native, quant_native
from xllm.kernels.quant import FORMATS, GGUF_FORMATS
from xllm.models import load_model
from xllm.models.layers import QuantLinear
from xllm.models.llama_native import FusedLlamaForward
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.models import IdTokenizer, save_random_hf_model
from xllm.testing.quant import write_llama_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None or quant_native.library() is None,
                                reason="no fused native steps here (AVX-512)")

VOCAB = 512
FLAG = {"int8": "int8", "int4_g32": "int4", "int4_g128": "int4_g128", "w8a8": "w8a8"}
# The decode GEMV rounds activations to 16 bits per 32-block: a last-bit difference of an activation between
# the two paths (their norms and residual adds are separate implementations) can move one 16-bit step, so
# logprobs agree to ~1e-4 rather than to fp32 rounding (measured < 5e-4; with int8 activations: 0.008)
LP_TOL = 1e-3
# w8a8 rounds each product's activations to int8 per row (steps of 1/127 of the row's max): there the same
# last-bit difference moves logprobs by up to ~0.05 nats (measured 0.049); a wrong weight or row costs nats
LP_TOL_W8A8 = 0.15


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama whose every input size is a multiple of 128 (int4_g128 applies everywhere)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5)
    path = tmp_path_factory.mktemp("tiny-llama-q")
    save_random_hf_model(path, cfg, seed=9)
    return path


def load_quantized(fmt: str, dtype: torch.dtype, tiny_dir, tmp_path_factory):
    if fmt in GGUF_FORMATS:
        path = write_llama_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / f"tiny-{fmt}.gguf", fmt.upper())
        return load_model(tiny_dir, dtype, progress=False, gguf_file=path)
    return load_model(tiny_dir, dtype, progress=False, quantization=FLAG[fmt])


@contextlib.contextmanager
def decode_kernel_only(model):
    """Steps with a prefill chunk take the eager path (the general step off) while inside."""
    fused = model.fused_forward()
    before, fused.max_step_tokens = fused.max_step_tokens, 0
    try:
        yield
    finally:
        fused.max_step_tokens = before


def generate(model, prompts, native_decode: bool, n: int = 8, **config):
    eng = LLMEngine(model, IdTokenizer(), EngineConfig(dtype=model.dtype, native_decode=native_decode, num_threads=1,
                                                       max_model_len=256, **config))
    for i, p in enumerate(prompts):
        eng.add_request(engine_pb2.GenerateRequest(
            request_id=f"r{i}", prompt_token_ids=p,
            sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True)))
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    while eng.has_work():
        for c in eng.step():
            toks.setdefault(c.request_id, []).extend(c.token_ids)
            lps.setdefault(c.request_id, []).extend(x.logprob for x in c.logprobs)
    return toks, lps, dict(eng.runner.mode_steps), eng.runner.native_decode_steps


def prompts(k: int) -> list[list[int]]:
    """k prompts of 3-40 tokens, half of them opening with one 20-token prefix (prefix-cache hits)."""
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    out = []
    for i, n in enumerate(torch.randint(3, 20, (k,), generator=g).tolist()):
        tail = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        out.append(prefix + tail if i % 2 else tail)
    return out


def max_lp_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for r in a for x, y in zip(a[r], b[r], strict=True))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_steps_on_quantized_weights_equal_eager(fmt, tiny_dir, tmp_path_factory):
    model = load_quantized(fmt, torch.float32, tiny_dir, tmp_path_factory)
    assert all(isinstance(m, QuantLinear) for layer in model.model.layers
               for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
    assert FusedLlamaForward.model_supported(model) and model.fused_forward() is not None
    ps = prompts(10)
    eager, eager_lp, modes, _ = generate(model, ps, native_decode=False, max_num_batched_tokens=24)
    assert modes["eager"] > 0 and modes.get("native_step", 0) == 0
    # the general step: chunked prompts (budget 24) over cached prefixes, decode batches of 10 rows
    fused, fused_lp, modes, _ = generate(model, ps, native_decode=True, max_num_batched_tokens=24)
    assert modes["native_step"] > 0 and modes["eager"] == 0
    tol = LP_TOL_W8A8 if fmt == "w8a8" else LP_TOL
    assert fused == eager
    assert max_lp_diff(eager_lp, fused_lp) < tol
    # the decode kernel (6 rows per step: the quantized GEMV in both paths; prefills eager)
    eager, eager_lp, _, _ = generate(model, ps[:6], native_decode=False)
    with decode_kernel_only(model):
        fused, fused_lp, _, steps = generate(model, ps[:6], native_decode=True)
    assert steps > 0 and fused == eager
    assert max_lp_diff(eager_lp, fused_lp) < tol


@pytest.mark.parametrize("fmt", ["q4_1", "int4_g128"])
def test_bf16_fused_decode_on_quantized_weights_equals_eager(fmt, tiny_dir, tmp_path_factory):
    """bf16 activations: the fused kernels round where the eager ops do, so outputs follow closely."""
    model = load_quantized(fmt, torch.bfloat16, tiny_dir, tmp_path_factory)
    assert model.fused_forward() is not None
    ps = prompts(6)
    eager, eager_lp, _, _ = generate(model, ps, native_decode=False)
    with decode_kernel_only(model):
        fused, fused_lp, _, steps = generate(model, ps, native_decode=True)
    assert steps > 0
    assert fused == eager
    assert max_lp_diff(eager_lp, fused_lp) < 0.1

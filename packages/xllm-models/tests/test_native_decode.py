"""The fused native decode step against the eager module path (and so against HF, which the
eager path is tested against): Llama, Qwen2 (qkv bias), Qwen3 (q/k norm), fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.kernels import native
from xllm.models import load_model
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.models import save_random_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None, reason="native kernels unavailable")

COMMON = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


class IdTok:
    eos_token_ids = frozenset()

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    if request.param == "llama":
        cfg = transformers.LlamaConfig(**COMMON)
    elif request.param == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    else:
        cfg = transformers.Qwen3Config(**{**COMMON, "head_dim": 32}, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp(request.param)
    save_random_hf_model(path, cfg, seed=5)
    return path


def generate(model, prompts, native_decode: bool, n: int = 20):
    eng = LLMEngine(model, IdTok(), EngineConfig(dtype=model.dtype, native_decode=native_decode, num_threads=1,
                                                 max_model_len=256))
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
    return toks, lps, eng.runner.native_decode_steps


def prompts(k=5):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 1000, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (k,), generator=g)]


def test_fp32_fused_decode_equals_eager(model_dir):
    model = load_model(model_dir, torch.float32, progress=False)
    assert model.fused_decoder() is not None
    ps = prompts()
    eager, eager_lp, steps0 = generate(model, ps, native_decode=False)
    fused, fused_lp, steps1 = generate(model, ps, native_decode=True)
    assert steps0 == 0 and steps1 > 0
    assert fused == eager
    diff = max(abs(a - b) for r in eager_lp for a, b in zip(eager_lp[r], fused_lp[r]))
    assert diff < 1e-4, diff


def test_bf16_fused_decode_equals_eager(model_dir):
    """In bf16 too: the module path runs the same native kernels in the same order (the model
    tests hold both to HF fp32 by number, ``test_bf16_numerics``)."""
    model = load_model(model_dir, torch.bfloat16, progress=False)
    ps = prompts()
    eager, eager_lp, _ = generate(model, ps, native_decode=False)
    fused, fused_lp, steps = generate(model, ps, native_decode=True)
    assert steps > 0
    assert fused == eager
    assert fused_lp == eager_lp


def test_batches_over_eight_use_the_module_path(model_dir):
    model = load_model(model_dir, torch.float32, progress=False)
    ps = prompts(10)
    eager, _, _ = generate(model, ps, native_decode=False, n=6)
    fused, _, steps = generate(model, ps, native_decode=True, n=6)
    assert fused == eager
    assert steps == 0  # 10 decoding sequences: the native kernel takes at most 8

"""The fused native steps (decode kernel and general step) over a quantized KV cache (``kv_cache_dtype``
int8 / fp8_e4m3): they encode each new K/V head as the eager store does and attend over the codes with
the eager path's quantized attention kernels, so a tiny Llama's greedy outputs through chunked prefill,
prefix-cache hits and preemption equal the eager modules' over the same cache and the whole-sequence
oracle that quantizes and dequantizes K/V (xllm.testing.reference.FakeQuantKVContext)."""

from __future__ import annotations

import pytest
import torch

from xllm.kernels import native
from xllm.models import load_model
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import make_engine
from xllm.testing.models import IdTokenizer, save_random_hf_model
from xllm.testing.reference import FakeQuantKVContext, recompute_greedy

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable")

VOCAB = 256
KINDS = ("int8", "fp8_e4m3")
NEW = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama, head_dim 32 (the quantized kernels' bf16 query path needs a multiple of 32)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5)
    path = tmp_path_factory.mktemp("tiny-llama-kvq")
    save_random_hf_model(path, cfg, seed=13)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, VOCAB, (40,), generator=g).tolist()  # prefix-cache hits in 16-token blocks
    return [shared + torch.randint(0, VOCAB, (3 + 6 * i,), generator=g).tolist() for i in range(4)]


def run(model, prompts, waves, native_decode: bool, kind: str, **config):
    """Greedy ``NEW`` tokens per prompt, ``waves`` of prompt indices submitted one after the other."""
    config.setdefault("block_size", 16)
    eng = make_engine(model, kv_backend=config.pop("backend", "xtensor"), tokenizer=IdTokenizer(),
                      dtype=model.dtype, kv_cache_dtype=kind, native_decode=native_decode, max_model_len=128,
                      **config)
    toks: dict[int, list[int]] = {}
    lps: dict[int, list[float]] = {}
    for wave in waves:
        for i in wave:
            eng.add_request(engine_pb2.GenerateRequest(
                request_id=str(i), prompt_token_ids=prompts[i], sampling=engine_pb2.SamplingParams(
                    temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=True)))
        while eng.has_work():
            for c in eng.step():
                toks.setdefault(int(c.request_id), []).extend(c.token_ids)
                lps.setdefault(int(c.request_id), []).extend(x.logprob for x in c.logprobs)
    stats = (dict(eng.runner.mode_steps), eng.kv.prefix_stats.hits, eng.counters.num_preemptions)
    eng.close()
    return toks, lps, stats


def lp_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for r in a for x, y in zip(a[r], b[r], strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_fused_steps_over_quantized_kv_equal_eager_and_oracle(kind, tiny_dir, prompts):
    model = load_model(tiny_dir, torch.float32, progress=False)
    want = [recompute_greedy(model, p, NEW, FakeQuantKVContext(kind)) for p in prompts]
    waves = [[0], [1, 2, 3]]  # the first prompt's blocks are cached before the others arrive
    fused, fused_lp, (modes, hits, _) = run(model, prompts, waves, True, kind, max_num_batched_tokens=16)
    assert modes["eager"] == 0 and modes["native"] > 0 and modes["native_step"] > 0  # chunked general steps
    assert hits > 0
    eager, eager_lp, (modes, _, _) = run(model, prompts, waves, False, kind, max_num_batched_tokens=16)
    assert modes["native"] == modes["native_step"] == 0
    assert fused == eager and lp_diff(fused_lp, eager_lp) < 1e-4  # measured ~1e-6: the same kernels
    for i, (toks, lps) in enumerate(want):
        assert fused[i] == toks, f"prompt {i} diverges from the fake-quantized oracle"
        assert max(abs(a - b) for a, b in zip(fused_lp[i], lps)) < 2e-3
    # preemption (a pool the prompts fill; the prefix cache off so that the pool runs out), contiguous slots
    probe = make_engine(model, kv_cache_dtype=kind, block_size=16, max_model_len=128)
    per_block = probe.layout.bytes_per_token * 16
    probe.close()
    blocks = sum(-(-(len(p) + 2) // 16) for p in prompts)
    got, got_lp, (modes, _, preempted) = run(model, prompts, [[0, 1, 2, 3]], True, kind, enable_prefix_cache=False,
                                             kv_cache_memory_gib=blocks * per_block / 2**30)
    assert preempted > 0 and modes["eager"] == 0
    assert got == fused and lp_diff(got_lp, fused_lp) < 1e-4
    got, _, (modes, _, _) = run(model, prompts, [[0, 1, 2, 3]], True, kind, backend="contiguous")
    assert got == fused and modes["eager"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_fused_steps_over_quantized_kv_follow_eager(kind, tiny_dir, prompts):
    """bf16: the fused kernels round where the eager ops do; the attention over the codes is the same kernel."""
    model = load_model(tiny_dir, torch.bfloat16, progress=False)
    fused, fused_lp, (modes, _, _) = run(model, prompts, [[0, 1, 2, 3]], True, kind, max_num_batched_tokens=16)
    assert modes["eager"] == 0 and modes["native"] > 0
    eager, eager_lp, _ = run(model, prompts, [[0, 1, 2, 3]], False, kind, max_num_batched_tokens=16)
    assert fused == eager and lp_diff(fused_lp, eager_lp) < 0.05

"""The fused native steps against the eager module path (and so against HF, which the eager path
is tested against): Llama, Qwen2 (qkv bias), Qwen3 (q/k norm); the decode step in fp32 and bf16,
the general step (decode rows + prefill chunks, chunked prompts over a cached prefix, prefix-cache
hits) in fp32. bf16 general steps are held to HF fp32 on the real model (test_bf16_numerics)."""

from __future__ import annotations

import contextlib
import threading

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


@contextlib.contextmanager
def decode_kernel_only(model):
    """Steps with a prefill chunk take the eager path (the general step off) while inside."""
    fused = model.fused_forward()
    before, fused.max_step_tokens = fused.max_step_tokens, 0
    try:
        yield
    finally:
        fused.max_step_tokens = before


def generate(model, prompts, native_decode: bool, n: int = 20, modes: dict | None = None, **config):
    config = {"num_threads": 1, "max_model_len": 256, **config}
    eng = LLMEngine(model, IdTok(), EngineConfig(dtype=model.dtype, native_decode=native_decode, **config))
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
    if modes is not None:
        modes.update(eng.runner.mode_steps)
    return toks, lps, eng.runner.native_decode_steps


def prompts(k=5):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 1000, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (k,), generator=g)]


def test_fp32_fused_decode_equals_eager(model_dir):
    model = load_model(model_dir, torch.float32, progress=False)
    assert model.fused_forward() is not None
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
    with decode_kernel_only(model):  # the prefills take the eager path in both runs
        fused, fused_lp, steps = generate(model, ps, native_decode=True)
    assert steps > 0
    assert fused == eager
    assert fused_lp == eager_lp


def test_batches_over_eight_take_the_general_step(model_dir):
    model = load_model(model_dir, torch.float32, progress=False)
    ps = prompts(10)
    eager, eager_lp, _ = generate(model, ps, native_decode=False, n=6)
    modes: dict = {}
    fused, fused_lp, steps = generate(model, ps, native_decode=True, n=6, modes=modes)
    assert fused == eager
    assert max(abs(a - b) for r in eager_lp for a, b in zip(eager_lp[r], fused_lp[r])) < 1e-4
    assert steps == 0  # 10 decoding sequences: the decode kernel takes at most 8 ...
    assert modes["native_step"] > 0 and modes["eager"] == 0  # ... the general step all of them


def shared_prefix_prompts(k=8):
    """Prompts of 3-70 tokens, half of them opening with one 40-token prefix (prefix-cache hits)."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 1000, (40,), generator=g).tolist()
    out = []
    for i, n in enumerate(torch.randint(3, 30, (k,), generator=g).tolist()):
        tail = torch.randint(0, 1000, (n,), generator=g).tolist()
        out.append(prefix + tail if i % 2 else tail)
    return out


@pytest.mark.parametrize("budget", [5, 16, 64])
def test_fp32_general_step_equals_eager(model_dir, budget):
    """Chunks of every size mixed with decode rows: a budget of 5 splits prompts into many chunks
    over their cached prefix (and joins decodes with a chunk's tail), 64 prefills several prompts in
    one step; half the prompts hit a cached 40-token prefix."""
    model = load_model(model_dir, torch.float32, progress=False)
    ps = shared_prefix_prompts()
    eager, eager_lp, _ = generate(model, ps, native_decode=False, n=8, max_num_batched_tokens=budget)
    modes: dict = {}
    fused, fused_lp, _ = generate(model, ps, native_decode=True, n=8, max_num_batched_tokens=budget, modes=modes)
    assert modes["native_step"] > 0 and modes["eager"] == 0
    assert fused == eager
    assert max(abs(a - b) for r in eager_lp for a, b in zip(eager_lp[r], fused_lp[r])) < 1e-4


def test_general_step_without_packed_weights_streams_them(model_dir):
    """Where a weight has no packed copy (the packing contract not met), the general step streams
    the [N, K] weights in chunks of 8 rows: still the eager path's outputs."""
    model = load_model(model_dir, torch.float32, progress=False)
    fused = model.fused_forward()
    fused._packed = [[None] * 4 for _ in model.model.layers]
    ps = shared_prefix_prompts()
    eager, eager_lp, _ = generate(model, ps, native_decode=False, n=6, max_num_batched_tokens=64)
    modes: dict = {}
    got, got_lp, _ = generate(model, ps, native_decode=True, n=6, max_num_batched_tokens=64, modes=modes)
    assert modes["native_step"] > 0
    assert got == eager
    assert max(abs(a - b) for r in eager_lp for a, b in zip(eager_lp[r], got_lp[r])) < 1e-4


def test_engines_sharing_a_model_step_at_the_same_time(model_dir):
    """Two engines over one model object (a prefill/decode pair in one process) step concurrently from
    two threads: each keeps its own KV binding and workspace, so both produce what they produce alone."""
    model = load_model(model_dir, torch.float32, progress=False)
    work = {"a": prompts(6), "b": shared_prefix_prompts(6)}
    alone = {name: generate(model, ps, native_decode=True, n=30)[0] for name, ps in work.items()}
    together: dict[str, dict] = {}
    start = threading.Barrier(2)

    def run(name: str) -> None:
        start.wait()
        together[name] = generate(model, work[name], native_decode=True, n=30)[0]

    threads = [threading.Thread(target=run, args=(name,)) for name in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_decode_phase_timers_split_the_step_and_change_nothing(model_dir):
    """phase_seconds on decode steps: the decode kernel adds its phases' wall time (the GEMMs and attention
    positive, the rope + KV store slot zero: those run inside attention there), outputs unchanged."""
    model = load_model(model_dir, torch.float32, progress=False)
    fused = model.fused_forward()
    ps = prompts(3)
    with decode_kernel_only(model):
        plain = generate(model, ps, native_decode=True, n=6)[0]
        fused.phase_seconds = torch.zeros(len(fused.PHASES), dtype=torch.float64)
        try:
            timed, _, steps = generate(model, ps, native_decode=True, n=6)
            phases = dict(zip(fused.PHASES, fused.phase_seconds.tolist(), strict=False))
        finally:
            fused.phase_seconds = None
    assert steps > 0 and timed == plain
    assert fused.phase_seconds is None
    assert all(phases[p] > 0 for p in ("qkv GEMM", "attention", "o GEMM", "down GEMM")), phases
    assert phases["rope + KV store"] == 0


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory):
    """A Llama with 3 KV heads (SmolLM2's count: two threads share them 2:1) of head_dim 64 (the AMX decode
    attention's) and room for contexts of 1024 positions."""
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, head_dim=64,
                                   max_position_embeddings=1024)
    path = tmp_path_factory.mktemp("llama-long")
    save_random_hf_model(path, cfg, seed=11)
    return path


def test_bf16_batch1_long_context_decode_equals_eager_on_any_thread_count(long_context_dir):
    """A batch-1 decode at 600-630 positions (the module's other tests stay under 256): the fused decode's
    attention items are (row, KV head), three of them over one or two threads, each attending its head's
    whole context as the eager path does, so the tokens and logprobs are equal bit for bit."""
    model = load_model(long_context_dir, torch.bfloat16, progress=False)
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, 1000, (600,), generator=g).tolist()]
    eager, eager_lp, _ = generate(model, ps, native_decode=False, n=30, max_model_len=1024)
    with decode_kernel_only(model):
        for threads in (1, 2):
            toks, lps, steps = generate(model, ps, native_decode=True, n=30, max_model_len=1024, num_threads=threads)
            assert steps > 0, threads
            assert toks == eager, threads
            assert lps == eager_lp, threads

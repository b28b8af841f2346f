"""Quantized weights in the models (issue 17): a tiny random Llama in every format of xllm.kernels.quant
against the same model over the dequantized weights (forward logits, and the engine's greedy outputs
through chunked prefill, prefix-cache hits and preemption), and the bundled SmolLM2 GGUF loaded as stored
(bit-equal weights to its dequantized conversion, greedy agreement with it)."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.kernels import native, quant_native
from xllm.kernels.quant import FORMATS, GGUF_FORMATS, dequantize
from xllm.models import load_model
from xllm.models.layers import QuantEmbedding, QuantLinear
from xllm.models.quantize import weight_format
from xllm.models.source import gguf_file
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import unit_block_size
from xllm.testing.models import (
    IdTokenizer,
    run_engine,
    save_random_hf_model,
    tiny_deepseek_v2_config,
    tiny_qwen3_config,
)
from xllm.testing.quant import dequantized_twin, write_llama_gguf
from xllm.testing.reference import full_logits, recompute_greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

VOCAB = 512
# the name --quantization takes for each int format (the GGUF formats come from a GGUF file)
FLAG = {"int8": "int8", "int4_g32": "int4", "int4_g128": "int4_g128", "w8a8": "w8a8"}
# logprob tolerance of SmolLM2's quantized decode against the dequantized model: the native GEMV rounds
# activations to 16 bits per 32-block (measured: logprobs <= 6.4e-4 nats apart, 96 of 96 greedy tokens
# equal; with llama.cpp's int8 activations they were 0.34 nats apart and near-ties of 0.08 nats flipped,
# which turned the quick-start answer from Paris to "L'Étoile"; a wrong weight or KV row costs nats)
TOL_SMOLLM2 = 0.005
# w8a8 against its own no-cache recompute: one int8 step of an activation moved by a last-bit difference
# shifts logprobs by a few hundredths of a nat (measured near-tie flips 0.041 nats below the argmax)
TOL_W8A8 = 0.1


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama (hidden 128 so that int4_g128 applies to every input size; tied embeddings)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5)
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_hf_model(path, cfg, seed=5)
    return path


_MODELS: dict[str, tuple] = {}


def quantized(fmt: str, tiny_dir, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the tiny model with ``fmt`` weights, its float twin over the dequantized weights), built once."""
    if fmt not in _MODELS:
        if fmt in GGUF_FORMATS:
            path = write_llama_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / f"tiny-{fmt}.gguf", fmt.upper())
            model = load_model(tiny_dir, torch.float32, progress=False, gguf_file=path)
        else:
            model = load_model(tiny_dir, torch.float32, progress=False, quantization=FLAG[fmt])
        _MODELS[fmt] = (model, dequantized_twin(model, tiny_dir))
    return _MODELS[fmt]


def prompts_with_shared_prefix() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    system = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    return [system + torch.randint(0, VOCAB, (3 + 4 * i,), generator=g).tolist() for i in range(4)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_linear_is_quantized_and_matches_its_dequantized_twin(fmt, tiny_dir, tmp_path_factory):
    model, twin = quantized(fmt, tiny_dir, tmp_path_factory)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 2 * 4 and all(m.qweight.fmt == fmt for m in quant)  # qkv, o, gate_up, down per layer
    assert weight_format(model) == fmt and weight_format(twin) is None  # e.g. xllm profile's file name
    assert isinstance(model.model.embed_tokens, QuantEmbedding)  # the tied LM head reads it
    assert model.dtype == torch.float32
    # the quantization is real: the twin's weights are not the checkpoint's
    ref = load_model(tiny_dir, torch.float32, progress=False)
    w, w0 = twin.model.layers[0].mlp.down_proj.weight, ref.model.layers[0].mlp.down_proj.weight
    assert 0 < (w - w0).abs().max() < (10 if fmt == "w8a8" else 0.1) * w0.abs().max()  # (w8a8: smoothed too)
    ids = prompts_with_shared_prefix()[1]
    got, want = full_logits(model, ids), full_logits(twin, ids)
    if fmt != "w8a8":
        assert (got - want).abs().max() < 1e-3 * want.abs().max()
        return
    # w8a8 rounds every product's activations to int8 per row as well: the native kernels give exactly
    # the torch definition (xllm.kernels.quant.w8a8_reference), and the result stays near the float twin
    # (random weights, two layers: measured 7 % of the largest logit)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant_native, "linear", lambda *args, **kwargs: None)
        assert torch.equal(got, full_logits(model, ids))
    assert 0 < (got - want).abs().max() < 0.15 * want.abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_head_gives_the_sampled_tokens(fmt, tiny_dir, tmp_path_factory):
    """The engine's greedy LM head (a plain greedy step: the argmax from the quantized head's kernels, no
    logits) picks what the sampler picks from the logits (the same requests asking for logprobs), batched
    and alone, through prefill chunks."""
    model, _ = quantized(fmt, tiny_dir, tmp_path_factory)
    prompts = prompts_with_shared_prefix()
    for batch in (prompts, prompts[:1]):
        sampled = run_engine(model, IdTokenizer(), batch, 12, max_num_batched_tokens=32)
        plain = run_engine(model, IdTokenizer(), batch, 12, max_num_batched_tokens=32, logprobs=False)
        assert sampled.greedy_head_steps == 0 and plain.greedy_head_steps > 0
        assert plain.tokens == sampled.tokens


def near_greedy_gaps(twin, prompt: list[int], out: list[int], lps: list[float], tol: float) -> torch.Tensor:
    """Teacher-forced through the float ``twin`` (the dequantized weights): every generated token is the
    twin's argmax or within ``tol`` of it (the native decode GEMV rounds activations to int8 per 32-block,
    as llama.cpp does, so near-ties may flip), and its logprob within ``tol`` of the twin's. A wrong KV
    row or weight gives tokens far below the argmax. Returns each position's gap to the argmax."""
    rows = full_logits(twin, prompt + out[:-1])[len(prompt) - 1:].log_softmax(-1)
    chosen = rows[torch.arange(len(out)), torch.tensor(out)]
    gaps = rows.max(-1).values - chosen
    assert gaps.max() < tol, f"a generated token is {float(gaps.max())} nats below the greedy one"
    assert (chosen - torch.tensor(lps)).abs().max() < tol
    return gaps


@pytest.fixture
def torch_quant_linear(monkeypatch):
    """quant_linear on its torch path (dequantize + F.linear: the dequantized twin's exact arithmetic)
    instead of the native kernels (16-bit activations in the decode GEMV; they and the fused quantized
    step are checked against this path by the kernels' tests, and end to end on SmolLM2 below). The
    engines using it run the eager modules (``native_decode=False``)."""
    monkeypatch.setattr(quant_native, "linear", lambda *args, **kwargs: None)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "int4_g32", "int8", "w8a8"])
def test_engine_quantized_through_chunking_prefix_hits_and_preemption(fmt, tiny_dir, tmp_path_factory,
                                                                      torch_quant_linear):
    """The quantized model's greedy outputs through the engine's KV features (chunked prefill under a
    tiny token budget, prefix-cache hits on a shared prefix, preemption in a pool the prompts fill) are
    the dequantized twin's no-cache greedy tokens, logprobs within 1e-3. w8a8 has no float twin (its
    activations are rounded too): its oracle is the same model teacher-forced without a cache, every token
    its argmax or a near-tie (TOL_W8A8): the engine's batches, chunks and cached prefixes change no row's
    rounding, but the paged attention's last bits can move an activation across an int8 step."""
    model, twin = quantized(fmt, tiny_dir, tmp_path_factory)
    prompts, n = prompts_with_shared_prefix(), 20
    bs = unit_block_size(model)
    want = [recompute_greedy(twin, p, n) if fmt != "w8a8" else ([], []) for p in prompts]

    def run(waves, **config):
        eng = LLMEngine(model, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=256, num_threads=1,
                                                           native_decode=False, block_size=bs, **config))
        tokens: dict[str, list[int]] = {}
        lps: dict[str, list[float]] = {}
        for wave in waves:
            for i, p in wave:
                eng.add_request(engine_pb2.GenerateRequest(
                    request_id=f"r{i}", prompt_token_ids=p, sampling=engine_pb2.SamplingParams(
                        temperature=0, max_tokens=n, ignore_eos=True, logprobs=True)))
            while eng.has_work():
                for c in eng.step():
                    tokens.setdefault(c.request_id, []).extend(c.token_ids)
                    lps.setdefault(c.request_id, []).extend(lp.logprob for lp in c.logprobs)
        for i, (toks, lp) in enumerate(want):
            if fmt == "w8a8":
                near_greedy_gaps(model, prompts[i], tokens[f"r{i}"], lps[f"r{i}"], TOL_W8A8)
                continue
            assert tokens[f"r{i}"] == toks, f"prompt {i} diverges from the dequantized model"
            assert max(abs(a - b) for a, b in zip(lps[f"r{i}"], lp)) < 1e-3
        return eng

    indexed = list(enumerate(prompts))
    eng = run([indexed[:1], indexed[1:]], max_num_batched_tokens=8)  # chunked prefill + prefix hits
    assert eng.kv.prefix_stats.hits > 0
    assert eng.counters.steps > sum(len(p) for p in prompts[1:]) // 8
    probe = LLMEngine(model, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=256, num_threads=1,
                                                         block_size=bs))
    per_block = model.kv_cache_spec().bytes_per_token(torch.float32) * bs
    blocks = sum(probe.layout.blocks_for(len(p)) for p in prompts)  # the prompts fill the pool: decodes preempt
    eng = run([indexed], enable_prefix_cache=False, kv_cache_memory_gib=blocks * per_block / 2**30)
    assert eng.counters.num_preemptions > 0


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2"])
def test_quantization_at_load_for_other_architectures(arch, tmp_path):
    """--quantization applies to every architecture's Linear/MergedLinear projections (Qwen3's q/k-normed
    attention, DeepSeek-V2's MLA and MoE: experts and routers stay float), whatever input sizes allow."""
    cfg = tiny_qwen3_config() if arch == "qwen3" else tiny_deepseek_v2_config()
    save_random_hf_model(tmp_path, cfg, seed=2)
    model = load_model(tmp_path, torch.float32, progress=False, quantization="int8")
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) >= 2 * cfg.num_hidden_layers
    twin = dequantized_twin(model, tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    got, want = full_logits(model, ids), full_logits(twin, ids)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()


def test_gguf_tensors_reads_what_gguf_reader_reads(tiny_dir, tmp_path):
    """The loader's own GGUF header parser (gguf.GGUFReader spends seconds on a large vocabulary) against
    the gguf package's reader: names, types, shapes and bytes of every tensor."""
    import gguf
    import numpy as np

    from xllm.models.gguf_weights import gguf_tensors

    path = write_llama_gguf(tiny_dir, tmp_path / "tiny-q4_0.gguf", "Q4_0")
    meta, tensors = gguf_tensors(path)
    reader = gguf.GGUFReader(str(path))
    assert meta["general.architecture"] == "llama" and len(tensors) == len(reader.tensors) > 0
    for ours, theirs in zip(tensors, reader.tensors):
        assert (ours.name, ours.ggml_type) == (theirs.name, int(theirs.tensor_type))
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert np.array_equal(np.asarray(ours.data).reshape(-1), np.asarray(theirs.data).view(np.uint8).reshape(-1))


def test_conversion_without_weights_then_with_them(tiny_dir, tmp_path):
    """A GGUF served as stored needs only its conversion's config and tokenizer (resolve_model(weights=False));
    asking for the weights later adds the dequantized safetensors to that directory, equal to the file's."""
    import shutil

    from safetensors.torch import load_file

    from xllm.models.gguf_import import convert_gguf
    from xllm.models.source import _complete

    path = write_llama_gguf(tiny_dir, tmp_path / "tiny-q8.gguf", "Q8_0")
    out = tmp_path / "converted"
    out.mkdir()
    shutil.copy(tiny_dir / "config.json", out / "config.json")  # what the metadata-only conversion leaves
    assert _complete(out, weights=False) and not _complete(out)
    convert_gguf(path, out, progress=False, weights=True)
    assert _complete(out) and not list(out.glob(".*tmp*"))
    stored = load_model(tiny_dir, torch.float32, progress=False, gguf_file=path)
    tensors = load_file(out / "model.safetensors")
    qkv = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, dequantize(stored.model.layers[1].self_attn.qkv_proj.qweight))


def test_bad_quantization_requests_are_refused(tiny_dir, tmp_path_factory):
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        load_model(tiny_dir, torch.float32, progress=False, quantization="int3")
    path = write_llama_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf", "Q8_0")
    with pytest.raises(ValueError, match="keeps its own formats"):
        load_model(tiny_dir, torch.float32, progress=False, gguf_file=path, quantization="int8")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        load_model(tiny_dir, torch.float16, progress=False, gguf_file=path)
    with pytest.raises(ValueError, match="on the CPU"):
        load_model(tiny_dir, torch.float32, progress=False, quantization="int8", device="meta")


# ---- the bundled SmolLM2 GGUF as stored ------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_q4_1(smollm2_dir):
    return load_model(smollm2_dir, torch.float32, progress=False, gguf_file=gguf_file(None))


def test_smollm2_as_stored_holds_the_files_formats_bit_equal_to_its_conversion(smollm2_q4_1, smollm2_fp32):
    layer, ref = smollm2_q4_1.model.layers[7], smollm2_fp32.model.layers[7]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        lin = layer.get_submodule(name)
        assert isinstance(lin, QuantLinear) and lin.qweight.fmt == "q4_1"
        # Q/K rows un-interleaved and q, k, v stacked exactly as the converter's dequantized tensors
        assert torch.equal(dequantize(lin.qweight), ref.get_submodule(name).weight), name
    embed = smollm2_q4_1.model.embed_tokens
    assert isinstance(embed, QuantEmbedding) and embed.qweight.fmt == "q8_0"
    assert torch.equal(dequantize(embed.qweight), smollm2_fp32.model.embed_tokens.weight)
    # weights stay packed: 4.5 bits per Q4_1 weight, 8.5 per Q8_0 one
    packed = sum(m.qweight.nbytes() for m in smollm2_q4_1.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))
    assert packed < 0.2 * 4 * sum(p.numel() for p in smollm2_fp32.parameters())


def test_smollm2_q4_1_greedy_agrees_with_dequantized(smollm2_q4_1, smollm2_fp32, smollm2_tokenizer):
    """The Q4_1 model through the engine (fused native steps over the quantized weights, prompts prefilled in
    chunks of 16) against the dequantized model (its float twin): every generated token is the twin's greedy
    one (near-ties within TOL_SMOLLM2 could flip; none measured)."""
    prompts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three primary colors.", "Write a haiku about rain.")]
    n = 16
    got = run_engine(smollm2_q4_1, smollm2_tokenizer, prompts, n, max_num_batched_tokens=16)  # chunked prefill
    if native.unavailable_reason() is None:  # (AVX2 CPUs: eager steps over the AVX2 quantized products)
        assert got.mode_steps.get("eager", 0) == 0  # every step took the fused native step over the Q4_1 weights
    # without logprobs every step's tokens come from the Q8_0 head's greedy argmax (no logits): the same ones
    plain = run_engine(smollm2_q4_1, smollm2_tokenizer, prompts, n, max_num_batched_tokens=16, logprobs=False)
    assert plain.greedy_head_steps > 0 and plain.tokens == got.tokens
    gaps = torch.cat([near_greedy_gaps(smollm2_fp32, p, got.tokens[f"p{i}"], got.logprobs[f"p{i}"], TOL_SMOLLM2)
                      for i, p in enumerate(prompts)])
    assert (gaps == 0).float().mean() >= 0.95  # measured: 48 of 48 (int8 activations: 45 of 48)


def test_quant_embedding_lookup_and_range():
    """A quantized embedding looks up exactly the dequantized rows (native or torch), and an id out of range
    is an IndexError, never a read past the weight."""
    from xllm.kernels.quant import quantize

    emb = QuantEmbedding(quantize(torch.randn(50, 64) * 0.1, "q8_0"), torch.bfloat16)
    ids = torch.tensor([[4, 49], [0, 4]])
    out = emb(ids)
    assert out.shape == (2, 2, 64) and out.dtype == torch.bfloat16
    assert torch.equal(out.reshape(4, 64), dequantize(emb.qweight, torch.bfloat16)[ids.reshape(-1)])
    for bad in ([50], [-1]):
        with pytest.raises(IndexError):
            emb(torch.tensor(bad))

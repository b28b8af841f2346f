"""Tensor-parallel models over real collectives: two rank processes (``GlooComm`` on a loopback port),
each loading its shard with ``load_model(..., tp_rank, tp_size=2, comm)``, run ``forward`` +
``compute_logits`` + ``compute_greedy`` over a prompt (plain causal attention, no KV cache) and must give
the one-process model's outputs.

Oracle: Hugging Face transformers' float32 logits for the float checkpoints (``max |ours - HF| <
LOGIT_TOL * max |HF|``, and HF's argmax); for a Q4_1 / Q8_0 GGUF as stored, the one-process model of the
same file (the slices are the stored bytes); for ``--quantization int8``, the one-process float model of
the weights the ranks hold (each rank quantizes its slice, so a row-parallel projection's columns get a
scale per rank: :func:`_int8_twin`). On every rank: ``compute_greedy`` is ``compute_logits(...).argmax(-1)``
exactly, and both ranks hold the same logits. (``w8a8`` ranks are not compared: each rank smooths and
rounds its activations over its own channels, a different quantization than one process's.)

Shapes cover the split rules of :mod:`xllm.models.tp_plan`: 9 query / 3 KV heads (SmolLM2's GQA, split
6+3 / 2+1), 4 query heads on one KV head (replicated on both ranks), uneven intermediates (96 -> 64 + 32;
80 -> 40 + 40 channel-wise), odd vocabularies (501, 1001: the last rank holds one row fewer), tied and
untied heads, row-parallel biases, q/k norms, MoE experts and shared experts, MLA with 3 heads.

All cases run in one pair of processes (a module-scoped fixture), so the suite spawns once.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from xllm.models import load_model
from xllm.testing.models import run_ranks, save_random_hf_model
from xllm.testing.reference import full_logits

transformers = pytest.importorskip("transformers")

TP = 2
LOGIT_TOL = 1e-4   # float32, relative to max |HF logit| (the one-process model's own test bound)
QUANT_TOL = 1e-3   # quantized paths, relative; observed <= 1.4e-4 (int8 without its twin: 2e-2)
BF16_TOL = 3e-2    # bfloat16 activations, relative: the ranks round their partial sums before adding them
PROMPT = [3, 17, 250, 11, 499, 42, 7, 128, 64, 200, 5]


def _configs() -> dict[str, object]:
    t = transformers
    common = dict(max_position_embeddings=128, rms_norm_eps=1e-6)
    return {
        # SmolLM2's GQA (9 query / 3 KV heads: rank 0 holds KV heads 0-1, rank 1 KV head 2), tied, odd vocab
        "llama_9q3kv": t.LlamaConfig(vocab_size=501, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                     **common),
        # one KV head replicated on both ranks (2 query heads each); row-parallel o/down biases
        "llama_4q1kv_bias": t.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                                          mlp_bias=True, **common),
        "qwen2": t.Qwen2Config(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, **common),
        "qwen3": t.Qwen3Config(vocab_size=503, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=6, num_key_value_heads=3, head_dim=16, **common),
        "qwen3_moe": t.Qwen3MoeConfig(vocab_size=500, hidden_size=64, intermediate_size=80, moe_intermediate_size=48,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                      **common),
        # MLA without q LoRA, 3 heads (2 + 1), greedy top-2 of 6 experts + 2 shared, tied, odd vocab, MLP bias
        "deepseek_v2": t.DeepseekV2Config(vocab_size=1001, hidden_size=72, intermediate_size=96,
                                          moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=3,
                                          n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=2,
                                          first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                          qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                                          topk_method="greedy", tie_word_embeddings=True, mlp_bias=True, **common),
        # q LoRA (q_b_proj split), sigmoid routing with correction bias
        "deepseek_v3": t.DeepseekV3Config(vocab_size=999, hidden_size=72, intermediate_size=88,
                                          moe_intermediate_size=36, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
                                          n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                          q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=20, qk_rope_head_dim=12,
                                          v_head_dim=28, routed_scaling_factor=2.5, **common),
    }


def _quantized_llama() -> object:
    """Quantization-friendly shapes: 64-wide heads' o_proj columns and the 128 intermediate split on
    whole 32-blocks (4 + 2 heads of 16 would cut a block: 9 heads of 64 as SmolLM2 has are fine too)."""
    return transformers.LlamaConfig(vocab_size=500, hidden_size=192, intermediate_size=192, num_hidden_layers=2,
                                    num_attention_heads=6, num_key_value_heads=3, head_dim=32,
                                    tie_word_embeddings=True, max_position_embeddings=128, rms_norm_eps=1e-6)


def _int8_twin(path: pathlib.Path) -> torch.nn.Module:
    """The one-process float model of what ``--quantization int8`` ranks hold: every projection and the
    tied embedding quantized per output row (int8's per-channel scale, so a row's quantization does not
    depend on the split), except that each rank's columns of a row-parallel projection (``o_proj``,
    ``down_proj``) have their own scale, as the rank quantizes its slice; dequantized."""
    from xllm.kernels.quant import dequantize, quantize
    from xllm.models.config import ModelConfig
    from xllm.models.tensor_parallel import TPShard

    twin = load_model(path, torch.float32, progress=False)
    cfg = ModelConfig.from_dir(path)
    shards = [TPShard.for_config(cfg, r, TP) for r in range(TP)]
    with torch.no_grad():
        for name, module in twin.named_modules():
            if name.endswith(("o_proj", "down_proj")):
                kind = "o" if name.endswith("o_proj") else "mlp_row"
                spans = [s.cuts[kind].spans[0] for s in shards]
                module.weight.copy_(torch.cat([dequantize(quantize(module.weight[:, sp.start:sp.end], "int8"))
                                               for sp in spans], dim=1))
            elif name.endswith(("qkv_proj", "gate_up_proj", "embed_tokens")):
                module.weight.copy_(dequantize(quantize(module.weight, "int8")))
    twin.drop_packed()
    return twin


def _rank_main(rank: int, port: int, cases: dict[str, dict], out_dir: str) -> None:
    """One rank: every case's logits and greedy tokens with real collectives, saved for the parent."""
    torch.set_num_threads(1)
    os.environ["XLLM_GEMM"] = "native"  # no per-shape GEMM timing: the ranks' shapes are new to the cache
    from xllm.core.parallel.comm import GlooComm, GroupAddress
    from xllm.testing.reference import DenseContext

    comm = GlooComm(GroupAddress("127.0.0.1", port, timeout_s=120.0), rank, TP)
    results = {}
    try:
        with torch.inference_mode():
            for name, case in cases.items():
                model = load_model(case["path"], case.get("dtype", torch.float32), progress=False, tp_rank=rank,
                                   tp_size=TP, comm=comm,
                                   quantization=case.get("quantization", "none"), gguf_file=case.get("gguf_file"))
                ids = torch.tensor(PROMPT)
                hidden = model.forward(ids, torch.arange(len(PROMPT)), DenseContext())
                results[name] = {"logits": model.compute_logits(hidden), "greedy": model.compute_greedy(hidden),
                                 "kv_heads": model.kv_cache_spec().num_kv_heads}
        comm.barrier()
    finally:
        comm.close()
    torch.save(results, pathlib.Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (reference logits, tolerance, [rank 0 result, rank 1 result], one-process KV heads)."""
    from xllm.testing.quant import write_llama_gguf

    root = tmp_path_factory.mktemp("tp_ranks")
    cases: dict[str, dict] = {}
    refs: dict[str, tuple[torch.Tensor, float, int]] = {}
    ids = torch.tensor([PROMPT])
    for i, (name, cfg) in enumerate(_configs().items()):
        path = root / name
        hf = save_random_hf_model(path, cfg, seed=10 + i)
        with torch.no_grad():
            logits = hf(ids).logits[0].float()
        cases[name] = {"path": str(path)}
        refs[name] = (logits, LOGIT_TOL, load_model(path, torch.float32, progress=False).kv_cache_spec().num_kv_heads)
    qpath = root / "llama_quant"
    save_random_hf_model(qpath, _quantized_llama(), seed=3)
    quantized = {"gguf_q4_1": {"gguf_file": str(write_llama_gguf(qpath, root / "q4_1.gguf", "Q4_1"))},
                 "gguf_q8_0": {"gguf_file": str(write_llama_gguf(qpath, root / "q8_0.gguf", "Q8_0"))},
                 "int8": {"quantization": "int8"}}
    # bfloat16 activations (bf16 partial sums all-reduced): the one-process bf16 model, a bf16 tolerance
    cases["llama_9q3kv_bf16"] = {"path": cases["llama_9q3kv"]["path"], "dtype": torch.bfloat16}
    one = load_model(cases["llama_9q3kv"]["path"], torch.bfloat16, progress=False)
    refs["llama_9q3kv_bf16"] = (full_logits(one, PROMPT), BF16_TOL, one.kv_cache_spec().num_kv_heads)
    for name, extra in quantized.items():
        cases[name] = {"path": str(qpath), **extra}
        one = load_model(qpath, torch.float32, progress=False, **extra)
        if name == "int8":
            one = _int8_twin(qpath)
        refs[name] = (full_logits(one, PROMPT), QUANT_TOL, one.kv_cache_spec().num_kv_heads)
    ranks = run_ranks(_rank_main, (cases,), root / "out", TP)
    return {name: (*refs[name], [r[name] for r in ranks]) for name in cases}


FLOAT_CASES = ["llama_9q3kv", "llama_4q1kv_bias", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
QUANT_CASES = ["gguf_q4_1", "gguf_q8_0", "int8", "llama_9q3kv_bf16"]


@pytest.mark.parametrize("name", FLOAT_CASES + QUANT_CASES)
def test_ranks_give_the_one_process_logits(runs, name):
    ref, tol, _, ranks = runs[name]
    logits = ranks[0]["logits"]
    assert logits.shape == ref.shape and logits.dtype == torch.float32
    bound = tol * ref.abs().max().item()
    err = (logits - ref).abs().max().item()
    assert err < bound, f"{name}: max |tp - reference| = {err}"
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * bound  # positions whose argmax the tolerance cannot flip
    assert clear.sum() >= len(PROMPT) // 2
    assert torch.equal(logits.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert torch.equal(ranks[1]["logits"], logits)  # the gathered logits: the same on every rank


@pytest.mark.parametrize("name", FLOAT_CASES + QUANT_CASES)
def test_greedy_is_the_argmax_of_the_logits_on_every_rank(runs, name):
    for rank in runs[name][3]:
        assert torch.equal(rank["greedy"], rank["logits"].argmax(-1))


@pytest.mark.parametrize("name", ["llama_9q3kv", "llama_4q1kv_bias", "qwen3", "deepseek_v2"])
def test_each_rank_caches_its_own_kv_heads(runs, name):
    _, _, full_heads, ranks = runs[name]
    heads = [r["kv_heads"] for r in ranks]
    expected = {"llama_9q3kv": [2, 1], "llama_4q1kv_bias": [1, 1], "qwen3": [2, 1], "deepseek_v2": [1, 1]}[name]
    assert heads == expected
    if name in ("llama_9q3kv", "qwen3"):
        assert sum(heads) == full_heads  # split, not replicated


@pytest.mark.real_model
def test_smollm2_q4_1_gguf_over_two_ranks(tmp_path):
    """The bundled SmolLM2-135M Q4_1 GGUF as stored, split 6+3 query heads, 2+1 KV heads, 768+768 MLP
    channels and 24576+24576 vocabulary rows of its tied Q8_0 embedding: the one-process model's logits."""
    from xllm.models.source import ModelNotFoundError, gguf_file, resolve_model

    try:
        path, gguf = resolve_model(None, progress=False, weights=False), gguf_file(None)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    one = load_model(path, torch.float32, progress=False, gguf_file=gguf)
    ref = full_logits(one, PROMPT)
    del one
    ranks = run_ranks(_rank_main, ({"smollm2": {"path": str(path), "gguf_file": str(gguf)}},), tmp_path / "out", TP)
    for rank in ranks:
        logits = rank["smollm2"]["logits"]
        err = (logits - ref).abs().max().item()
        assert err < QUANT_TOL * ref.abs().max().item(), f"max |tp - one process| = {err}"
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
        assert torch.equal(rank["smollm2"]["greedy"], logits.argmax(-1))
    assert [r["smollm2"]["kv_heads"] for r in ranks] == [2, 1]

"""The overlapped forward of a tensor-parallel shard (``forward_overlapped``, xllm.core.overlap): two rank
processes over gloo (whose ``all_reduce_start`` runs in gloo's threads while the rank computes) run two
micro-batches, each a sequence with its own attention, their half-layers interleaved around the all-reduces.

Oracle: the one-process model's float32 logits of each sequence alone (``max |ours - one| < LOGIT_TOL * max
|one|`` and its argmax), and the shard's plain ``forward`` of each sequence (the same up to float rounding).
Cases: a Llama with 9 query / 3 KV heads split 6+3 / 2+1 and a tied odd vocabulary, and a Qwen3-MoE (q/k
norms, routed experts whose partial sums the layer all-reduces). Both ranks must hold the same logits.
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
LOGIT_TOL = 1e-4  # float32, relative to max |one-process logit| (as test_tensor_parallel_ranks)
SEQS = ([3, 17, 250, 11, 499, 42, 7, 128, 64, 200, 5], [9, 300, 41, 77, 2, 480, 13])


def _configs() -> dict[str, object]:
    t = transformers
    common = dict(max_position_embeddings=128, rms_norm_eps=1e-6)
    return {
        "llama_9q3kv": t.LlamaConfig(vocab_size=501, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                     **common),
        "qwen3_moe": t.Qwen3MoeConfig(vocab_size=500, hidden_size=64, intermediate_size=80, moe_intermediate_size=48,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                      **common),
    }


def _rank_main(rank: int, port: int, paths: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["XLLM_GEMM"] = "native"  # no per-shape GEMM timing in a test
    from xllm.core.overlap import MicroBatch
    from xllm.core.parallel.comm import GlooComm, GroupAddress
    from xllm.testing.reference import DenseContext

    comm = GlooComm(GroupAddress("127.0.0.1", port, timeout_s=120.0), rank, TP)
    results = {}
    try:
        with torch.inference_mode():
            for name, path in paths.items():
                model = load_model(path, torch.float32, progress=False, tp_rank=rank, tp_size=TP, comm=comm)
                ids = [torch.tensor(s) for s in SEQS]
                pos = [torch.arange(len(s)) for s in SEQS]
                pairs = list(zip(ids, pos, strict=True))
                plain = torch.cat([model.forward(i, p, DenseContext()) for i, p in pairs])
                over = model.forward_overlapped([MicroBatch(i, p, DenseContext()) for i, p in pairs])
                results[name] = {"supported": model.overlap_supported(), "plain": model.compute_logits(plain),
                                 "overlapped": model.compute_logits(over)}
        comm.barrier()
    finally:
        comm.close()
    torch.save(results, pathlib.Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (the one-process logits of each sequence, concatenated; [rank 0 result, rank 1 result])."""
    root = tmp_path_factory.mktemp("tp_overlap")
    paths, refs = {}, {}
    for i, (name, cfg) in enumerate(_configs().items()):
        path = root / name
        save_random_hf_model(path, cfg, seed=20 + i)
        paths[name] = str(path)
        one = load_model(path, torch.float32, progress=False)
        assert not one.overlap_supported()  # one process: no all-reduce to hide
        refs[name] = torch.cat([full_logits(one, s) for s in SEQS])
    ranks = run_ranks(_rank_main, (paths,), root / "out", TP)
    return {name: (refs[name], [r[name] for r in ranks]) for name in paths}


@pytest.mark.parametrize("name", ["llama_9q3kv", "qwen3_moe"])
def test_the_overlapped_forward_gives_each_sequences_logits(runs, name):
    ref, ranks = runs[name]
    got = ranks[0]["overlapped"]
    assert ranks[0]["supported"] and got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err < LOGIT_TOL * ref.abs().max().item(), f"{name}: max |overlapped - one process| = {err}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(got, ranks[0]["plain"], rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(ranks[1]["overlapped"], got)  # every rank holds the same sums

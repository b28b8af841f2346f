"""One engine over two ranks (``--tensor-parallel-size 2``: rank 0 here, rank 1 a spawned worker) for every
architecture the split rules cover beyond Llama: Qwen2 (q/k/v biases, one KV head replicated on both ranks),
Qwen3 (q/k norms, 6 query / 3 KV heads split 4+2 / 2+1), Qwen3-MoE (experts split channel-wise, a dense
layer), DeepSeek-V2 (MLA with 3 heads split 2+1, the latent whole on both ranks; greedy top-2 routing,
shared experts) and DeepSeek-V3 (MLA with q LoRA, sigmoid routing with correction bias and group-limited
top-k). Tiny random models, saved as transformers saves them, with SmolLM2's tokenizer (the grammar of the
JSON-schema request needs one).

Oracle: the one-process engine (TP=1) of the same weights and flags: greedy and seeded-sampling outputs
identical token for token, through chunked prefill (a small token budget), a prefix-cache hit (a shared prefix
longer than a block), preemption (KV memory for a few blocks), ngram speculation and a JSON-schema constrained
request; and Hugging Face ``generate`` for the greedy tokens. Each architecture loads both engines once (a
module fixture) and serves one workload shared by all of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch

from xllm.core.config import EngineConfig
from xllm.engine.loader import LoadedEngine, load_engine
from xllm.models import load_model, resolve_model
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected, drive_loaded, make_request
from xllm.testing.models import save_tp_arch_model, tiny_tp_arch_configs
from xllm.testing.reference import hf_greedy_tokens

transformers = pytest.importorskip("transformers")

SYSTEM = list(range(1000, 1140))  # a shared prefix longer than one xTensor block (128 tokens)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
BLOCKS = 3  # 128-token KV blocks on rank 0: the workload preempts
#: the archs of :func:`tiny_tp_arch_configs` -> KV heads rank 0 caches at TP=1 and TP=2 (Qwen2's one
#: replicated, Qwen3's 3 split 2+1, MLA's latent whole on each rank)
KV_HEADS = {"qwen2": (1, 1), "qwen3": (3, 2), "qwen3_moe": (2, 1), "deepseek_v2": (1, 1), "deepseek_v3": (1, 1)}
ARCHS = list(KV_HEADS)


def config(tp: int, memory_gib: float) -> EngineConfig:
    return EngineConfig(dtype=torch.float32, quantization="none", kv_cache_backend="xtensor", max_num_seqs=6,
                        max_num_batched_tokens=64, kv_cache_memory_gib=memory_gib, max_model_len=512,
                        speculative="ngram", num_speculative_tokens=3, num_threads=1, tensor_parallel_size=tp)


def workload() -> list[engine_pb2.GenerateRequest]:
    reqs = []
    for i in range(4):  # a shared prefix (hits once it is cached), long enough to be chunked
        reqs.append(make_request(f"greedy{i}", SYSTEM + [2000 + 7 * i + j for j in range(6 + i)], max_tokens=24,
                                 ignore_eos=True))
    for i in range(3):  # a prompt that repeats itself: the ngram proposer drafts from it
        reqs.append(make_request(f"sampled{i}", SYSTEM[:60] * 2 + [3000 + i], temperature=0.8, top_p=0.95,
                                 seed=11 + i, max_tokens=24, ignore_eos=True))
    # a token biased far above the rest: its output repeats it, so the ngram proposer drafts it and verify steps
    # accept the drafts (the random model's own text never repeats itself)
    reqs.append(make_request("biased", SYSTEM[:20], max_tokens=24, logit_bias={500: 100.0}, ignore_eos=True))
    schema = engine_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    reqs.append(make_request("json", [4000 + j for j in range(20)], max_tokens=40, structured=schema))
    return reqs


@dataclass
class Served:
    """One engine's outputs for the workload, and the counters that show what it went through."""

    got: Collected
    prefix_hits: int
    preemptions: int
    accepted: int
    group_size: int
    block_size: int
    kv_heads: int  # the KV heads this process caches


def serve(loaded: LoadedEngine, reqs) -> Served:
    engine = loaded.engine
    try:
        got = drive_loaded(loaded, reqs)  # the engine steps on its compute thread (as AsyncEngine runs it)
        group = getattr(engine.runner, "group", None)  # the rank group (TP > 1 only)
        return Served(got, engine.kv.prefix_stats.hits, engine.counters.num_preemptions,
                      engine.spec.counters.num_accepted_tokens, group.size if group is not None else 1,
                      engine.layout.block_size, engine.layout.spec.num_kv_heads)
    finally:
        engine.close()
        loaded.compute.shutdown()


def rank0_memory(path, tp: int) -> float:
    """GiB for ``BLOCKS`` 128-token blocks of rank 0's KV over ``tp`` ranks: the KV heads split as evenly as
    possible, the first rank holding the extra one (MLA's one latent head is whole on every rank)."""
    spec = load_model(path, torch.float32, progress=False).kv_cache_spec()
    heads = math.ceil(spec.num_kv_heads / tp)
    per_token = spec.num_layers * heads * (spec.head_dim + spec.v_head_dim) * 4
    return BLOCKS * 128 * per_token / 2**30


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    """(arch, model dir, TP=1 outputs, TP=2 outputs) of the shared workload, each engine loaded once."""
    name = request.param
    path = save_tp_arch_model(tmp_path_factory.mktemp("tp_archs") / name, name,
                              resolve_model(None, progress=False))
    reqs = workload()
    one = serve(load_engine(str(path), name, config(1, rank0_memory(path, 1)), f"tp1-{name}", progress=False), reqs)
    two = serve(load_engine(str(path), name, config(2, rank0_memory(path, 2)), f"tp2-{name}", progress=False), reqs)
    return name, path, one, two


def test_two_ranks_generate_what_one_does(arch):
    name, _, one, two = arch
    reqs = workload()
    assert set(tiny_tp_arch_configs()) == set(ARCHS)
    assert two.group_size == 2 and one.group_size == 1
    assert (one.kv_heads, two.kv_heads) == KV_HEADS[name]
    assert two.block_size == one.block_size == 128  # what the KV memory and the shared prefix are sized for
    assert set(two.got.final) == set(one.got.final) == {r.request_id for r in reqs}
    for r in reqs:
        assert two.got.tokens[r.request_id] == one.got.tokens[r.request_id], (name, r.request_id)
        assert len(two.got.tokens[r.request_id]) > 0
    assert two.got.text["json"].startswith('{"name": "'), two.got.text["json"]  # constrained
    assert two.prefix_hits > 0, "no prefix-cache hit"
    assert two.preemptions > 0, "no preemption"
    assert two.accepted > 0, "no draft accepted"


def test_greedy_tokens_match_hugging_face(arch):
    _, path, _, two = arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for r in workload()[:2]:
        want = hf_greedy_tokens(hf, list(r.prompt_token_ids), r.sampling.max_tokens)
        assert two.got.tokens[r.request_id] == want, r.request_id

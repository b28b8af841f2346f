"""ContiguousKVCache accounting, the backend registry, EngineConfig and SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, parse_dtype
from xllm.core.kv import KVCacheLayout
from xllm.core.kv.contiguous import ContiguousKVCache
from xllm.core.model_api import KVCacheSpec
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import Sequence
from xllm.engine_api.errors import ConfigError, InvalidRequestError
from xllm.engine_api.names import KV_BACKENDS
from xllm.proto.engine.v1 import engine_pb2

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, v_head_dim=4)


def layout(num_blocks=10, max_num_seqs=3, max_model_len=64, block_size=4) -> KVCacheLayout:
    return KVCacheLayout(SPEC, torch.float32, torch.device("cpu"), max_num_seqs, max_model_len, block_size, num_blocks)


def new_seq(n_prompt: int = 5) -> Sequence:
    return Sequence("s", list(range(n_prompt)), SamplingParams(max_tokens=8), 0.0)


def test_spec_bytes_per_token():
    assert SPEC.bytes_per_token(torch.float32) == 3 * 2 * (8 + 4) * 4
    assert SPEC.bytes_per_token(torch.bfloat16) == 3 * 2 * (8 + 4) * 2
    assert KVCacheSpec(2, 1, 576, 0).bytes_per_token(torch.float32) == 2 * 576 * 4  # latent cache


def test_contiguous_tensors_follow_the_layout():
    kv = KV_BACKENDS.create("contiguous", layout())
    assert isinstance(kv, ContiguousKVCache)
    k, v = kv.layer_kv(2)
    assert k.shape == (3, 64, 2, 8) and v.shape == (3, 64, 2, 4) and k.dtype == torch.float32
    latent = ContiguousKVCache(KVCacheLayout(KVCacheSpec(1, 1, 16, 0), torch.bfloat16, torch.device("cpu"),
                                             2, 8, 4, 4))
    assert latent.layer_kv(0)[1] is None
    with pytest.raises(ValueError, match="contiguous"):
        KV_BACKENDS.create("paged-v9", layout())


def test_allocate_and_free_accounting():
    kv = ContiguousKVCache(layout(num_blocks=10, block_size=4))
    a, b = new_seq(), new_seq()
    assert kv.allocate(a, 5)                     # 5 tokens -> 2 blocks
    assert a.slot is not None and kv.num_free_blocks == 8
    a.num_computed_tokens = 5
    assert kv.allocate(a, 3) and kv.num_free_blocks == 8    # 8 tokens still fit in 2 blocks
    a.num_computed_tokens = 8
    assert kv.allocate(a, 1) and kv.num_free_blocks == 7    # the 9th token opens block 3
    assert kv.allocate(b, 16) and kv.num_free_blocks == 3 and b.slot != a.slot
    assert kv.usage == pytest.approx(0.7) and kv.free_tokens == 12
    kv.free(a)
    assert a.slot is None and kv.num_free_blocks == 6
    kv.free(a)                                    # freeing twice is harmless
    assert kv.num_free_blocks == 6
    kv.free(b)
    assert kv.num_free_blocks == 10 and kv.usage == 0.0


def test_failed_allocation_changes_nothing():
    kv = ContiguousKVCache(layout(num_blocks=4, block_size=4))
    a, b = new_seq(), new_seq()
    assert kv.allocate(a, 12)                     # 3 blocks
    assert not kv.allocate(b, 8)                  # needs 2, only 1 left
    assert b.slot is None and kv.num_free_blocks == 1
    a.num_computed_tokens = 12
    assert not kv.allocate(a, 5)                  # 17 tokens -> 5 blocks > 4
    assert kv.num_free_blocks == 1
    assert kv.allocate(b, 4) and kv.num_free_blocks == 0


def test_slots_and_context_limit():
    kv = ContiguousKVCache(layout(num_blocks=100, max_num_seqs=2, max_model_len=16))
    s1, s2, s3 = new_seq(), new_seq(), new_seq()
    assert kv.allocate(s1, 1) and kv.allocate(s2, 1)
    assert not kv.allocate(s3, 1) and s3.slot is None   # out of slots
    assert {s1.slot, s2.slot} == {0, 1}
    s1.num_computed_tokens = 1
    assert not kv.allocate(s1, 16)                      # past max_model_len
    kv.free(s2)
    assert kv.allocate(s3, 1) and s3.slot in (0, 1)


def test_engine_config_validation():
    assert EngineConfig(dtype="bf16").dtype == torch.bfloat16
    assert parse_dtype("FLOAT32") == torch.float32 and parse_dtype(torch.float16) == torch.float16
    with pytest.raises(ConfigError, match="unknown dtype"):
        parse_dtype("int3")
    for bad in (dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(block_size=0), dict(max_model_len=1),
                dict(kv_cache_memory_gib=0), dict(num_threads=0), dict(max_waiting_requests=0)):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)
    cfg = EngineConfig(max_model_len=100)
    assert cfg.resolve_max_model_len(200) == 100
    assert EngineConfig().resolve_max_model_len(300) == 300
    with pytest.raises(ConfigError, match="exceeds"):
        cfg.resolve_max_model_len(50)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -0.1), ("temperature", 101.0), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -1), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("top_logprobs", 21), ("stop", ("ok", "")),
])
def test_sampling_params_reject_out_of_range_values(field, value):
    kwargs = {"max_tokens": 8, field: value}
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == field


def test_sampling_params_from_proto_defaults_and_fields():
    p = SamplingParams.from_proto(engine_pb2.SamplingParams(max_tokens=5))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    assert p.seed is None and p.skip_special_tokens and not p.greedy and not p.needs_penalties
    p = SamplingParams.from_proto(engine_pb2.SamplingParams(
        max_tokens=5, temperature=0.0, seed=0, stop=["x"], stop_token_ids=[3], logit_bias={4: -1.0},
        skip_special_tokens=False, frequency_penalty=0.5, min_tokens=2))
    assert p.greedy and p.seed == 0 and p.stop == ("x",) and p.stop_token_ids == frozenset({3})
    assert p.logit_bias == {4: -1.0} and not p.skip_special_tokens and p.needs_penalties and p.min_tokens == 2
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_proto(engine_pb2.SamplingParams(max_tokens=2, min_tokens=3))
    assert err.value.param == "min_tokens"


def test_sequence_token_slice():
    s = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=4), 0.0, output_ids=[4, 5])
    assert s.token_slice(0, 5) == [1, 2, 3, 4, 5]
    assert s.token_slice(1, 2) == [2] and s.token_slice(3, 5) == [4, 5] and s.token_slice(2, 4) == [3, 4]
    assert s.num_tokens == 5 and s.last_token == 5


def test_backends_implement_the_three_kv_contracts_and_each_user_holds_its_own():
    """Every backend is the allocator, tensor and transfer contract (each member its own, not the
    protocol's stub); the scheduler holds the KV as its allocator, the model runner as its tensors."""
    import inspect

    from xllm.core.kv import KVAllocator, KVTensors, KVTransfer
    from xllm.core.model_runner import ModelRunner
    from xllm.core.scheduler import Scheduler

    for name in KV_BACKENDS:
        cls = KV_BACKENDS.get(name)
        for contract in (KVAllocator, KVTensors, KVTransfer):
            assert contract in cls.__mro__  # declared, not only shaped alike
            members = [m for m, v in vars(contract).items()
                       if not m.startswith("_") and (callable(v) or isinstance(v, property))]
            assert members
            for m in members:
                assert getattr(cls, m) is not getattr(contract, m), f"{name} lacks {contract.__name__}.{m}"
    assert inspect.signature(Scheduler.__init__).parameters["kv"].annotation == "KVAllocator"
    assert inspect.signature(ModelRunner.__init__).parameters["kv"].annotation == "KVTensors"


def test_kv_modules_import_nothing_of_the_engine_above_them():
    """The KV package imports, of xllm.core, only itself, the model contract and the sequence (no
    runner, scheduler or engine: what addressing reads of a packed step is its own PackedStep)."""
    import ast
    import pathlib

    import xllm.core.kv as kv_package

    for path in pathlib.Path(kv_package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xllm.core."):
                assert node.module.startswith("xllm.core.kv") or node.module in (
                    "xllm.core.model_api", "xllm.core.sequence"), f"{path.name} imports {node.module}"


def test_a_backend_that_cannot_run_names_its_substitute(caplog):
    """build_kv_cache names no backend: xTensor, without virtual memory control on the device, asks
    for the paged backend, which sizes itself (16-token blocks)."""
    from xllm.core.kv.base import build_kv_cache

    kv = build_kv_cache("xtensor", SPEC, torch.float32, torch.device("meta"), 2, 64, 0.001)
    assert type(kv).__name__ == "PagedKVCache" and kv.layout.block_size == 16 and kv.layout.row_align == 1
    assert "using the paged backend" in caplog.text


def test_expert_parallel_flags_are_checked_together():
    """--enable-expert-parallel needs ranks; EPLB and redundant experts need expert parallelism (issue 46)."""
    with pytest.raises(ConfigError, match="--enable-expert-parallel places experts over the ranks"):
        EngineConfig(enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="--enable-eplb and --num-redundant-experts need --enable-expert-parallel"):
        EngineConfig(tensor_parallel_size=2, enable_eplb=True, num_redundant_experts=2)
    with pytest.raises(ConfigError, match="--eplb-policy"):
        EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True, eplb_policy="random")
    with pytest.raises(ConfigError, match="--eplb-step-interval"):
        EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True, eplb_step_interval=0)
    cfg = EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2, enable_eplb=True)
    assert cfg.enable_eplb and cfg.num_redundant_experts == 2

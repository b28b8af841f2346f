"""The engine over quantized KV caches (``kv_cache_dtype`` int8 / fp8_e4m3) on the tiny model.

Oracle: with per-token, per-head scales every token's K/V row quantizes on its own, so the engine's
outputs must not depend on batching, chunking, prefix-cache hits or preemption: they must equal a
whole-sequence forward whose attention fake-quantizes K/V (quantize + dequantize with the torch
reference of xllm.kernels.kv_quant) and attends with plain causal SDPA, no cache, recomputed for
every generated token. The tiny model's head width is 16, so the native quantized kernels run.
Quantized pages also move as bytes through a disk tier and a PD hand-off; capacity, block layout and
refusals are checked on the sizes alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from xllm.core.config import EngineConfig
from xllm.core.kv.base import build_kv_cache
from xllm.core.kv.xtensor import quantized_block_layout
from xllm.core.model_api import KVCacheSpec
from xllm.engine_api.errors import ConfigError
from xllm.kernels.kv_quant import row_bytes
from xllm.testing.engine import Collected, HandoffListener, generate, make_engine, make_request
from xllm.testing.reference import FakeQuantKVContext, recompute_greedy
from xllm.testing.tiny import TinyLM

KINDS = ("int8", "fp8_e4m3")
NEW = 10
SMOLLM2 = KVCacheSpec(30, 3, 64, 64)


def reference_greedy(model, prompt: list[int], n: int, kind: str) -> tuple[list[int], list[float]]:
    return recompute_greedy(model, prompt, n, FakeQuantKVContext(kind))


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(head_dim=16)


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, model.vocab_size) for _ in range(70)]
    return [shared + [rng.randrange(3, model.vocab_size) for _ in range(5 + 7 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def expected(model, prompts) -> dict[str, tuple[list[list[int]], list[list[float]]]]:
    out = {}
    for kind in KINDS:
        runs = [reference_greedy(model, p, NEW, kind) for p in prompts]
        out[kind] = ([r[0] for r in runs], [r[1] for r in runs])
    return out


def check(got, expected, kind: str, rids: list[str]) -> None:
    tokens, lps = expected[kind]
    for i, rid in enumerate(rids):
        assert got.tokens[rid] == tokens[i], f"{rid} diverges from the fake-quantized reference"
        diff = max(abs(a - b) for a, b in zip(got.logprobs[rid], lps[i], strict=True))
        assert diff < 2e-3, f"{rid}: logprobs differ from the reference by {diff}"


def engine(model, backend: str, kind: str, **config):
    if backend == "xtensor":
        config.setdefault("block_size", 32)  # prefix blocks inside the tiny model's 160-token context
    return make_engine(model, kv_backend=backend, kv_cache_dtype=kind, max_model_len=160, **config)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["xtensor", "paged", "contiguous"])
def test_chunked_prefill_and_prefix_hits_match_reference(model, prompts, expected, kind, backend):
    eng = engine(model, backend, kind, max_num_batched_tokens=24)
    first = generate(eng, [make_request("r0", prompts[0], max_tokens=NEW, ignore_eos=True, logprobs=True)])
    rest = generate(eng, [make_request(f"r{i}", p, max_tokens=NEW, ignore_eos=True, logprobs=True)
                          for i, p in enumerate(prompts[1:], 1)])
    first.tokens.update(rest.tokens)
    first.logprobs.update(rest.logprobs)
    assert eng.layout.quantized and eng.runner.mode_steps["eager"] == eng.counters.steps
    assert eng.counters.steps > sum(len(p) for p in prompts) // 24  # prompts were prefilled in chunks
    if backend != "contiguous":
        bs = eng.layout.block_size
        assert eng.kv.prefix_stats.hits == 2 * (70 // bs * bs)  # the shared 70 tokens' full blocks
    check(first, expected, kind, ["r0", "r1", "r2"])
    eng.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["xtensor", "paged"])
def test_preemption_matches_reference(model, prompts, expected, kind, backend):
    probe = engine(model, backend, kind)
    bs, per_token = probe.layout.block_size, probe.layout.bytes_per_token
    probe.close()
    blocks = max(sum(-(-len(p) // bs) for p in prompts), -(-(len(prompts[-1]) + NEW) // bs))
    eng = engine(model, backend, kind, enable_prefix_cache=False, kv_cache_memory_gib=blocks * bs * per_token / 2**30)
    got = generate(eng, [make_request(f"r{i}", p, max_tokens=NEW, ignore_eos=True, logprobs=True)
                         for i, p in enumerate(prompts)])
    assert eng.counters.num_preemptions > 0
    check(got, expected, kind, ["r0", "r1", "r2"])
    eng.close()


@pytest.mark.parametrize("backend", ["paged", "xtensor"])
def test_capacity_is_about_twice_bf16(backend):
    """The backend's token capacity counts the real bytes of a quantized token (codes, scales, padding)."""
    def kv(kind):
        return build_kv_cache(backend, SMOLLM2, torch.bfloat16, torch.device("cpu"), 4, 2048, 0.25, kv_dtype=kind)

    base = kv("auto")
    for kind in KINDS:
        q = kv(kind)
        lay = q.layout
        assert lay.bytes_per_token == 30 * 2 * lay.row_bytes(64) and lay.row_bytes(64) >= 3 * 68
        assert q.layout.capacity_tokens >= 1.8 * base.layout.capacity_tokens
        assert q.physical_bytes_in_use() == 0 and lay.fingerprint != base.layout.fingerprint
        assert kind in lay.fingerprint and "bfloat16" not in lay.fingerprint
        k, v = q.layer_kv(0)
        assert k.dtype == torch.uint8 and k.shape[-1] == lay.row_bytes(64) and v.shape == k.shape
        q.close()
    base.close()


def test_xtensor_block_layout():
    # SmolLM2: 204-byte rows; 256-token blocks of 208-byte rows are whole pages with 2 % padding
    assert quantized_block_layout(SMOLLM2, None) == (256, 16)
    # 8 KV heads of 128: 1056-byte rows, 64-token blocks of 1088 bytes
    assert quantized_block_layout(KVCacheSpec(32, 8, 128, 128), None) == (64, 64)
    assert quantized_block_layout(SMOLLM2, 32) == (32, 128)  # a given block size: rows padded to fit
    assert (32 * row_bytes(3, 64, 128)) % 4096 == 0


def test_refusals():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    latent = KVCacheSpec(2, 1, 64, 0)
    with pytest.raises(ValueError, match="latent"):
        build_kv_cache("paged", latent, torch.float32, torch.device("cpu"), 2, 64, 0.01, kv_dtype="int8")
    with pytest.raises(ValueError, match="divisible by 4"):
        build_kv_cache("paged", KVCacheSpec(2, 1, 6, 6), torch.float32, torch.device("cpu"), 2, 64, 0.01,
                       kv_dtype="fp8_e4m3")


def test_quantized_blocks_round_trip_through_a_disk_tier(model, tmp_path):
    """Quantized pages (codes and scales) written down to T2 come back into T0 with the reference's outputs;
    an engine whose KV format differs (fp8 against int8) finds none of them (the layout namespace)."""
    rng = random.Random(9)
    prompts = {k: [rng.randrange(3, model.vocab_size) for _ in range(100)] for k in "ABC"}
    want = reference_greedy(model, prompts["A"], NEW, "int8")[0]
    probe = engine(model, "xtensor", "int8")
    per_block = probe.layout.block_size * probe.layout.bytes_per_token
    probe.close()

    def tiered(kind):
        return engine(model, "xtensor", kind, kv_model_identity="tiny-lm", kv_disk_dir=str(tmp_path / "disk"),
                      kv_cache_memory_gib=5 * per_block / 2**30)  # T0 holds about one request

    eng = tiered("int8")
    try:
        for k in "ABC":
            got = generate(eng, [make_request(k, prompts[k], max_tokens=NEW, ignore_eos=True)]).tokens[k]
            assert k != "A" or got == want
        assert eng.kv.lower.store.flush(30)
        got = generate(eng, [make_request("A2", prompts["A"], max_tokens=NEW, ignore_eos=True)]).tokens["A2"]
        assert got == want and eng.kv.tier_stats()["disk"].hits == 99 // 32
    finally:
        eng.close()
    other = tiered("fp8_e4m3")
    try:
        generate(other, [make_request("A3", prompts["A"], max_tokens=NEW, ignore_eos=True)])
        assert other.kv.tier_stats()["disk"].hits == 0
    finally:
        other.close()


@pytest.mark.parametrize("kind", KINDS)
def test_pd_handoff_moves_quantized_pages(model, prompts, expected, kind):
    """A prefill engine's quantized pages (codes and scales, copied as bytes through the PageStores) let a
    decode engine continue with the reference's tokens."""
    from xllm.proto.engine.v1 import engine_pb2

    prefill, decode = (engine(model, "xtensor", kind, max_num_batched_tokens=24) for _ in range(2))
    prefill.attach_disagg(HandoffListener())
    decode.attach_disagg(HandoffListener())
    try:
        req = make_request("r", prompts[2], max_tokens=NEW, ignore_eos=True)
        req.disagg_phase = engine_pb2.DISAGG_PHASE_DECODE
        got = Collected()
        got.add(decode.add_request(req))
        got.add(decode.step())
        res = decode.disagg.reserved["r"]
        req = make_request("r", prompts[2], max_tokens=NEW, ignore_eos=True)
        req.disagg_phase = engine_pb2.DISAGG_PHASE_PREFILL
        req.kv_target.CopyFrom(engine_pb2.KVTarget(transfer_id="r", matched_tokens=res.matched_tokens,
                                                   layout=decode.layout.fingerprint))
        prefill.add_request(req)
        while "r" not in prefill.disagg.handoffs:  # the first token streams from the prefill side
            got.add(c for c in prefill.step() if c.finish_reason != engine_pb2.FINISH_REASON_HANDED_OFF)
        handoff = prefill.disagg.handoffs["r"]
        src, dst = prefill.kv.page_store(), decode.kv.page_store()
        assert src.layout == dst.layout and kind in src.layout
        for j in range(-(-res.num_tokens // decode.layout.block_size)):
            dst.write_block(res.pages[j], src.read_block(handoff.pages[j]))
        got.add(decode.install_kv(engine_pb2.KVCommit(transfer_id="r", num_tokens=handoff.num_tokens,
                                                      first_token=handoff.first_token)))
        prefill.release_kv("r")
        while decode.has_work():
            got.add(decode.step())
        assert got.tokens["r"] == expected[kind][0][2]
    finally:
        prefill.close()
        decode.close()

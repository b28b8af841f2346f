"""One engine instance over two ranks (``--tensor-parallel-size 2``): rank 0 here, rank 1 a spawned worker
process, a tiny random Llama split 6+3 query / 2+1 KV heads (SmolLM2's 9:3 GQA).

Oracle: the one-process engine (TP=1) of the same weights and flags: greedy and seeded-sampling outputs
identical token for token, through chunked prefill (a small token budget), prefix-cache hits, preemption
(KV memory for a few sequences), ngram speculation and a JSON-schema constrained output, on the xTensor
(the worker mirrors rank 0's page mappings) and paged KV backends; and Hugging Face ``generate`` for the
greedy tokens. A worker SIGKILLed mid-stream fails the instance within seconds (its streams end with a
crash error), never hangs it. Flags TP does not support yet are refused at start-up (KV tiers, beam search and
self-speculation with TP: test_tensor_parallel_features.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import pytest
import torch

from xllm.core.async_engine import AsyncEngine
from xllm.core.config import EngineConfig
from xllm.engine.config import engine_config
from xllm.engine.loader import LoadedEngine, load_engine
from xllm.engine_api import flags
from xllm.engine_api.errors import ConfigError
from xllm.models import resolve_model
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected, drive_loaded, make_request, stream_until_killed
from xllm.testing.models import save_llama_9q3kv
from xllm.testing.reference import hf_greedy_tokens

transformers = pytest.importorskip("transformers")

SYSTEM = list(range(1000, 1140))  # a shared prefix longer than one xTensor block (128 tokens)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_llama_9q3kv(tmp_path_factory.mktemp("tp") / "llama_9q3kv", resolve_model(None, progress=False))


def config(backend: str, tp: int, blocks: int = 3, overlapped: bool = False, **extra) -> EngineConfig:
    # ``blocks`` 128-token blocks' KV on rank 0 (2 of 3 KV heads of 16, fp32, 2 layers: 512 B per token); 3: the
    # workload preempts
    memory = blocks * 128 * 512 / 2**30
    return EngineConfig(dtype=torch.float32, quantization="none", kv_cache_backend=backend, max_num_seqs=6,
                        max_num_batched_tokens=64, kv_cache_memory_gib=memory, max_model_len=512,
                        speculative="ngram", num_speculative_tokens=3, num_threads=1, tensor_parallel_size=tp,
                        async_scheduling=overlapped, **extra)


def load(model_dir, backend: str, tp: int, blocks: int = 3, overlapped: bool = False) -> LoadedEngine:
    return load_engine(str(model_dir), "tiny", config(backend, tp, blocks, overlapped), f"tp{tp}-{backend}",
                       progress=False)


def workload() -> list[engine_pb2.GenerateRequest]:
    reqs = []
    for i in range(4):  # a shared prefix (hits once it is cached), long enough to be chunked
        reqs.append(make_request(f"greedy{i}", SYSTEM + [2000 + 7 * i + j for j in range(6 + i)], max_tokens=24))
    for i in range(3):  # a prompt that repeats itself: the ngram proposer drafts from it
        reqs.append(make_request(f"sampled{i}", SYSTEM[:60] * 2 + [3000 + i], temperature=0.8, top_p=0.95,
                                 seed=11 + i, max_tokens=24))
    # a token biased far above the rest: its output repeats it, so the ngram proposer drafts it and verify steps
    # accept the drafts (the random model's own text never repeats itself)
    reqs.append(make_request("biased", SYSTEM[:20], max_tokens=24, logit_bias={500: 100.0}))
    schema = engine_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    reqs.append(make_request("json", [4000 + j for j in range(20)], max_tokens=40, structured=schema))
    return reqs


def serve(loaded: LoadedEngine, reqs) -> tuple[Collected, dict]:
    engine, got = loaded.engine, drive_loaded(loaded, reqs)
    return got, {"counters": engine.counters, "modes": dict(engine.runner.mode_steps),
                 "prefix": engine.kv.prefix_stats, "spec": engine.spec.counters}


@pytest.mark.parametrize(("backend", "overlapped"), [("xtensor", False), ("paged", False), ("xtensor", True)],
                         ids=["xtensor", "paged", "xtensor-async"])
def test_two_ranks_generate_what_one_does(model_dir, backend, overlapped):
    reqs = workload()
    one = load(model_dir, backend, 1, overlapped=overlapped)
    try:
        want, _ = serve(one, reqs)
    finally:
        one.engine.close()
        one.compute.shutdown()
    two = load(model_dir, backend, 2, overlapped=overlapped)
    try:
        assert two.engine.runner.group.size == 2
        got, stats = serve(two, reqs)
    finally:
        two.engine.close()
        two.compute.shutdown()
    assert set(got.final) == {r.request_id for r in reqs}
    for r in reqs:
        assert got.tokens[r.request_id] == want.tokens[r.request_id], r.request_id
    assert got.text["json"].startswith('{"name": "')  # constrained (the random model's string runs on)
    assert stats["prefix"].hits > 0, "no prefix-cache hit"
    assert stats["counters"].num_preemptions > 0, "no preemption"
    assert stats["spec"].num_accepted_tokens > 0, "no draft accepted"


def test_greedy_tokens_match_hugging_face_at_two_ranks_and_workers_outlive_group_signals(model_dir):
    """Also: SIGTERM and SIGINT to the worker (as a supervisor's or a terminal's signal to the whole process
    group delivers them) leave it serving, under rank 0's graceful drain; it exits 0 when rank 0 closes."""
    prompt = SYSTEM[:30]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    want = hf_greedy_tokens(hf, prompt, 16)
    two = load(model_dir, "xtensor", 2)
    worker = two.engine.runner.group.processes[0]
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(worker.pid, sig)
        got, _ = serve(two, [make_request("hf", prompt, max_tokens=16, ignore_eos=True)])
    finally:
        two.engine.close()
        two.compute.shutdown()
    assert got.tokens["hf"] == want
    assert worker.exitcode == 0


def test_a_killed_worker_fails_the_instance_within_seconds(model_dir):
    two = load(model_dir, "xtensor", 2, blocks=8)
    worker = two.engine.runner.group.processes[0]
    aeng = AsyncEngine(two.engine, compute=two.compute)
    aeng.start()
    try:
        n, err, after = stream_until_killed(aeng, SYSTEM[:20], lambda: os.kill(worker.pid, signal.SIGKILL))
        assert err is not None and n < 400, "the stream did not fail"
        assert after < 10
        assert aeng.crashed and "RankFailed" in (aeng.dead_reason or "")
    finally:
        aeng.shutdown(5)
        two.engine.close()
        two.compute.shutdown()
    assert worker.exitcode == -signal.SIGKILL


def test_unsupported_flags_and_requests_are_refused(model_dir):
    for extra, flag in [(dict(compile_decode=True), "--compile-decode"),
                        (dict(speculative="mtp", num_speculative_tokens=1), "--speculative mtp"),
                        (dict(kv_disk_dir="/tmp/x", kv_cache_dtype="int8"), "KV tiers .*--kv-cache-dtype int8")]:
        with pytest.raises(ConfigError, match=f"--tensor-parallel-size 2 does not support .*{flag}"):
            EngineConfig(tensor_parallel_size=2, **{**dict(speculative=None), **extra})
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    parser = argparse.ArgumentParser()
    flags.add_engine_process_arguments(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2", "--role", "prefill", "--kv-cache-dtype", "int8"])
    with pytest.raises(ConfigError, match="--kv-cache-dtype int8"):  # quantized rows are not resharded yet
        engine_config(args)
    assert engine_config(parser.parse_args(["--tensor-parallel-size", "2"])).tensor_parallel_size == 2

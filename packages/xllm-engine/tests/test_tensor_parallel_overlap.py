"""Compute/communication overlap in a two-rank engine (``--tensor-parallel-size 2 --tp-comm gloo --tp-overlap``,
xllm.core.overlap): the eager steps (gloo takes no fused native step) run as two micro-batches whose
all-reduces interleave, rank 0's choice reaching the worker in the step plan.

Oracle: the one-process engine (TP=1) of the same weights and flags: greedy and seeded-sampling outputs
identical token for token, through chunked prefill (a 64-token budget: prompt chunks beside decodes) and
ngram speculation (verify chunks). Forced on, every step of two or more sequences runs overlapped; with
``auto`` rank 0 times both ways per step size, keeps the faster and logs its decision once.
"""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from xllm.core.config import EngineConfig
from xllm.engine.config import engine_config
from xllm.engine.loader import LoadedEngine, load_engine
from xllm.engine_api import flags
from xllm.models import resolve_model
from xllm.testing.engine import Collected, drive_loaded, make_request
from xllm.testing.models import save_llama_9q3kv

pytest.importorskip("transformers")

SYSTEM = list(range(1000, 1100))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_llama_9q3kv(tmp_path_factory.mktemp("tp_overlap") / "llama_9q3kv", resolve_model(None, progress=False))


def load(model_dir, tp: int, overlap: str = "auto") -> LoadedEngine:
    cfg = EngineConfig(dtype=torch.float32, quantization="none", kv_cache_backend="xtensor", max_num_seqs=6,
                       max_num_batched_tokens=64, kv_cache_memory_gib=8 * 128 * 512 / 2**30, max_model_len=512,
                       speculative="ngram", num_speculative_tokens=3, num_threads=1, tensor_parallel_size=tp,
                       tp_comm="gloo", tp_overlap=overlap)
    return load_engine(str(model_dir), "tiny", cfg, f"tp{tp}-overlap-{overlap}", progress=False)


def workload() -> list:
    reqs = [make_request(f"greedy{i}", [*SYSTEM[:40 + 9 * i], 2000 + i], max_tokens=20) for i in range(4)]
    reqs += [make_request(f"sampled{i}", [*SYSTEM[:30] * 2, 3000 + i], temperature=0.8, top_p=0.95, seed=11 + i,
                          max_tokens=20) for i in range(3)]
    return reqs


def serve(loaded: LoadedEngine, reqs) -> tuple[Collected, dict]:
    try:
        return drive_loaded(loaded, reqs), dict(loaded.engine.runner.mode_steps)
    finally:
        loaded.engine.close()
        loaded.compute.shutdown()


@pytest.fixture(scope="module")
def one_rank(model_dir) -> Collected:
    return serve(load(model_dir, 1), workload())[0]


@pytest.mark.parametrize("overlap", ["on", "auto"])
def test_overlapped_two_ranks_generate_what_one_does(model_dir, one_rank, overlap, caplog):
    reqs = workload()
    two = load(model_dir, 2, overlap)
    runner = two.engine.runner
    chooser = runner.overlap
    assert chooser is not None and chooser.mode == overlap
    paths: set[tuple[bool, str]] = set()  # (two or more sequences, the path taken)
    path = runner.path

    def recording(batch, listening=False):
        mode = path(batch, listening)
        paths.add((batch.num_decode + batch.num_prefill_seqs > 1, mode))
        return mode

    runner.path = recording
    with caplog.at_level(logging.INFO, logger="xllm.core.overlap"):
        got, modes = serve(two, reqs)
    assert set(got.final) == {r.request_id for r in reqs}
    for r in reqs:
        assert got.tokens[r.request_id] == one_rank.tokens[r.request_id], r.request_id
    assert modes["overlap"] > 0
    said = [r.getMessage() for r in caplog.records if r.name == "xllm.core.overlap"]
    if overlap == "on":
        assert paths == {(True, "overlap"), (False, "eager")} and not said  # one sequence: nothing to split
    else:  # both ways tried, a decision per step size that saw enough steps, each said once
        assert (True, "eager") in paths and chooser.decisions
        assert len(said) == len(chooser.decisions) and all("median of 3 steps" in s for s in said)


def test_overlap_is_off_without_ranks_or_when_asked(model_dir):
    parser = argparse.ArgumentParser()
    flags.add_engine_process_arguments(parser)
    assert engine_config(parser.parse_args(["--tensor-parallel-size", "2"])).tp_overlap == "auto"
    assert engine_config(parser.parse_args(["--tensor-parallel-size", "2", "--tp-overlap", "off"])).tp_overlap == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["--tp-overlap", "sometimes"])
    one = load(model_dir, 1, "on")  # one process: nothing to overlap (build_runner arms it for ranks only)
    try:
        assert one.engine.runner.overlap is None
    finally:
        one.engine.close()
        one.compute.shutdown()
    two = load(model_dir, 2, "off")
    try:
        assert two.engine.runner.overlap is None
    finally:
        two.engine.close()
        two.compute.shutdown()

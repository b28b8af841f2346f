"""ComputeThread: one thread for loading, building and stepping an engine (one OpenMP pool)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from xllm.core import AsyncEngine, ComputeThread, EngineConfig, LLMEngine
from xllm.testing.engine import make_request
from xllm.testing.tiny import TinyLM, tiny_tokenizer


def test_tasks_run_in_order_on_one_thread_and_errors_reach_the_caller():
    compute = ComputeThread()
    try:
        seen: list[tuple[int, int]] = []
        futures = [compute.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(20)]
        for f in futures:
            f.result(5)
        assert [i for i, _ in seen] == list(range(20))
        assert {t for _, t in seen} == {compute.ident} and compute.ident != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            compute.call(lambda: 1 / 0)
        assert compute.call(lambda: 7) == 7  # still serving after a failed task
    finally:
        compute.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        compute.submit(lambda: None)


def test_shutdown_can_cancel_queued_tasks():
    compute = ComputeThread()
    gate, started = threading.Event(), threading.Event()
    running = compute.submit(lambda: started.set() or gate.wait(5))
    queued = compute.submit(lambda: "never")
    assert started.wait(5)
    compute.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert running.result(5) is True
    assert queued.cancelled()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_built_and_stepped_on_the_compute_thread(async_scheduling):
    """The model's forward runs on the thread that built the engine, in both scheduling modes."""
    compute = ComputeThread()
    forward_threads: set[int] = set()
    model = TinyLM()
    logits = model.compute_logits

    def record_thread(hidden):
        forward_threads.add(threading.get_ident())
        return logits(hidden)

    model.compute_logits = record_thread
    cfg = EngineConfig(dtype=torch.float32, max_num_seqs=4, num_threads=1, kv_cache_backend="paged",
                       async_scheduling=async_scheduling)
    engine = compute.call(LLMEngine, model, tiny_tokenizer(), cfg, forward_executor=compute)
    aeng = AsyncEngine(engine, compute=compute)
    aeng.start()

    async def main():
        streams = [aeng.submit(make_request(f"r{i}", [3, 4, 5 + i], max_tokens=6, ignore_eos=True)) for i in range(3)]
        outs = []
        for stream in streams:
            tokens: list[int] = []
            async for chunk in stream:
                tokens.extend(chunk.token_ids)
            outs.append(tokens)
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        aeng.shutdown()
        engine.close()
        compute.shutdown()
    assert [len(o) for o in outs] == [6, 6, 6]
    assert forward_threads == {compute.ident}

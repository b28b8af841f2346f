"""Sleep, wake and in-place weight updates (xllm.core.engine_weights) against HF transformers.

Two tiny random Llama checkpoints A and B (same shapes, other seeds), saved as safetensors dirs; the engine
is loaded from A by the loader (``load_engine``) and run by its ``AsyncEngine``. Oracle: HF's greedy tokens on
A or on B. Ordering comes from the engine's command queue, never from sleeps: requests submitted before
``update_weights`` are in the engine when the update is queued (it waits for them: they run on A), requests
submitted after it wait outside the engine (they run on B).
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from xllm.core import AsyncEngine, EngineConfig
from xllm.core.engine_weights import ModelSleepingError
from xllm.engine.loader import load_engine
from xllm.engine_api.errors import InvalidRequestError
from xllm.testing.engine import make_request
from xllm.testing.models import save_tiny_llama

transformers = pytest.importorskip("transformers")

NEW = 8
PROMPTS = [[1, 504, 9087, 314, 28, 4031, 3110, 1004, 42, 711], [1, 30, 2000, 77, 5120, 9], [1, 3, 4, 5, 6, 7, 8, 9]]
LONG = [1] + [(37 * i + 11) % 40000 + 100 for i in range(150)]  # several KV blocks: a prefix-cache hit


@torch.inference_mode()
def _hf_tokens(model_dir: pathlib.Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("weights")
    a = save_tiny_llama(root / "a", smollm2_dir, seed=1)
    b = save_tiny_llama(root / "b", smollm2_dir, seed=2)
    bad_shape = root / "bad_shape"  # a plain parameter of the wrong shape: refused before anything is copied
    bad_fused = root / "bad_fused"  # a fused shard (q_proj of qkv) of the wrong shape: seen while copying
    for path, name in ((bad_shape, "model.layers.1.mlp.down_proj.weight"),
                       (bad_fused, "model.layers.1.self_attn.q_proj.weight")):
        path.mkdir()
        tensors = load_file(str(b / "model.safetensors"))
        tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, str(path / "model.safetensors"))
    prompts = [*PROMPTS, LONG]
    return {"a": a, "b": b, "bad_shape": bad_shape, "bad_fused": bad_fused,
            "hf_a": _hf_tokens(a, prompts), "hf_b": _hf_tokens(b, prompts)}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def served(dirs, request):
    """A's engine on its compute thread, driven by an ``AsyncEngine`` on this module's event loop (with and
    without async scheduling: a step in flight counts as work the commands wait for)."""
    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=512, max_num_seqs=8,
                       num_threads=1, async_scheduling=request.param)
    loaded = load_engine(str(dirs["a"]), "tiny", cfg, "engine-0", progress=False)
    aeng = AsyncEngine(loaded.engine, compute=loaded.compute)
    aeng.start()
    loop = asyncio.new_event_loop()
    yield aeng, loop, loaded.engine
    aeng.shutdown()
    loaded.engine.close()
    loaded.compute.shutdown()
    loop.close()


async def _collect(stream) -> list[int]:
    tokens: list[int] = []
    async for chunk in stream:
        tokens.extend(chunk.token_ids)
    return tokens


def _submit(aeng: AsyncEngine, rid: str, prompt: list[int]):
    return aeng.submit(make_request(rid, prompt, max_tokens=NEW, ignore_eos=True))


def _run(loop: asyncio.AbstractEventLoop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 120))


def _command(loop: asyncio.AbstractEventLoop, fn):
    """Run the engine command ``fn()`` (it needs a running loop) and return its result."""
    async def go():
        return await fn()
    return _run(loop, go())


def _phase(aeng: AsyncEngine, tag: str, prompts: list[list[int]]) -> list:
    return [_collect(_submit(aeng, f"{tag}-{i}", p)) for i, p in enumerate(prompts)]


def _generate(aeng: AsyncEngine, loop: asyncio.AbstractEventLoop, tag: str, prompts: list[list[int]]) -> list:
    async def go():
        return list(await asyncio.gather(*_phase(aeng, tag, prompts)))
    return _run(loop, go())


def _rss(field: str = "VmRSS") -> int:
    """Bytes of ``field`` in /proc/self/status."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset(aeng, loop, dirs) -> None:
    """Back to A's weights, awake (each test starts there)."""
    async def go():
        await aeng.wake_up()
        await aeng.update_weights(str(dirs["a"]))
    _run(loop, go())


def test_update_mid_load_loses_nothing_and_then_equals_hf_on_b(served, dirs):
    aeng, loop, engine = served
    _reset(aeng, loop, dirs)
    hits_before = engine.kv.prefix_stats.hits

    async def go():
        warm = await _collect(_submit(aeng, "warm", LONG))  # LONG's blocks now cached under A
        before = _phase(aeng, "a", [*PROMPTS, LONG])  # in the engine when the update is queued
        update = aeng.update_weights(str(dirs["b"]))
        after = _phase(aeng, "b", [*PROMPTS, LONG])  # arrive while it drains: wait, then run on B
        results = await asyncio.gather(*before, update, *after)
        return warm, results

    warm, results = _run(loop, go())
    n = len(PROMPTS) + 1
    assert warm == dirs["hf_a"][-1]
    assert engine.kv.prefix_stats.hits > hits_before  # the A phase's LONG hit A's cached blocks
    assert list(results[:n]) == dirs["hf_a"]  # every request that started before the update: A's tokens
    assert isinstance(results[n], str) and results[n]  # the new KV identity
    assert list(results[n + 1:]) == dirs["hf_b"]  # after: B's, LONG included (A's cached KV never served)
    hits = engine.kv.prefix_stats.hits
    again = _generate(aeng, loop, "b2", [LONG])
    assert again == [dirs["hf_b"][-1]] and engine.kv.prefix_stats.hits > hits  # B's own blocks are cached


def test_sleep_wake_levels_keep_answers_and_refuse_meanwhile(served, dirs):
    aeng, loop, _ = served
    _reset(aeng, loop, dirs)
    for level in (1, 2):
        rss, shmem = _rss(), _rss("RssShmem")

        async def go(level=level):
            running = _phase(aeng, f"s{level}", [*PROMPTS, LONG])  # sleep waits for them
            return await asyncio.gather(*running, aeng.sleep(level))

        results = _run(loop, go())
        assert list(results[:-1]) == dirs["hf_a"] and results[-1] == level
        assert aeng.is_sleeping() == level
        assert _rss("RssShmem") < shmem  # the KV pages the requests wrote went back to the OS
        if level == 2:  # the weights too (embedding alone: 49152 x 64 fp32 = 12.6 MB)
            assert _rss() < rss - 10e6
        with pytest.raises(ModelSleepingError, match="wake it with POST /wake_up"):
            _generate(aeng, loop, f"refused{level}", [PROMPTS[0]])
        with pytest.raises(InvalidRequestError, match="wake it"):
            _command(loop, lambda: aeng.update_weights(str(dirs["b"])))
        assert _command(loop, lambda: aeng.sleep(1)) == level  # asleep already: nothing
        assert _command(loop, aeng.wake_up) == level
        assert _command(loop, aeng.wake_up) == 0  # awake already: nothing
        assert _generate(aeng, loop, f"w{level}", [*PROMPTS, LONG]) == dirs["hf_a"]


def test_sleep_refuses_what_arrives_while_it_drains(served, dirs):
    aeng, loop, _ = served
    _reset(aeng, loop, dirs)

    async def go():
        running = _collect(_submit(aeng, "d0", PROMPTS[0]))
        sleep = aeng.sleep(1)
        late = _collect(_submit(aeng, "d1", PROMPTS[1]))  # queued after the sleep: refused once it sleeps
        return await asyncio.gather(running, sleep, late, return_exceptions=True)

    running, level, late = _run(loop, go())
    assert running == dirs["hf_a"][0] and level == 1
    assert isinstance(late, ModelSleepingError)
    _command(loop, aeng.wake_up)


@pytest.mark.parametrize("case", ["missing", "empty", "bad_shape", "bad_fused"])
def test_bad_update_is_refused_naming_it_and_a_keeps_serving(served, dirs, tmp_path, case):
    aeng, loop, _ = served
    _reset(aeng, loop, dirs)
    path = {"missing": tmp_path / "nope", "empty": tmp_path, "bad_shape": dirs["bad_shape"],
            "bad_fused": dirs["bad_fused"]}[case]
    expect = {"missing": "is not a directory", "empty": "no \\*.safetensors", "bad_shape": "down_proj",
              "bad_fused": "q_proj"}[case]
    with pytest.raises(InvalidRequestError, match=expect) as err:
        _command(loop, lambda: aeng.update_weights(str(path)))
    assert err.value.param == "model_path"
    assert _generate(aeng, loop, f"k-{case}", [*PROMPTS, LONG]) == dirs["hf_a"]


def test_kv_tiers_of_the_old_weights_never_serve_the_new(dirs, tmp_path):
    """KV tiers below the engine's memory (host, T1): A's blocks written down there come back under A, and
    never under B (the update moves the tiers' namespace to B's identity)."""
    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=512, max_num_seqs=4,
                       num_threads=1, kv_host_memory_gib=0.05, kv_host_dir=str(tmp_path / "host"))
    loaded = load_engine(str(dirs["a"]), "tiny", cfg, "engine-tiers", progress=False)
    eng, call = loaded.engine, loaded.compute.call

    def greedy(rid: str) -> list[int]:
        def run():
            eng.add_request(make_request(rid, LONG, max_tokens=NEW, ignore_eos=True))
            out: list[int] = []
            while eng.has_work():
                out += [t for c in eng.step() if c.request_id == rid for t in c.token_ids]
            return out
        return call(run)

    def write_down() -> None:
        assert call(eng.kv.evict_cached) > 0 and eng.kv.lower.store.flush(30)

    try:
        assert greedy("t0") == dirs["hf_a"][-1]
        write_down()
        assert greedy("t1") == dirs["hf_a"][-1]
        assert eng.kv.tier_stats()["host"].hits > 0  # A's blocks came back from T1 under A
        write_down()
        identity = eng.config.kv_model_identity
        call(eng.update_weights, str(dirs["b"]))
        assert eng.config.kv_model_identity != identity
        assert greedy("t2") == dirs["hf_b"][-1]
        assert eng.kv.tier_stats()["host"].hits == 0  # nothing of A's came up for B
    finally:
        eng.close()
        loaded.compute.shutdown()


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_sleep_wake_and_update_on_the_other_kv_backends(dirs, backend):
    """The paged pools give their storage back while asleep (the contiguous cache keeps its memory); both
    answer as HF on A after waking and on B after an update (synchronous engine, idle between calls)."""
    from xllm.models import load_model
    from xllm.models.reload import read_weights
    from xllm.testing.engine import generate, make_engine
    from xllm.testing.models import IdTokenizer

    engine = make_engine(load_model(dirs["a"], torch.float32), kv_backend=backend, tokenizer=IdTokenizer(),
                         max_model_len=512, kv_cache_memory_gib=0.02)
    engine.attach_weights(str(dirs["a"]), read_weights)
    prompts = [*PROMPTS, LONG]

    def run(tag: str) -> list[list[int]]:
        got = generate(engine, [make_request(f"{tag}{i}", p, max_tokens=NEW, ignore_eos=True)
                                for i, p in enumerate(prompts)])
        return [got.tokens[f"{tag}{i}"] for i in range(len(prompts))]

    try:
        assert run("a") == dirs["hf_a"]
        for level in (1, 2):
            assert engine.sleep(level) == level
            if backend == "paged":
                assert engine.kv.k[0].untyped_storage().nbytes() == 0
            assert engine.wake_up() == level
            assert run(f"w{level}-") == dirs["hf_a"]
        engine.update_weights(str(dirs["b"]))
        assert run("b") == dirs["hf_b"]
    finally:
        engine.close()

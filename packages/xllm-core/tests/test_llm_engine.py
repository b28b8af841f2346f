"""LLMEngine on a tiny random model: KV-cached batched generation against a
from-scratch recompute, continuous batching, preemption, abort, validation,
seeded sampling and end-to-end stop handling."""

from __future__ import annotations

import random

import pytest
import torch

from xllm.engine_api.errors import EngineOverloadedError, InvalidRequestError
from xllm.engine_api.stats import StepStats
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected, generate, make_engine, make_request, run_to_completion
from xllm.testing.reference import recompute_greedy
from xllm.testing.tiny import EOS, TinyLM, tiny_tokenizer

LENGTH = engine_pb2.FINISH_REASON_LENGTH
STOP = engine_pb2.FINISH_REASON_STOP
ABORT = engine_pb2.FINISH_REASON_ABORT


def prompts(seed: int, count: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 33) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def greedy_requests(ps, max_tokens=24, **kw):
    return [make_request(f"r{i}", p, max_tokens=max_tokens, ignore_eos=True, logprobs=True, **kw)
            for i, p in enumerate(ps)]


def solo(new_engine, model, prompt, **kw) -> list[int]:
    got = generate(new_engine(model), [make_request("solo", prompt, **kw)])
    return got.tokens["solo"]


@pytest.mark.parametrize("budget", [2048, 5])
def test_batched_kv_cached_generation_equals_full_recompute(new_engine, tiny_model, budget, kv_backend, scheduling):
    ps = prompts(0, 6)
    eng = new_engine(tiny_model, max_num_batched_tokens=budget)
    stats: list[StepStats] = []
    eng.observers.append(type("Obs", (), {"on_step": lambda self, s: stats.append(s)})())
    got = generate(eng, greedy_requests(ps))
    for i, p in enumerate(ps):
        ref_tokens, ref_lps = recompute_greedy(tiny_model, p, 24)
        assert got.tokens[f"r{i}"] == ref_tokens, f"prompt {i}"
        assert max(abs(a - b) for a, b in zip(got.logprobs[f"r{i}"], ref_lps)) < 1e-4
        assert got.final[f"r{i}"].finish_reason == LENGTH
        assert got.final[f"r{i}"].usage.completion_tokens == 24
        assert got.final[f"r{i}"].usage.prompt_tokens == len(p)
    assert eng.counters.max_batch_size >= (6 if budget > 100 else 5)
    assert eng.counters.finished_requests == 6 and eng.counters.generation_tokens == 6 * 24
    assert all(s.num_decode_tokens + s.num_prefill_tokens <= budget for s in stats)
    if budget == 5:  # prefill is chunked and mixed with decodes
        assert any(s.num_decode_tokens and s.num_prefill_tokens for s in stats)
    assert eng.kv.num_free_blocks == eng.layout.num_blocks


def test_streamed_text_is_the_decoded_output(new_engine, tiny_model, scheduling):
    ps = prompts(1, 5)
    eng = new_engine(tiny_model)
    got = generate(eng, [make_request(f"r{i}", p, temperature=1.0, seed=i, max_tokens=40, ignore_eos=True)
                         for i, p in enumerate(ps)])
    tok = tiny_tokenizer()
    multibyte = 0
    for i in range(len(ps)):
        toks = got.tokens[f"r{i}"]
        assert len(toks) == 40
        assert got.text[f"r{i}"] == tok.decode(toks)
        multibyte += sum(tok.pieces[t][0] >= 0x80 for t in toks)
    assert multibyte > 0  # the sampled outputs did contain split UTF-8 pieces


def test_continuous_batching_new_request_joins_the_running_batch(new_engine, tiny_model, kv_backend, scheduling):
    pa, pb = prompts(2, 2, lo=8, hi=20)
    solo_a = solo(new_engine, tiny_model, pa, max_tokens=30, ignore_eos=True)
    solo_b = solo(new_engine, tiny_model, pb, max_tokens=20, ignore_eos=True)
    eng = new_engine(tiny_model)
    got = Collected()
    eng.add_request(make_request("a", pa, max_tokens=30, ignore_eos=True))
    lag = 1 if scheduling else 0  # async scheduling emits a step's tokens during the next step
    for _ in range(5):
        got.add(eng.step())
    assert len(got.tokens["a"]) == 5 - lag and eng.counters.multi_seq_decode_steps == 0
    eng.add_request(make_request("b", pb, max_tokens=20, ignore_eos=True))
    got.add(eng.step())  # b's prefill runs together with a's decode
    got.add(eng.step() if lag else [])
    assert len(got.tokens["a"]) == 6 and len(got.tokens["b"]) == 1
    while eng.has_work():
        got.add(eng.step())
    assert eng.counters.multi_seq_decode_steps > 0
    assert got.tokens["a"] == solo_a
    assert got.tokens["b"] == solo_b


def test_preemption_under_a_tiny_kv_pool_gives_the_unconstrained_outputs(new_engine, tiny_model, kv_backend,
                                                                           scheduling):
    ps = prompts(3, 5, lo=10, hi=24)
    # xTensor's tiny-model blocks are 64 tokens (a whole OS page per layer), the others 16:
    # size the outputs so every sequence grows past its first block while the pool holds ~2.
    bs = new_engine(tiny_model).layout.block_size if kv_backend == "xtensor" else 16
    max_tokens = 30 if bs == 16 else bs + 10

    def reqs():
        return greedy_requests(ps, max_tokens=max_tokens)

    free = new_engine(tiny_model, enable_prefix_cache=False)
    expected = generate(free, reqs())
    assert free.counters.num_preemptions == 0
    per_block = tiny_model.kv_cache_spec().bytes_per_token(torch.float32) * bs
    blocks = 6 if bs == 16 else 3
    tight = new_engine(tiny_model, kv_cache_memory_gib=blocks * per_block / 2**30, block_size=bs,
                       enable_prefix_cache=False)
    assert tight.layout.num_blocks == blocks  # room for about two of the five sequences
    got = generate(tight, reqs())
    assert tight.counters.num_preemptions > 0
    assert got.tokens == expected.tokens
    assert got.text == expected.text
    assert all(got.final[r].finish_reason == LENGTH for r in expected.tokens)
    assert max(abs(a - b) for r in expected.logprobs for a, b in zip(got.logprobs[r], expected.logprobs[r])) < 1e-4
    assert tight.kv.num_free_blocks == blocks


def test_request_larger_than_the_kv_pool_is_rejected_not_livelocked(new_engine, tiny_model):
    per_block = tiny_model.kv_cache_spec().bytes_per_token(torch.float32) * 16
    eng = new_engine(tiny_model, kv_cache_memory_gib=2 * per_block / 2**30, kv_cache_backend="paged")
    assert eng.layout.capacity_tokens == 32
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("big", list(range(1, 21)), max_tokens=30, ignore_eos=True))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("huge", [1] * 40, max_tokens=1))
    assert err.value.param == "prompt"
    # exactly the capacity is fine and completes
    got = generate(eng, [make_request("fits", list(range(1, 21)), max_tokens=12, ignore_eos=True)])
    assert len(got.tokens["fits"]) == 12


def test_abort_frees_the_slot_and_kv(new_engine, tiny_model, kv_backend):
    eng = new_engine(tiny_model, max_num_seqs=2)
    full_blocks = eng.layout.num_blocks
    p1, p2, p3 = prompts(4, 3, lo=20, hi=30)
    expected_3 = solo(new_engine, tiny_model, p3, max_tokens=10, ignore_eos=True)
    for rid, p in (("r1", p1), ("r2", p2), ("r3", p3)):
        eng.add_request(make_request(rid, p, max_tokens=10, ignore_eos=True))
    got = Collected()
    for _ in range(3):
        got.add(eng.step())
    seq1 = eng.requests["r1"].seq
    assert (seq1.slot is not None or kv_backend == "paged") and [s.request_id for s in eng.scheduler.waiting] == ["r3"]
    blocks_before = eng.kv.num_free_blocks
    final = eng.abort("r1")
    assert final.finish_reason == ABORT and final.usage.completion_tokens == 3
    assert seq1.slot is None and not seq1.kv_pages and all(s is not seq1 for s in eng.scheduler.running)
    assert eng.kv.num_free_blocks > blocks_before
    # the freed slot lets the waiting request in at the next step
    got.add(eng.step())
    assert {s.request_id for s in eng.scheduler.running} == {"r2", "r3"}
    # abort a waiting request and an unknown one
    eng.add_request(make_request("r4", p1, max_tokens=5))
    assert eng.abort("r4").finish_reason == ABORT
    assert all(s.request_id != "r4" for s in eng.scheduler.waiting)
    assert eng.abort("nope") is None
    while eng.has_work():
        got.add(eng.step())
    assert got.tokens["r3"] == expected_3 and got.final["r3"].finish_reason == LENGTH
    assert got.tokens["r2"] == solo(new_engine, tiny_model, p2, max_tokens=10, ignore_eos=True)
    assert not eng.has_work() and not eng.requests
    assert eng.kv.num_free_blocks == full_blocks
    if kv_backend != "paged":
        assert sorted(eng.kv._free_slots) == [0, 1]


def test_request_validation(new_engine, tiny_model):
    eng = new_engine(tiny_model, max_model_len=64, max_waiting_requests=2)
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("a", [1] * 40, max_tokens=25))   # 40 + 25 > 64
    assert err.value.param == "max_tokens"
    eng.add_request(make_request("ok", [1] * 40, max_tokens=24))      # exactly the context
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("b", [1] * 64, max_tokens=1))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request(make_request("c", [], max_tokens=1))
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("d", [1, tiny_model.vocab_size], max_tokens=1))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("", [1], max_tokens=1))
    assert err.value.param == "request_id"
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("e", [1], max_tokens=1, top_p=0.0))
    assert err.value.param == "top_p"
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("ok", [1], max_tokens=1))
    assert err.value.param == "request_id"
    for resumed_tokens, max_tokens in ((2, 4), (2, 1)):  # the whole prompt / more than max_tokens
        resumed = make_request("u", [1, 2], max_tokens=max_tokens)
        resumed.resumed_output_tokens = resumed_tokens
        with pytest.raises(InvalidRequestError) as err:
            eng.add_request(resumed)
        assert err.value.param == "resumed_output_tokens"
    eng.add_request(make_request("f", [1], max_tokens=1))
    with pytest.raises(EngineOverloadedError):
        eng.add_request(make_request("g", [1], max_tokens=1))
    assert len(eng.scheduler.waiting) == 2
    got = run_to_completion(eng)
    assert set(got.final) == {"ok", "f"}


def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(new_engine, tiny_model, kv_backend, scheduling):
    p = prompts(5, 1)[0]
    seeded = dict(temperature=1.0, seed=1234, max_tokens=30, ignore_eos=True)
    alone = generate(new_engine(tiny_model), [make_request("s", p, **seeded)]).tokens["s"]
    others = [make_request("g", prompts(6, 1)[0], max_tokens=12),
              make_request("k", prompts(7, 1)[0], temperature=0.8, top_k=5, top_p=0.9, max_tokens=40),
              make_request("m", p, temperature=1.5, min_p=0.1, seed=99, max_tokens=30, ignore_eos=True)]
    eng = new_engine(tiny_model, seed=7)
    batch = generate(eng, [others[0], make_request("s", p, **seeded), *others[1:]])
    assert batch.tokens["s"] == alone
    assert eng.counters.max_batch_size == 4
    # and it is really sampling: another seed gives another sequence, temperature 0 the argmax path
    other_seed = generate(new_engine(tiny_model), [make_request("s", p, **{**seeded, "seed": 4321})]).tokens["s"]
    assert other_seed != alone
    assert alone != solo(new_engine, tiny_model, p, max_tokens=30, ignore_eos=True)


def test_logit_bias_forces_a_token_and_min_tokens_suppresses_eos(new_engine, tiny_model, scheduling):
    p = prompts(8, 1)[0]
    got = generate(new_engine(tiny_model), [
        make_request("bias", p, temperature=1.0, seed=3, max_tokens=8, logit_bias={17: 100.0}),
        make_request("min", p, temperature=1.0, seed=3, max_tokens=20, min_tokens=5, logit_bias={EOS: 100.0}),
        make_request("eos", p, max_tokens=20, logit_bias={EOS: 100.0}),
    ])
    assert got.tokens["bias"] == [17] * 8
    # EOS is forced by the bias but banned for the first 5 tokens, then it ends the request.
    assert len(got.tokens["min"]) == 6 and EOS not in got.tokens["min"][:5] and got.tokens["min"][5] == EOS
    assert got.final["min"].finish_reason == STOP
    assert got.tokens["eos"] == [EOS] and got.final["eos"].finish_reason == STOP
    assert got.text["eos"] == ""


def test_stop_string_spanning_tokens_ends_the_request_end_to_end(new_engine, tiny_model, kv_backend, scheduling):
    p = prompts(9, 1)[0]
    base = generate(new_engine(tiny_model), [make_request("x", p, temperature=1.0, seed=11, max_tokens=40,
                                                      ignore_eos=True)])
    text, toks = base.text["x"], base.tokens["x"]
    tok = tiny_tokenizer()
    # a stop string made of the end of token 9's text and the start of token 10's
    a, b = tok.decode(toks[:10]), tok.decode(toks[:11])
    stop = (a[-2:] + b[len(a):len(a) + 2]).strip() or b[len(a):]
    cut = text.index(stop)
    assert cut < len(a) < cut + len(stop)  # the first occurrence spans tokens 9 and 10
    got = generate(new_engine(tiny_model), [
        make_request("y", p, temperature=1.0, seed=11, max_tokens=40, ignore_eos=True, stop=[stop]),
        make_request("z", p, temperature=1.0, seed=11, max_tokens=40, ignore_eos=True, stop=[stop],
                include_stop_str_in_output=True),
    ])
    assert got.text["y"] == text[:cut]
    assert got.text["z"] == text[:cut + len(stop)]
    assert got.final["y"].finish_reason == STOP and got.final["y"].stop_reason == stop
    assert got.tokens["y"] == toks[:len(got.tokens["y"])] and len(got.tokens["y"]) < 40


def test_engine_counters_and_load_report(new_engine, tiny_model):
    eng = new_engine(tiny_model)
    eng.add_request(make_request("a", [1, 2, 3], max_tokens=4, ignore_eos=True))
    report = eng.load_report()
    assert report.num_waiting == 1 and report.num_running == 0 and report.decode_context_tokens == 0
    got = run_to_completion(eng)
    c = eng.counters
    assert c.steps == 4 and c.prompt_tokens == 3 and c.generation_tokens == 4 and c.finished_requests == 1
    assert c.recent_ttft > 0 and c.recent_tpot > 0
    assert len(got.tokens["a"]) == 4
    assert eng.load_report().kv_usage == 0.0
    eng.add_request(make_request("b", [1, 2, 3], max_tokens=4, ignore_eos=True))
    eng.step()  # the prompt's 3 tokens computed, one sampled: 4 tokens of context
    assert eng.load_report().decode_context_tokens == 4


def test_identical_prompts_in_one_batch_match_solo(new_engine, tiny_model, kv_backend, scheduling):
    """Two identical prompts in one batch produce identical greedy outputs."""
    p = prompts(10, 1)[0]
    got = generate(new_engine(tiny_model), [make_request("a", p, max_tokens=16, ignore_eos=True),
                                             make_request("b", p, max_tokens=16, ignore_eos=True)])
    assert got.tokens["a"] == got.tokens["b"] == solo(new_engine, tiny_model, p, max_tokens=16, ignore_eos=True)


def test_engine_rejects_an_unsupported_dtype_and_tiny_pool(new_engine):
    with pytest.raises(ValueError, match="not supported"):
        new_engine(TinyLM(), dtype=torch.float16)
    with pytest.raises(ValueError, match="too small"):
        new_engine(TinyLM(), kv_cache_memory_gib=1e-9)


@pytest.mark.parametrize("field,value", [("repetition_penalty", float("inf")), ("repetition_penalty", float("nan")),
                                         ("temperature", float("nan")), ("top_p", float("nan")),
                                         ("presence_penalty", float("inf")), ("repetition_penalty", 1e6)])
def test_non_finite_or_overflowing_sampling_values_are_refused(tiny_model, field, value):
    """gRPC clients reach the engine without the gateway's checks (and proto floats are float32)."""
    eng = make_engine(tiny_model)
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("x", [1, 2], **{field: value}))
    assert err.value.param == field


def test_a_tiny_positive_temperature_samples_instead_of_producing_nan(tiny_model):
    eng = make_engine(tiny_model)
    got = generate(eng, [make_request("t", [1, 2], max_tokens=8, temperature=1e-45, seed=3)])
    greedy = generate(make_engine(tiny_model), [make_request("g", [1, 2], max_tokens=8)])
    assert got.tokens["t"] == greedy.tokens["g"]  # 0.01 on peaked logits: the argmax, never a NaN draw

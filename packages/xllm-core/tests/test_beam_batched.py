"""Beam groups in one forward with ordinary work (xllm.core.beam, xllm.core.engine_beams): a text and
a catalogue search decoding while greedy and seeded requests decode and a long prompt is prefilled in
chunks, on every KV backend, synchronous and overlapped. The oracle is each request served alone by
its own engine: the same beams (tokens, log-probs), the same tokens for the others; and the steps
that had both kinds of work ran one forward each."""

from __future__ import annotations

import numpy as np
import pytest

from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected, generate, make_request

GREEDY = dict(max_tokens=12, ignore_eos=True)
SEEDED = dict(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)


def _beam(rid: str, prompt: list[int], width: int, max_tokens: int, **extra) -> engine_pb2.GenerateRequest:
    req = make_request(rid, prompt, max_tokens=max_tokens, beam_width=width, **extra)
    req.sampling.ClearField("temperature")
    return req


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("beams") / "items.npy"
    np.save(path, np.random.default_rng(4).integers(1, 60, size=(60, 3)).astype(np.int32))
    return str(path)


def _requests() -> tuple[list[engine_pb2.GenerateRequest], engine_pb2.GenerateRequest]:
    first = [_beam("text", list(range(5, 30)), 4, 6, ignore_eos=True),
             _beam("items", [9, 8, 7, 6, 5, 4, 3], 8, 1, item_catalog=True),
             make_request("greedy", [11, 12, 13, 14, 15], **GREEDY),
             make_request("seeded", [21, 22, 23], **SEEDED)]
    late = make_request("long", [5 + (i * 11) % 50 for i in range(70)], **GREEDY)  # prefilled in chunks
    return first, late


def _count_forwards(model) -> list[int]:
    """Record every forward of ``model`` (an instance attribute shadowing the method)."""
    calls: list[int] = []
    forward = model.forward

    def counted(input_ids, positions, ctx):
        calls.append(len(input_ids))
        return forward(input_ids, positions, ctx)

    model.forward = counted
    return calls


def test_beam_groups_share_the_forward_with_other_work(new_engine, kv_backend, scheduling, catalogue):
    engine = new_engine(item_catalog=catalogue, max_num_batched_tokens=24, kv_cache_memory_gib=0.01)
    forwards = _count_forwards(engine.model)
    first, late = _requests()
    got = Collected()
    for r in first:
        got.add(engine.add_request(r))
    steps = 0
    while len(engine.beams.groups) < 2:  # both searches decode before the long prompt arrives
        got.add(engine.step())
        steps += 1
    got.add(engine.add_request(late))
    while engine.has_work():
        got.add(engine.step())
        steps += 1
    # a step starts one forward at most: never one for the beams and another for the rest
    assert len(forwards) <= steps
    assert engine.runner.mode_steps["beams"] >= 3, engine.runner.mode_steps  # forwards carrying both
    assert not engine.requests and not engine.beams.groups

    for req in [*first, late]:
        alone = generate(new_engine(item_catalog=catalogue, max_num_batched_tokens=24, kv_cache_memory_gib=0.01), [req])
        rid = req.request_id
        if req.sampling.HasField("beam_width"):
            want, have = alone.final[rid].beams, got.final[rid].beams
            assert [tuple(b.token_ids) for b in have] == [tuple(b.token_ids) for b in want] and want
            assert [b.logprob for b in have] == pytest.approx([b.logprob for b in want], abs=1e-5)
            assert [b.item_id for b in have] == [b.item_id for b in want]
        else:
            assert got.tokens[rid] == alone.tokens[rid] and len(alone.tokens[rid]) == req.sampling.max_tokens
            assert got.final[rid].finish_reason == alone.final[rid].finish_reason

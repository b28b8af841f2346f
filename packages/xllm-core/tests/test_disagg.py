"""Prefill/decode hand-off inside the engine: a prefill engine computes the prompt and the first
token, its KV pages are copied into the decode engine's reserved pages (through each backend's
PageStore: no transport), and the decode engine continues. The oracle is one engine serving the
whole request: same tokens, same text, same finish reason, greedy and seeded."""

from __future__ import annotations

import functools
import math

import pytest

from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected, generate, make_engine, make_request
from xllm.testing.tiny import tiny_tokenizer

PREFILL, DECODE = engine_pb2.DISAGG_PHASE_PREFILL, engine_pb2.DISAGG_PHASE_DECODE
HANDED_OFF = engine_pb2.FINISH_REASON_HANDED_OFF


class Recorder:
    """A DisaggListener that only records what the engine reports."""

    def __init__(self) -> None:
        self.reserved: dict = {}
        self.handoffs: dict = {}
        self.abandoned: list[str] = []
        self.finishing: list[str] = []
        self.layers_stored: list[int] = []

    def on_reserved(self, reservation) -> None:
        self.reserved[reservation.request_id] = reservation

    def on_prompt_finishing(self, prompts):
        self.finishing.extend(p.request_id for p in prompts)
        return self.layers_stored.append


    def on_handoff(self, handoff) -> None:
        self.handoffs[handoff.request_id] = handoff

    def on_abandoned(self, request_id: str) -> None:
        self.abandoned.append(request_id)


def pd_pair(new_engine, model, **config):
    prefill, decode = new_engine(model, **config), new_engine(model, **config)
    prefill.attach_disagg(Recorder())
    decode.attach_disagg(Recorder())
    return prefill, decode


def pd_request(rid: str, prompt: list[int], phase: int, target: engine_pb2.KVTarget | None = None, **sampling):
    req = make_request(rid, prompt, **sampling)
    req.disagg_phase = phase
    if target is not None:
        req.kv_target.CopyFrom(target)
    return req


def copy_blocks(prefill, decode, reservation, handoff) -> int:
    """What a transport does: the prefill side's pages of the blocks the decode side lacks, into the
    decode side's reserved pages. Returns the blocks copied."""
    src, dst = prefill.kv.page_store(), decode.kv.page_store()
    assert src.layout == dst.layout
    bs = prefill.layout.block_size
    blocks = range(reservation.matched_tokens // bs, math.ceil(reservation.num_tokens / bs))
    for j in blocks:
        dst.write_block(reservation.pages[j], src.read_block(handoff.pages[j]))
    return len(blocks)


def commit_of(handoff) -> engine_pb2.KVCommit:
    return engine_pb2.KVCommit(transfer_id=handoff.request_id, num_tokens=handoff.num_tokens,
                               first_token=handoff.first_token)


def _full_run(prefill, decode, rid, prompt, **kw):
    """run_pd, but keeping every decode chunk (run_to_completion returns them merged)."""
    decode.add_request(pd_request(rid, prompt, DECODE, **kw))
    client = Collected()
    client.add(decode.step())
    reservation = decode.disagg.reserved[rid]
    target = engine_pb2.KVTarget(transfer_id=rid, matched_tokens=reservation.matched_tokens,
                                 layout=decode.layout.fingerprint)
    prefill.add_request(pd_request(rid, prompt, PREFILL, target, **kw))
    while rid not in prefill.disagg.handoffs:
        client.add(c for c in prefill.step() if c.finish_reason != HANDED_OFF)
        if rid in client.final:  # the first token ended the request: the reservation is given up
            decode.abort(rid)
            assert decode.disagg.abandoned[-1] == rid  # the listener hears it, and lets the pages go
            assert decode.release_kv(rid) == []
            return client, reservation, None
    handoff = prefill.disagg.handoffs[rid]
    return client, reservation, handoff


def finish_decode(decode, client: Collected) -> Collected:
    for _ in range(5000):
        if not decode.has_work():
            return client
        client.add(decode.step())
    raise AssertionError("decode engine did not finish")


SAMPLINGS = {
    "greedy": dict(max_tokens=24, ignore_eos=True),
    "seeded": dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True),
    "stop-string": dict(max_tokens=40, stop=["e ", "th"], include_stop_str_in_output=False),
}


# every sampling mode on the default backend; the paged backend and async scheduling on a subset
# (the paged backend's torch attention is slow: these tests would take minutes)
CASES = [("xtensor", False, "greedy"), ("xtensor", False, "seeded"), ("xtensor", False, "stop-string"),
         ("xtensor", True, "greedy"), ("xtensor", True, "seeded"), ("paged", False, "seeded")]


@pytest.mark.parametrize("pd_backend, overlapped, sampling", CASES,
                         ids=[f"{b}-{'async' if a else 'sync'}-{m}" for b, a, m in CASES])
def test_handoff_equals_one_engine(tiny_model, pd_backend, overlapped, sampling):
    tok = tiny_tokenizer()
    prompt = tok.encode_pieces(list("the quick brown fox jumps over the lazy dog and then some more words"))
    params = SAMPLINGS[sampling]
    engine = functools.partial(make_engine, kv_cache_backend=pd_backend, async_scheduling=overlapped)
    mixed = generate(engine(tiny_model), [make_request("r", prompt, **params)])
    prefill, decode = pd_pair(engine, tiny_model, max_num_batched_tokens=16)
    client, reservation, handoff = _full_run(prefill, decode, "r", prompt, **params)
    assert handoff is not None and reservation.matched_tokens == 0
    # the forward of the prompt's last chunk (and only it) reported each layer once its KV was stored
    assert prefill.disagg.finishing == ["r"]
    assert prefill.disagg.layers_stored == list(range(tiny_model.kv_cache_spec().num_layers))
    assert copy_blocks(prefill, decode, reservation, handoff) == math.ceil(len(prompt) / prefill.layout.block_size)
    client.add(decode.install_kv(commit_of(handoff)))
    prefill.release_kv("r")
    finish_decode(decode, client)
    assert client.tokens["r"] == mixed.tokens["r"]
    assert client.text["r"] == mixed.text["r"]
    assert client.final["r"].finish_reason == mixed.final["r"].finish_reason
    assert client.final["r"].usage.completion_tokens == mixed.final["r"].usage.completion_tokens
    assert not decode.has_work() and not decode.requests and not prefill.requests


def test_recompute_when_the_transfer_failed_equals_one_engine(new_engine, tiny_model, pd_backend="xtensor"):
    tok = tiny_tokenizer()
    prompt = tok.encode_pieces(list("a b c d e f g h i j k l m n o p q r s t u v w x y z"))
    params = SAMPLINGS["seeded"]
    mixed = generate(new_engine(tiny_model, kv_cache_backend=pd_backend), [make_request("r", prompt, **params)])
    prefill, decode = pd_pair(new_engine, tiny_model, kv_cache_backend=pd_backend)
    client, _, handoff = _full_run(prefill, decode, "r", prompt, **params)
    client.add(decode.install_kv(commit_of(handoff), received=False))  # nothing copied: decode recomputes
    prefill.release_kv("r")
    finish_decode(decode, client)
    assert client.tokens["r"] == mixed.tokens["r"] and client.text["r"] == mixed.text["r"]


def test_the_decode_side_prefix_cache_shortens_the_transfer(new_engine, tiny_model):
    tok = tiny_tokenizer()
    system = tok.encode_pieces(list("you are a helpful assistant and you answer briefly. " * 3)[:130])
    first, second = system + tok.encode_pieces(list("hi")), system + tok.encode_pieces(list("bye"))
    prefill, decode = pd_pair(new_engine, tiny_model, kv_cache_backend="xtensor")
    bs = prefill.layout.block_size
    params = dict(max_tokens=20, ignore_eos=True)
    assert len(second) + params["max_tokens"] <= tiny_model.max_context_len
    for rid, prompt in (("a", first), ("b", second)):
        client, reservation, handoff = _full_run(prefill, decode, rid, prompt, **params)
        moved = copy_blocks(prefill, decode, reservation, handoff)
        client.add(decode.install_kv(commit_of(handoff)))
        prefill.release_kv(rid)
        finish_decode(decode, client)
        mixed = generate(new_engine(tiny_model, kv_cache_backend="xtensor"), [make_request(rid, prompt, **params)])
        assert client.tokens[rid] == mixed.tokens[rid]
        if rid == "b":  # the first request's blocks were installed into the decode side's prefix cache
            assert reservation.matched_tokens == len(system) // bs * bs > 0
            assert moved == math.ceil(len(prompt) / bs) - len(system) // bs
            assert decode.kv.prefix_stats.hits >= reservation.matched_tokens
            assert prefill.kv.prefix_stats.hits >= len(system) // bs * bs  # the prefill side reused it too


def test_a_first_token_that_ends_the_request_is_not_handed_off(new_engine, tiny_model):
    prefill, decode = pd_pair(new_engine, tiny_model, kv_cache_backend="xtensor")
    prompt = tiny_tokenizer().encode_pieces(list("hello"))
    client, _, handoff = _full_run(prefill, decode, "r", prompt, max_tokens=1)
    assert handoff is None and client.final["r"].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert len(client.tokens["r"]) == 1
    assert prefill.disagg.abandoned == ["r"]  # no hand-off will come: a sender that started stops
    assert not decode.has_work() and not decode.scheduler.awaiting_kv and not decode.requests
    assert not prefill.requests and not prefill.scheduler.handing_off


def test_aborts_mid_handoff_keep_the_kv_until_the_transfer_lets_go(new_engine, tiny_model):
    prefill, decode = pd_pair(new_engine, tiny_model, kv_cache_backend="xtensor")
    free_p, free_d = prefill.kv.num_free_blocks, decode.kv.num_free_blocks
    prompt = tiny_tokenizer().encode_pieces(list("an abandoned request " * 3))
    _, _, handoff = _full_run(prefill, decode, "r", prompt, max_tokens=8)
    assert prefill.abort("r").finish_reason == engine_pb2.FINISH_REASON_ABORT
    assert decode.abort("r").finish_reason == engine_pb2.FINISH_REASON_ABORT
    assert prefill.disagg.abandoned == ["r"] and decode.disagg.abandoned == ["r"]
    assert prefill.kv.num_free_blocks < free_p and decode.kv.num_free_blocks < free_d  # still held
    assert decode.install_kv(commit_of(handoff)) == []  # a late commit finds nobody to install into
    assert prefill.release_kv("r") == []
    assert prefill.kv.num_free_blocks == free_p and decode.kv.num_free_blocks == free_d
    assert not prefill.requests and not decode.requests


def test_an_expired_reservation_fails_the_request(new_engine, tiny_model):
    _, decode = pd_pair(new_engine, tiny_model, kv_cache_backend="xtensor")
    free = decode.kv.num_free_blocks
    decode.add_request(pd_request("r", [3, 4, 5, 6], DECODE, max_tokens=4))
    decode.step()
    assert decode.scheduler.awaiting_kv and decode.kv.num_free_blocks < free
    [chunk] = decode.release_kv("r")
    assert chunk.finish_reason == engine_pb2.FINISH_REASON_ERROR and "never arrived" in chunk.error
    assert decode.kv.num_free_blocks == free and not decode.requests and not decode.has_work()


def test_engines_without_a_listener_refuse_disaggregated_requests(new_engine, tiny_model):
    engine = new_engine(tiny_model)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(pd_request("r", [1, 2], DECODE))
    assert err.value.param == "disagg_phase"
    engine.attach_disagg(Recorder())
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(pd_request("p", [1, 2], PREFILL))
    assert err.value.param == "kv_target"
    contiguous = new_engine(tiny_model, kv_cache_backend="contiguous")
    contiguous.attach_disagg(Recorder())
    with pytest.raises(InvalidRequestError, match="cannot hand KV off"):
        contiguous.add_request(pd_request("r", [1, 2], DECODE))

"""Migration inside the engine: a running request's KV is copied to another engine in stages while
it keeps decoding, it stops at the source, and the destination continues it. The pages move
through each backend's PageStore (no transport), as :mod:`xllm.engine.handoff` moves them.

The oracle is one engine serving the whole request without interruption: what the client sees in
total (the source's chunks, then the destination's) has the same tokens, text, finish reason and
usage, greedy, seeded and with a stop string held back across the move, whether the source
decoded more tokens after the reservation (they reach the destination as appended tokens and it
computes their KV), whether the destination's prefix cache already held part of the request, and
whether the KV arrived at all (a failed transfer makes the destination recompute).
"""

from __future__ import annotations

import functools

import pytest

from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected, MigrationListener, generate, make_engine, make_request, moved_decode_request
from xllm.testing.tiny import tiny_tokenizer

HANDED_OFF = engine_pb2.FINISH_REASON_HANDED_OFF
FINAL = engine_pb2.MIGRATION_STAGE_FINAL


def copy(src, dst, src_pages, dst_pages, blocks: range) -> None:
    s, d = src.kv.page_store(), dst.kv.page_store()
    for j in blocks:
        d.write_block(dst_pages[j], s.read_block(src_pages[j]))


SAMPLINGS = {
    "greedy": dict(max_tokens=28, ignore_eos=True),
    "seeded": dict(max_tokens=28, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True),
    "stop-string": dict(max_tokens=40, stop=["e ", "th"], include_stop_str_in_output=False),
}


def migrate(src, dst, req: engine_pb2.GenerateRequest, client: Collected, *, decode_during_copy: int,
            received: bool = True) -> dict:
    """Move ``rid`` from ``src`` to ``dst`` the way the engine service does (reserve, copy the full
    blocks while ``src`` decodes ``decode_during_copy`` more steps, pause, copy the rest, commit),
    collecting the source's chunks in ``client``. Returns what moved."""
    rid = req.request_id
    cont = moved_decode_request(req, client)
    assert dst.add_request(cont) == []
    dst.step()  # reserves
    reservation = dst.disagg.reserved[rid]
    reserved, bs = reservation.num_tokens, src.layout.block_size
    snap = src.move_snapshot(rid)
    first = reservation.matched_tokens // bs
    staged = range(first, max(first, min(snap.num_computed_tokens, reserved) // bs))
    copy(src, dst, snap.pages, reservation.pages, staged)  # while the request keeps running
    for _ in range(decode_during_copy):
        client.add(src.step())
    assert src.pause_for_move(rid)
    while rid not in src.disagg.ready:  # async scheduling: once the step in flight landed
        client.add(src.step())
    ready = src.disagg.ready[rid]
    covered = min(ready.num_computed_tokens, reserved)
    rest = range(staged.stop if ready.num_preemptions == snap.num_preemptions else first, -(-covered // bs))
    copy(src, dst, ready.pages, reservation.pages, rest)
    commit = engine_pb2.KVCommit(transfer_id=rid, num_tokens=covered, migration=FINAL,
                                 appended_tokens=ready.token_ids[reserved:], sent_chars=ready.sent_chars)
    out = dst.install_kv(commit, received=received)
    last = src.release_kv(rid)
    assert [c.finish_reason for c in last] == [HANDED_OFF] and not last[0].text and not last[0].token_ids
    return {"staged": len(staged), "rest": len(rest), "appended": len(commit.appended_tokens), "final": out}


def run_moved(model, params: dict, prompt: list[int], *, moved_after: int, decode_during_copy: int,
              overlapped: bool = False, backend: str = "xtensor", received: bool = True,
              warm_destination: bool = False) -> tuple[Collected, dict]:
    engine = functools.partial(make_engine, model, kv_backend=backend, async_scheduling=overlapped,
                               kv_cache_memory_gib=0.01)  # a few hundred blocks: the paged backend allocates them
    src, dst = engine(), engine()
    src.attach_disagg(MigrationListener())
    dst.attach_disagg(MigrationListener())
    req = make_request("r", prompt, **params)
    if warm_destination:  # the destination has served the same prompt: its prefix cache holds part of it
        generate(dst, [make_request("warm", prompt, max_tokens=1)])
    client = Collected()
    client.add(src.add_request(req))
    while len(client.tokens.get("r", [])) < moved_after:
        client.add(src.step())
    info = migrate(src, dst, req, client, decode_during_copy=decode_during_copy, received=received)
    client.add(info.pop("final"))
    while dst.has_work():
        client.add(c for c in dst.step() if c.request_id == "r")
    assert "r" in client.final
    return client, info


def assert_same(got: Collected, want: Collected) -> None:
    assert got.tokens["r"] == want.tokens["r"]
    assert got.text["r"] == want.text["r"]
    g, w = got.final["r"], want.final["r"]
    assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
    assert g.usage.prompt_tokens == w.usage.prompt_tokens
    assert g.usage.completion_tokens == w.usage.completion_tokens == len(want.tokens["r"])


PROMPT_TEXT = "the quick brown fox jumps over the lazy dog and then " * 2  # two blocks of 64 and more
CASES = [(s, o, d) for s in SAMPLINGS for o in (False, True) for d in (0, 3)]


@pytest.mark.parametrize("sampling, overlapped, decode_during_copy", CASES,
                         ids=[f"{s}-{'async' if o else 'sync'}-{d}more" for s, o, d in CASES])
def test_a_migrated_request_equals_one_uninterrupted_run(tiny_model, sampling, overlapped, decode_during_copy):
    prompt = tiny_tokenizer().encode_pieces(list(PROMPT_TEXT))
    params = SAMPLINGS[sampling]
    want = generate(make_engine(tiny_model, async_scheduling=overlapped, kv_cache_memory_gib=0.01),
                    [make_request("r", prompt, **params)])
    assert len(want.tokens["r"]) > 10, "the oracle run must be long enough to move mid-stream"
    got, info = run_moved(tiny_model, params, prompt, moved_after=6, decode_during_copy=decode_during_copy,
                          overlapped=overlapped)
    assert_same(got, want)
    assert info["staged"] > 0 and info["rest"] > 0  # pages moved while it ran, and after it stopped
    if decode_during_copy:
        assert info["appended"] >= decode_during_copy  # tokens produced after the reservation


@pytest.mark.parametrize("moved_after", [1, 2, 9])
def test_every_cut_point_of_a_seeded_stream(tiny_model, moved_after):
    prompt = tiny_tokenizer().encode_pieces(list(PROMPT_TEXT))
    params = SAMPLINGS["seeded"]
    want = generate(make_engine(tiny_model, kv_cache_memory_gib=0.01), [make_request("r", prompt, **params)])
    got, _ = run_moved(tiny_model, params, prompt, moved_after=moved_after, decode_during_copy=1)
    assert_same(got, want)


def test_the_destination_prefix_cache_is_not_sent_again(tiny_model):
    prompt = tiny_tokenizer().encode_pieces(list(PROMPT_TEXT))
    params = SAMPLINGS["greedy"]
    want = generate(make_engine(tiny_model, kv_cache_memory_gib=0.01), [make_request("r", prompt, **params)])
    _, cold_info = run_moved(tiny_model, params, prompt, moved_after=5, decode_during_copy=0)
    warm, warm_info = run_moved(tiny_model, params, prompt, moved_after=5, decode_during_copy=0,
                                warm_destination=True)
    assert_same(warm, want)
    moved = lambda i: i["staged"] + i["rest"]  # noqa: E731
    assert moved(warm_info) < moved(cold_info)


def test_a_failed_transfer_is_recomputed_at_the_destination(tiny_model):
    prompt = tiny_tokenizer().encode_pieces(list(PROMPT_TEXT))
    params = SAMPLINGS["seeded"]
    want = generate(make_engine(tiny_model, kv_cache_memory_gib=0.01), [make_request("r", prompt, **params)])
    got, _ = run_moved(tiny_model, params, prompt, moved_after=6, decode_during_copy=2, received=False)
    assert_same(got, want)


def test_the_paged_backend_migrates_too(tiny_model):
    prompt = tiny_tokenizer().encode_pieces(list(PROMPT_TEXT))
    params = SAMPLINGS["seeded"]
    want = generate(make_engine(tiny_model, kv_backend="paged", kv_cache_memory_gib=0.01),
                    [make_request("r", prompt, **params)])
    got, _ = run_moved(tiny_model, params, prompt, moved_after=4, decode_during_copy=2, backend="paged")
    assert_same(got, want)


def test_only_a_running_request_can_be_paused(tiny_model):
    src = make_engine(tiny_model)
    src.attach_disagg(MigrationListener())
    assert not src.pause_for_move("unknown") and src.move_snapshot("unknown") is None
    src.add_request(make_request("r", [3, 4, 5], max_tokens=2, ignore_eos=True))
    assert src.move_snapshot("r") is None  # queued: nothing computed
    while src.has_work():
        src.step()
    assert not src.pause_for_move("r")  # finished

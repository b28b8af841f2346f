"""Beam search in the engine (xllm.core.beam) on the tiny model, against independent oracles: a
loop-by-loop HF-style beam search over full recomputation (no KV cache, plain causal attention),
brute-force scoring of every catalogue item, and a full sort for the candidate selection."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
import torch

from xllm.core.sequence import SeqStatus
from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2
from xllm.recsys.beam_topk import topk_candidates
from xllm.testing.engine import generate, make_request, run_to_completion
from xllm.testing.tiny import EOS


class _FullAttention:
    """One sequence, no cache: plain causal attention over the step's own rows (the oracle)."""

    def attention(self, layer, q, k, v, scale, v_dim=None):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale)
        return out.transpose(0, 1)


def _next_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        ids = torch.tensor(tokens)
        hidden = model.forward(ids, torch.arange(len(tokens)), _FullAttention())
        return torch.log_softmax(model.compute_logits(hidden[-1:]).double(), dim=-1)[0]


def _reference_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0, early_stopping=False):
    """HF's beam search written as loops: top 2W of beams x vocab (first step: beam 0 only), the top-W
    ranked ending ones become hypotheses, the first W others the beams; HF's stopping heuristics."""
    beams = [((), 0.0)]
    finished: list[tuple[float, tuple, float]] = []
    improvable = True
    for t in range(1, max_tokens + 1):
        cands = []
        for toks, score in beams:
            lp = _next_logprobs(model, prompt + list(toks))
            for tok in range(len(lp)):
                cands.append((score + float(lp[tok]), (*toks, tok)))
        cands = heapq.nlargest(2 * width, cands, key=lambda c: c[0])
        last = t == max_tokens
        full = len(finished) >= width
        nxt = []
        for rank, (score, toks) in enumerate(cands):
            ends = toks[-1] in eos or last
            if ends:
                if rank < width and improvable and not (full and early_stopping is True):
                    finished.append((score / t ** length_penalty, toks, score))
            elif len(nxt) < width:
                nxt.append((toks, score))
        finished = sorted(finished, key=lambda h: -h[0])[:width]
        beams = nxt
        if beams and len(finished) >= width:
            best_len = max_tokens if early_stopping == "never" and length_penalty > 0 else t
            improvable = improvable and beams[0][1] / best_len ** length_penalty > finished[-1][0]
        if last or not beams or not improvable or (len(finished) >= width and early_stopping is True):
            return finished
    return finished


def _beam_request(rid, prompt, width, max_tokens, **extra):
    req = make_request(rid, prompt, max_tokens=max_tokens, beam_width=width, **extra)
    req.sampling.ClearField("temperature")  # beam requests default to deterministic
    return req


def test_text_beam_search_matches_reference_on_every_backend(new_engine, kv_backend, scheduling):
    _check_text_beams(new_engine(), 3, 1.0, False)


@pytest.mark.parametrize("width,length_penalty,early_stopping", [(5, 0.5, True), (4, 2.0, "never")])
def test_length_penalty_and_early_stopping_match_reference(new_engine, width, length_penalty, early_stopping):
    _check_text_beams(new_engine(), width, length_penalty, early_stopping)


def _check_text_beams(engine, width, length_penalty, early_stopping):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # a partial last page
    es = {True: "true", False: "false", "never": "never"}[early_stopping]
    got = generate(engine, [_beam_request("b", prompt, width, 6, length_penalty=length_penalty,
                                          early_stopping=es)])
    beams = got.final["b"].beams
    ref = _reference_beam_search(engine.model, prompt, width, 6, {EOS}, length_penalty, early_stopping)
    assert [tuple(b.token_ids) for b in beams] == [toks for _, toks, _ in ref]
    for b, (score, _, logprob) in zip(beams, ref, strict=True):
        assert b.score == pytest.approx(score, abs=1e-4) and b.logprob == pytest.approx(logprob, abs=1e-4)
    assert not engine.has_work() and not engine.requests


def test_beams_share_the_prompt_kv_without_copies(new_engine):
    """The prompt's pages are held once while the group decodes: no page taken, none freed, the
    beams' rows outside the pool; all released at the end."""
    engine = new_engine(kv_cache_backend="xtensor")
    free0 = engine.kv.num_free_blocks
    prompt = list(range(5, 45))  # 40 tokens, a partial last page
    engine.add_request(_beam_request("b", prompt, 16, 8, ignore_eos=True))
    seen = []
    got = None
    while engine.has_work():
        chunks = engine.step()
        if engine.beams.groups:
            group = engine.beams.groups[0]
            assert group.seq.status is SeqStatus.BEAM_SEARCH and group.seq not in engine.scheduler.running
            seen.append((engine.kv.num_free_blocks, list(group.seq.kv_pages), engine.kv.pool.num_in_use))
        got = chunks or got
    assert len(seen) >= 5
    held = free0 - seen[0][0]
    assert held == engine.layout.blocks_for(len(prompt))
    assert all(s == seen[0] for s in seen)  # not one page taken or released during the beam steps
    assert len(got[0].beams) == 16 and all(len(b.token_ids) == 8 for b in got[0].beams)
    assert engine.kv.num_free_blocks == free0


def test_beam_prompt_uses_prefix_cache_and_chunked_prefill(new_engine):
    """A long history prefilled in chunks, then its beams; the same history again hits the prefix
    cache, and both searches give the same answer."""
    engine = new_engine(max_num_batched_tokens=32, block_size=16, kv_cache_backend="paged")
    prompt = [5 + (i * 7) % 50 for i in range(100)]
    first = generate(engine, [_beam_request("a", prompt, 6, 4, ignore_eos=True)]).final["a"]
    assert engine.counters.steps >= 4 + 3  # 4 prefill chunks of <= 32 tokens, then 3 beam steps
    second = generate(engine, [_beam_request("b", prompt, 6, 4, ignore_eos=True)]).final["b"]
    assert second.usage.cached_prompt_tokens >= 96
    assert [tuple(b.token_ids) for b in first.beams] == [tuple(b.token_ids) for b in second.beams]
    ref = _reference_beam_search(engine.model, prompt, 6, 4, set())
    assert [tuple(b.token_ids) for b in first.beams] == [toks for _, toks, _ in ref]


def _catalog(rng, n, vocab, length=3):
    return rng.integers(1, vocab, size=(n, length))


def test_catalogue_top_n_equals_brute_force(new_engine, tmp_path, kv_backend):
    rng = np.random.default_rng(1)
    items = _catalog(rng, 40, 60)
    path = tmp_path / "items.npy"
    np.save(path, items.astype(np.int32))
    engine = new_engine(item_catalog=str(path))
    prompt = [7, 8, 9, 10, 11, 12]
    # every item scored by teacher forcing on the oracle forward
    scores = []
    for i, item in enumerate(items.tolist()):
        lp = sum(float(_next_logprobs(engine.model, prompt + item[:d])[item[d]]) for d in range(3))
        scores.append((lp, i))
    distinct = {tuple(x) for x in items.tolist()}
    ref = sorted(((lp, i) for lp, i in scores if tuple(items[i].tolist()) in distinct), reverse=True)
    width = 64  # wider than the catalogue's prefixes at any depth: the search is exact
    req = _beam_request("r", prompt, width, 1, item_catalog=True, length_penalty=0.0)
    got = generate(engine, [req]).final["r"]
    assert len(got.beams) == len(distinct)
    for b, (lp, _) in zip(got.beams, ref, strict=False):
        assert tuple(b.token_ids) == tuple(items[b.item_id].tolist())
        assert b.logprob == pytest.approx(lp, abs=1e-4)
    # the same items (duplicates of the file map to their first line)
    assert [tuple(b.token_ids) for b in got.beams] == [tuple(items[i].tolist()) for _, i in ref
                                                        if i == min(j for j in range(len(items))
                                                                    if tuple(items[j]) == tuple(items[i]))]
    # a narrow beam decodes only catalogue items, with their exact log-probabilities
    got = generate(engine, [_beam_request("n", prompt, 4, 1, item_catalog=True, top_k=3)]).final["n"]
    by_item = dict((i, lp) for lp, i in scores)
    assert 1 <= len(got.beams) <= 4  # a narrow search may reach fewer items than beams
    for b in got.beams:
        assert tuple(b.token_ids) in distinct and b.logprob == pytest.approx(by_item[b.item_id], abs=1e-4)
    assert engine.beams.counters.candidates_scanned <= engine.beams.counters.candidates_total


@pytest.mark.parametrize("rows,width,keep,per_beam", [(1, 50, 8, None), (16, 200, 32, None), (64, 40, 64, 7),
                                                      (5, 3, 16, None)])
def test_candidate_selection_equals_a_full_sort(rows, width, keep, per_beam):
    g = torch.Generator().manual_seed(rows * width)
    lp = torch.log_softmax(torch.randn(rows, width, generator=g), dim=-1)
    lp[lp < -4.5] = float("-inf")  # masked candidates are never chosen
    scores = torch.sort(torch.randn(rows, generator=g) * 2, descending=True).values
    got = topk_candidates(scores, lp, keep, per_beam)
    limit = per_beam or width
    every = sorted(((float(scores[b] + lp[b, c]), b, c) for b in range(rows)
                    for c in torch.argsort(lp[b], descending=True)[:limit].tolist()
                    if math.isfinite(float(lp[b, c]))), reverse=True)[:keep]
    assert [(b, c) for _, b, c in every] == list(zip(got.beams.tolist(), got.cols.tolist(), strict=True))
    assert got.scores.tolist() == pytest.approx([s for s, _, _ in every])
    assert got.scanned <= int(torch.isfinite(lp).sum())


def test_bad_beam_requests_are_refused_naming_the_field(new_engine):
    engine = new_engine()
    for extra, field in [({"temperature": 0.7}, "temperature"), ({"stop": ["x"]}, "stop"),
                         ({"logprobs": True}, "logprobs"), ({"item_catalog": True}, "item_catalog"),
                         ({"early_stopping": "sometimes"}, "early_stopping")]:
        req = _beam_request("x", [5, 6, 7], 4, 4)
        for k, v in extra.items():
            if k == "stop":
                req.sampling.stop.extend(v)
            else:
                setattr(req.sampling, k, v)
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(req)
        assert err.value.param == field
    req = _beam_request("w", [5, 6, 7], 0, 4)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(req)
    assert err.value.param == "beam_width"
    # an abort mid-search releases the prompt's KV
    free0 = engine.kv.num_free_blocks
    engine.add_request(_beam_request("a", list(range(5, 30)), 4, 20, ignore_eos=True))
    while not engine.beams.groups:
        engine.step()
    final = engine.abort("a")
    assert final.finish_reason == engine_pb2.FINISH_REASON_ABORT
    run_to_completion(engine)
    assert not engine.beams.groups and engine.kv.num_free_blocks == free0


def test_beams_over_a_quantized_kv_cache(new_engine):
    """The prompt's KV read from int8 token rows (decoded per step): slot and page backends agree, and
    the search finds what it finds over unquantized KV here (the quantization error is small)."""
    prompt = list(range(5, 40))
    got = {}
    for backend, kv_dtype in (("xtensor", "int8"), ("paged", "int8"), ("xtensor", "auto")):
        engine = new_engine(kv_cache_backend=backend, kv_cache_dtype=kv_dtype)
        beams = generate(engine, [_beam_request("q", prompt, 4, 5, ignore_eos=True)]).final["q"].beams
        got[backend, kv_dtype] = [(tuple(b.token_ids), b.logprob) for b in beams]
    assert [t for t, _ in got["xtensor", "int8"]] == [t for t, _ in got["paged", "int8"]]
    assert [lp for _, lp in got["xtensor", "int8"]] == pytest.approx([lp for _, lp in got["paged", "int8"]], abs=1e-4)
    assert [t for t, _ in got["xtensor", "int8"]] == [t for t, _ in got["xtensor", "auto"]]

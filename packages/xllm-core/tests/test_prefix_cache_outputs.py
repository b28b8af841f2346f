"""The prefix cache reuses a block only when its tokens are all equal, checked on the outputs.

On one engine per KV backend (and KV dtype): prompt A, then B1 (A with the last token of block 0
changed) and B2 (A with the first token of block 1 changed). A block hash that skipped a token
would hand B1 A's KV for a token it does not have. Oracle: a fresh engine per prompt (no cache to
hit), greedy and seeded sampling; the hit counter must count exactly the leading blocks equal to a
block cached before (B1: none, B2: block 0).
"""

from __future__ import annotations

import random

import pytest

from xllm.testing.engine import KV_BACKENDS, generate, make_engine, make_request
from xllm.testing.tiny import TinyLM

NEW = 12


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(head_dim=16)


def _engine(model, backend: str, kind: str):
    config = {"block_size": 32} if backend == "xtensor" else {}  # whole OS pages at head_dim 16, auto and int8
    return make_engine(model, kv_backend=backend, kv_cache_dtype=kind, max_model_len=160, **config)


SAMPLING = {"greedy": {}, "seeded": {"temperature": 0.9, "seed": 11}}


def _equal_leading_blocks(prompt: list[int], earlier: list[list[int]], bs: int) -> int:
    """Full blocks of ``prompt`` (its last token is always computed) equal, with everything before them,
    to a block some earlier prompt cached."""
    usable = (len(prompt) - 1) // bs
    return max((next((b for b in range(usable) if prompt[: (b + 1) * bs] != e[: (b + 1) * bs]), usable)
                for e in earlier if len(e) - 1 >= bs), default=0)


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("kind", ["auto", "int8"])
@pytest.mark.parametrize("backend", KV_BACKENDS)
def test_a_prompt_differing_at_a_block_edge_gets_no_false_hit(model, backend, kind, sampling):
    eng = _engine(model, backend, kind)
    bs = eng.layout.block_size
    rng = random.Random(5)
    a = [rng.randrange(3, model.vocab_size) for _ in range(2 * bs + 5)]
    b1, b2 = list(a), list(a)
    b1[bs - 1] = 3 + (a[bs - 1] - 2) % (model.vocab_size - 3)  # the last token of block 0
    b2[bs] = 3 + (a[bs] - 2) % (model.vocab_size - 3)  # the first token of block 1
    assert b1[bs - 1] != a[bs - 1] and b2[bs] != a[bs]
    caching = backend != "contiguous"  # the contiguous backend has no prefix cache
    seen: list[list[int]] = []
    for rid, prompt in (("a", a), ("b1", b1), ("b2", b2)):
        request = make_request(rid, prompt, max_tokens=NEW, ignore_eos=True, **SAMPLING[sampling])
        before = eng.kv.prefix_stats.hits
        got = generate(eng, [request])
        hits = eng.kv.prefix_stats.hits - before
        fresh = _engine(model, backend, kind)
        want = generate(fresh, [request])
        fresh.close()
        assert got.tokens[rid] == want.tokens[rid], f"{rid} differs from a fresh engine's output"
        assert got.final[rid].finish_reason == want.final[rid].finish_reason
        assert len(got.tokens[rid]) == NEW
        want_blocks = _equal_leading_blocks(prompt, seen, bs) if caching else 0
        assert hits == want_blocks * bs, f"{rid}: {hits} cached tokens counted, {want_blocks} blocks truly match"
        seen.append(prompt)
    assert [_equal_leading_blocks(p, seen[:i], bs) for i, p in enumerate(seen)] == [0, 0, 1]
    eng.close()

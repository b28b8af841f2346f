"""The migrate-or-recompute decision and the rate estimate behind it."""

from __future__ import annotations

import math

from xllm.sched import RateEstimate, move_cost


def test_a_fast_link_migrates_and_a_slow_one_recomputes():
    # 1000 tokens of 20 KiB each: 20 MiB; the destination prefills 2000 tokens/s with nothing queued
    kv = 1000 * 20 * 1024
    fast = move_cost(kv, 1000, 0, bytes_per_s=1e9, queued_prefill_tokens=0, prefill_tokens_per_s=2000)
    assert fast.migrate and math.isclose(fast.transfer_seconds, kv / 1e9) and math.isclose(fast.recompute_seconds, 0.5)
    slow = move_cost(kv, 1000, 0, bytes_per_s=10e6, queued_prefill_tokens=0, prefill_tokens_per_s=2000)
    assert not slow.migrate  # 2 s on the wire against 0.5 s of prefill


def test_the_destination_queue_counts_against_recompute():
    kv = 1000 * 20 * 1024
    idle = move_cost(kv, 1000, 0, bytes_per_s=20e6, queued_prefill_tokens=0, prefill_tokens_per_s=2000)
    busy = move_cost(kv, 1000, 0, bytes_per_s=20e6, queued_prefill_tokens=4000, prefill_tokens_per_s=2000)
    assert not idle.migrate and busy.migrate  # 1.02 s vs 0.5 s; vs 2.5 s behind the queue


def test_moves_under_way_share_the_bandwidth():
    alone = move_cost(1000, 10, 0, bytes_per_s=1000, queued_prefill_tokens=0, prefill_tokens_per_s=5)
    behind = move_cost(1000, 10, 0, bytes_per_s=1000, queued_prefill_tokens=0, prefill_tokens_per_s=5,
                       queued_bytes=2000)
    assert alone.migrate and not behind.migrate  # 1 s vs 2 s; 3 s vs 2 s


def test_a_cached_prefix_is_neither_sent_nor_recomputed():
    c = move_cost(1000, 100, 75, bytes_per_s=1000, queued_prefill_tokens=0, prefill_tokens_per_s=100)
    assert math.isclose(c.transfer_seconds, 0.25) and math.isclose(c.recompute_seconds, 0.25)


def test_an_unmeasured_speed_is_never_predicted_quicker():
    assert not move_cost(10, 10, 0, 0, 0, 100).migrate
    assert move_cost(10, 10, 0, 1e6, 0, 0).migrate
    assert "unknown" in move_cost(10, 10, 0, 0, 0, 100).describe()


def test_rate_estimate_starts_at_the_prior_and_follows_measurements():
    r = RateEstimate(prior=100.0, alpha=0.5)
    assert r.rate == 100.0
    r.observe(0, 1.0)
    r.observe(10, 0.0)  # nothing measured
    assert r.samples == 0 and r.rate == 100.0
    r.observe(1000, 1.0)
    assert r.rate == 1000.0
    r.observe(3000, 1.0)
    assert r.rate == 2000.0 and r.samples == 2

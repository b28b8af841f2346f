"""The Prometheus metrics fed by the engine's per-step stats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from xllm.engine_api.stats import FinishedRequest, StepStats
from xllm.gateway.metrics import EngineMetrics
from xllm.proto.registry.v1 import instance_pb2

LABELS = {"model_name": "m", "instance": "i0"}


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: EngineMetrics, name: str, **extra: str) -> float:
    return samples(metrics)[(name, tuple(sorted({**LABELS, **extra}.items())))]


def prefill_step() -> StepStats:
    return StepStats(num_running=2, num_waiting=1, batch_size=2, num_decode_tokens=0, num_prefill_tokens=30,
                     num_preempted=0, kv_usage=0.25, step_time=0.01, prompt_tokens=30, ttfts=[0.05, 0.07])


def decode_step(finished: bool = False) -> StepStats:
    done = [FinishedRequest("r1", "length", 10, 2, 0.5, 0.05)] if finished else []
    return StepStats(num_running=1 if finished else 2, num_waiting=0, batch_size=2, num_decode_tokens=2,
                     num_prefill_tokens=0, num_preempted=1, kv_usage=0.5, step_time=0.02,
                     inter_token_latencies=[0.02, 0.03], finished=done)


def test_expected_names_after_a_step():
    m = EngineMetrics()
    m.observer("m", "i0").on_step(prefill_step())
    text = m.render().decode()
    for name in ("xllm:num_requests_running", "xllm:num_requests_waiting", "xllm:kv_cache_usage_perc",
                 "xllm:prompt_tokens_total", "xllm:generation_tokens_total", "xllm:time_to_first_token_seconds",
                 "xllm:inter_token_latency_seconds", "xllm:e2e_request_latency_seconds",
                 "xllm:iteration_tokens_total", "xllm:step_batch_size", "xllm:decode_batch_size",
                 "xllm:num_preemptions_total", "xllm:request_success_total"):
        assert f"# HELP {name}" in text, name
    assert 'model_name="m"' in text and 'instance="i0"' in text


def test_values_follow_the_steps():
    m = EngineMetrics()
    obs = m.observer("m", "i0")
    obs.on_step(prefill_step())
    assert value(m, "xllm:num_requests_running") == 2
    assert value(m, "xllm:num_requests_waiting") == 1
    assert value(m, "xllm:kv_cache_usage_perc") == 0.25
    assert value(m, "xllm:prompt_tokens_total") == 30
    assert value(m, "xllm:generation_tokens_total") == 2  # the two first tokens
    assert value(m, "xllm:time_to_first_token_seconds_count") == 2
    assert value(m, "xllm:time_to_first_token_seconds_sum") == 0.05 + 0.07
    assert value(m, "xllm:iteration_tokens_total_sum") == 30
    assert ("xllm:decode_batch_size_count", tuple(sorted(LABELS.items()))) not in samples(m)  # no decode yet

    obs.on_step(decode_step())
    obs.on_step(decode_step(finished=True))
    assert value(m, "xllm:num_requests_running") == 1
    assert value(m, "xllm:generation_tokens_total") == 6
    assert value(m, "xllm:inter_token_latency_seconds_count") == 4
    assert value(m, "xllm:decode_batch_size_count") == 2
    assert value(m, "xllm:decode_batch_size_sum") == 4
    assert value(m, "xllm:decode_batch_size_bucket", le="1.0") == 0  # both steps decoded 2 sequences
    assert value(m, "xllm:decode_batch_size_bucket", le="2.0") == 2
    assert value(m, "xllm:step_batch_size_count") == 3
    assert value(m, "xllm:num_preemptions_total") == 2
    assert value(m, "xllm:request_success_total", finished_reason="length") == 1
    assert value(m, "xllm:e2e_request_latency_seconds_count") == 1
    assert value(m, "xllm:e2e_request_latency_seconds_sum") == 0.5


def test_instances_are_labelled_apart_and_registries_are_independent():
    m = EngineMetrics()
    m.observer("m", "i0").on_step(prefill_step())
    m.observer("m", "i1").on_step(decode_step())
    assert value(m, "xllm:num_requests_running") == 2
    assert samples(m)[("xllm:num_preemptions_total", (("instance", "i1"), ("model_name", "m")))] == 1
    other = EngineMetrics()  # no global state: a second app starts from zero
    assert "xllm:prompt_tokens_total{" not in other.render().decode()


def test_set_load_refreshes_the_gauges():
    m = EngineMetrics()
    m.observer("m", "i0").on_step(prefill_step())
    m.set_load("m", "i0", instance_pb2.LoadReport(instance_id="i0", num_running=0, num_waiting=0, kv_usage=0.0))
    assert value(m, "xllm:num_requests_running") == 0
    assert value(m, "xllm:num_requests_waiting") == 0
    assert value(m, "xllm:kv_cache_usage_perc") == 0
    assert value(m, "xllm:prompt_tokens_total") == 30  # counters untouched


def test_offline_series_from_steps_and_from_heartbeats():
    """Co-location's series (xllm.sched.colocation): offline requests and tokens, preemptions by reason,
    the longest offline wait; the same from an in-process engine's steps and a remote one's counters."""
    from xllm.engine_api.stats import OfflineStepStats

    m = EngineMetrics()
    step = decode_step(finished=True)
    step.offline = OfflineStepStats(prompt_tokens=12, generation_tokens=2, finished=1,
                                    preempted={"batch_full": 2, "slo": 1}, longest_wait=3.5)
    m.observer("m", "i0").on_step(step)
    assert value(m, "xllm:offline_requests_total") == 1
    assert value(m, "xllm:offline_prompt_tokens_total") == 12
    assert value(m, "xllm:offline_generation_tokens_total") == 2
    assert value(m, "xllm:offline_preemptions_total", reason="batch_full") == 2
    assert value(m, "xllm:offline_preemptions_total", reason="slo") == 1
    assert value(m, "xllm:offline_longest_wait_seconds") == 3.5
    m.set_counters("m", "i1", instance_pb2.EngineCounters(steps=5, offline_requests=4, offline_generation_tokens=9,
                                                           offline_preemptions_kv=3))
    m.set_counters("m", "i1", instance_pb2.EngineCounters(steps=6, offline_requests=6, offline_generation_tokens=9,
                                                           offline_preemptions_kv=4, offline_preemptions_slo=2))
    remote = {"instance": "i1"}
    assert value(m, "xllm:offline_requests_total", **remote) == 6
    assert value(m, "xllm:offline_generation_tokens_total", **remote) == 9
    assert value(m, "xllm:offline_preemptions_total", reason="kv", **remote) == 4
    assert value(m, "xllm:offline_preemptions_total", reason="slo", **remote) == 2
    m.set_load("m", "i1", instance_pb2.LoadReport(offline_longest_wait=7.25))
    assert value(m, "xllm:offline_longest_wait_seconds", **remote) == 7.25


def test_handoffs_through_the_kv_store_are_counted_from_heartbeats():
    m = EngineMetrics()
    m.set_counters("m", "p0", instance_pb2.EngineCounters(steps=1, kv_handoffs_sent=2, kv_handoff_store_blocks=5))
    m.set_counters("m", "p0", instance_pb2.EngineCounters(steps=2, kv_handoffs_sent=3, kv_handoff_store_blocks=7,
                                                           kv_handoff_store_fallbacks=1))
    assert value(m, "xllm:kv_handoff_store_blocks_total", instance="p0") == 7
    assert value(m, "xllm:kv_handoff_store_fallbacks_total", instance="p0") == 1


def test_image_counters_from_steps_and_from_heartbeats():
    """The encode phase's series: images encoded, encoder-cache hits, the vision tower's seconds, from an in-process
    engine's steps and from a remote one's cumulative counters."""
    m = EngineMetrics()
    step = decode_step()
    step.images_encoded, step.image_cache_hits, step.image_encode_seconds = 3, 1, 0.25
    m.observer("m", "i0").on_step(step)
    assert value(m, "xllm:images_encoded_total") == 3
    assert value(m, "xllm:image_encoder_cache_hits_total") == 1
    assert value(m, "xllm:image_encode_seconds_total") == 0.25
    m.set_counters("m", "i1", instance_pb2.EngineCounters(steps=2, images_encoded=2, image_encode_seconds=0.5))
    m.set_counters("m", "i1", instance_pb2.EngineCounters(steps=3, images_encoded=5, image_cache_hits=4,
                                                           image_encode_seconds=1.25))
    assert value(m, "xllm:images_encoded_total", instance="i1") == 5
    assert value(m, "xllm:image_encoder_cache_hits_total", instance="i1") == 4
    assert value(m, "xllm:image_encode_seconds_total", instance="i1") == 1.25

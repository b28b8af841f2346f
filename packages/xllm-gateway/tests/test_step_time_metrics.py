"""The step-time predictor in /metrics: each in-process step's prediction error in a histogram, and
an instance's correction factor and recent error from its load report (in-process or heartbeat)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from xllm.engine_api.stats import StepStats
from xllm.gateway.metrics import EngineMetrics
from xllm.proto.registry.v1 import instance_pb2

LABELS = (("instance", "i0"), ("model_name", "m"))


def _samples(m: EngineMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}


def _step(error: float | None) -> StepStats:
    return StepStats(num_running=1, num_waiting=0, batch_size=1, num_decode_tokens=1, num_prefill_tokens=0,
                     num_preempted=0, kv_usage=0.1, step_time=0.01, step_time_prediction_error=error)


def test_prediction_errors_are_a_histogram() -> None:
    m = EngineMetrics()
    obs = m.observer("m", "i0")
    for err in (None, 0.03, 0.4, None, 0.04):  # None: no prediction yet, nothing observed
        obs.on_step(_step(err))
    s = _samples(m)
    assert s[("xllm:step_time_prediction_error_count", LABELS)] == 3
    assert abs(s[("xllm:step_time_prediction_error_sum", LABELS)] - 0.47) < 1e-9
    assert s[("xllm:step_time_prediction_error_bucket", (*LABELS[:1], ("le", "0.05"), LABELS[1]))] == 2


def test_load_report_sets_correction_and_recent_error_once_a_model_exists() -> None:
    m = EngineMetrics()
    m.set_load("m", "i0", instance_pb2.LoadReport(num_running=1))  # no model yet: no series
    assert ("xllm:step_time_correction_factor", LABELS) not in _samples(m)
    report = instance_pb2.LoadReport(num_running=1, step_predictor=instance_pb2.StepTimePredictor(
        coefficients=[0.004, 6e-4, 2e-7, 3e-6, 1e-4], correction=1.25, profiled=True, prediction_error=0.08))
    m.set_load("m", "i0", report)
    s = _samples(m)
    assert s[("xllm:step_time_correction_factor", LABELS)] == 1.25
    assert abs(s[("xllm:step_time_prediction_error_recent", LABELS)] - 0.08) < 1e-7
    m.forget("m", "i0")
    assert ("xllm:step_time_correction_factor", LABELS) not in _samples(m)


def test_measured_and_predicted_step_seconds_are_counters_across_restarts() -> None:
    m = EngineMetrics()

    def report(measured: float, predicted: float) -> instance_pb2.LoadReport:
        return instance_pb2.LoadReport(step_predictor=instance_pb2.StepTimePredictor(
            coefficients=[0.004, 6e-4, 2e-7, 3e-6, 1e-4], measured_seconds=measured, predicted_seconds=predicted))

    for measured, predicted in ((2.0, 1.0), (5.0, 3.0), (1.0, 0.5)):  # the last: the instance restarted
        m.set_load("m", "i0", report(measured, predicted))
    s = _samples(m)
    assert s[("xllm:step_time_measured_seconds_total", LABELS)] == 6.0
    assert s[("xllm:step_time_predicted_seconds_total", LABELS)] == 3.5


def test_expert_load_windows_set_the_moe_series() -> None:
    """An expert-parallel engine's closed load windows (xllm.core.eplb): the imbalance gauge, tokens per expert
    counted over windows, switches completed."""
    from xllm.engine_api.stats import ExpertBalance

    m = EngineMetrics()
    obs = m.observer("m", "i0")
    step = _step(None)
    step.experts = ExpertBalance(1.8, [30, 0, 10], switching=True, rebalances=0)
    obs.on_step(step)
    obs.on_step(_step(None))  # no window closed: nothing changes
    step = _step(None)
    step.experts = ExpertBalance(1.05, [20, 5, 15], rebalances=1)
    obs.on_step(step)
    s = _samples(m)
    assert s[("xllm:moe_expert_load_imbalance", LABELS)] == 1.05
    assert s[("xllm:eplb_rebalances", LABELS)] == 1
    tokens = {dict(k[1])["expert"]: v for k, v in s.items() if k[0] == "xllm:moe_expert_tokens_total"}
    assert tokens == {"0": 50, "1": 5, "2": 25}

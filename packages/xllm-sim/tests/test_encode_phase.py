"""The encode phase of image requests in the simulator (the engine's policy code, :mod:`xllm.sched.encode`):
steps worked out by hand from t = 0.01 + 0.001·tokens and 50 ms per image, with the phase and without it;
and a synthetic mix where every image is encoded exactly once (pure Python, no torch)."""

from __future__ import annotations

import pytest

from xllm.sched.latency import StepTimeModel
from xllm.sim import Cluster, RequestSpec, SimConfig, Workload, synthetic

LINEAR = StepTimeModel((0.01, 0.001, 0.0, 0.0, 0.0))
EPS = 1e-9
# a text request prefilling; an image request and a text request arrive during its step
THREE = [RequestSpec(0, 0.0, 100, 3), RequestSpec(1, 0.02, 50, 2, images=1), RequestSpec(2, 0.03, 30, 2)]

def run(specs, max_encode_images: int, batch_policy: str = "decode_first") -> tuple[Cluster, list[tuple]]:
    cfg = SimConfig(instances=1, routing="round_robin", heartbeat_s=0.0, block_size=16, kv_blocks=1000,
                    prefix_cache=False, max_encode_images=max_encode_images, encode_image_s=0.05,
                    batch_policy=batch_policy)
    cluster = Cluster(cfg, LINEAR)
    log = cluster.log_steps()
    cluster.run(specs)
    return cluster, log


def check(log: list[tuple], expected: list[tuple]) -> None:
    assert [e[3] for e in log] == [e[2] for e in expected]
    for got, (start, end, _) in zip(log, expected, strict=True):
        assert got[0] == pytest.approx(start, abs=EPS) and got[1] == pytest.approx(end, abs=EPS)


@pytest.mark.parametrize("policy", ["decode_first", "colocation"])
def test_the_image_is_encoded_in_a_step_before_its_prefill_and_the_text_request_goes_first(policy):
    cluster, log = run(THREE, max_encode_images=1, batch_policy=policy)
    # step 1: r0's prompt (10 + 100 ms). step 2: r0 decodes; r1 is not admitted unencoded: its image is encoded
    # (50 ms) beside r2's prompt (10 + 31 ms). step 3: r0 and r2 decode, r1's prompt (10 + 52 ms); r0 and r2
    # are done. step 4: r1 decodes its second token (11 ms).
    check(log, [(0.0, 0.11, ((0, 100),)), (0.11, 0.201, ((0, 1), (2, 30))),
                (0.201, 0.263, ((0, 1), (2, 1), (1, 50))), (0.263, 0.274, ((1, 1),))])
    ttft = {r.spec.rid: r.ttft for r in cluster.requests}
    assert ttft == pytest.approx({0: 0.11, 1: 0.243, 2: 0.171}, abs=EPS)
    assert cluster.report()["instances"][0]["encoded_images"] == 1


def test_without_the_phase_the_image_is_encoded_in_its_prefill_step():
    cluster, log = run(THREE, max_encode_images=0)
    # step 2 carries both prompts (10 + 81 ms) and r1's image (50 ms): r0's decode and r2's first token wait
    check(log, [(0.0, 0.11, ((0, 100),)), (0.11, 0.251, ((0, 1), (1, 50), (2, 30))),
                (0.251, 0.264, ((0, 1), (1, 1), (2, 1)))])
    ttft = {r.spec.rid: r.ttft for r in cluster.requests}
    assert ttft == pytest.approx({0: 0.11, 1: 0.231, 2: 0.221}, abs=EPS)
    assert cluster.report()["instances"][0]["encoded_images"] == 1


@pytest.mark.parametrize("max_encode_images", [0, 2])
def test_a_synthetic_mix_encodes_every_image_once_and_finishes(max_encode_images):
    work = Workload(rate=20.0, prompt="uniform:64:256", output="uniform:4:16", image_fraction=0.5,
                    images_per_request=3)
    specs = list(synthetic(work, 200, seed=1))
    images = sum(s.images for s in specs)
    assert 0 < images < 3 * len(specs)  # (about half of the requests have images)
    cfg = SimConfig(instances=2, heartbeat_s=0.0, max_encode_images=max_encode_images, encode_image_s=0.01)
    cluster = Cluster(cfg, LINEAR)
    cluster.run(specs)
    report = cluster.report()
    assert all(r.finish is not None for r in cluster.requests)
    assert sum(i["encoded_images"] for i in report["instances"]) == images

"""EPD strategies in the simulator (one prefill, one decode instance; ``e+p+d`` adds an encode instance): steps
worked out by hand from t = 0.01 + 0.001·tokens, 50 ms per image and 10 ms per embedding hand-off; the
``xllm-sim epd`` command's report (pure Python, no torch)."""

from __future__ import annotations

import json

import pytest

from xllm.sched.latency import StepTimeModel
from xllm.sim import Cluster, RequestSpec, SimConfig
from xllm.sim.cli import main

LINEAR = StepTimeModel((0.01, 0.001, 0.0, 0.0, 0.0))
EPS = 1e-9
IMAGE = [RequestSpec(0, 0.0, 50, 3, images=1)]


def run(specs, strategy: str, encode_instances: int = 0) -> tuple[Cluster, list[tuple]]:
    cfg = SimConfig(prefill_instances=1, decode_instances=1, encode_instances=encode_instances,
                    epd_strategy=strategy, routing="round_robin", heartbeat_s=0.0, block_size=16, kv_blocks=1000,
                    prefix_cache=False, encode_image_s=0.05, embedding_transfer_s=0.01, kv_bandwidth=1e18,
                    pd_overflow=False)
    cluster = Cluster(cfg, LINEAR)
    log = cluster.log_steps()
    cluster.run(specs)
    return cluster, log


def check(log: list[tuple], expected: list[tuple]) -> None:
    assert [(e[2], e[3]) for e in log] == [(e[2], e[3]) for e in expected]
    for got, (start, end, *_) in zip(log, expected, strict=True):
        assert got[0] == pytest.approx(start, abs=EPS) and got[1] == pytest.approx(end, abs=EPS)


def encoded(cluster: Cluster) -> dict[str, int]:
    return {i["instance_id"]: i["encoded_images"] for i in cluster.report()["instances"]}


@pytest.mark.parametrize(("strategy", "encode_instances", "encoder"), [("e+p+d", 1, "e2"), ("ed+p", 0, "e1")])
def test_the_image_is_encoded_elsewhere_then_prefilled_without_encoding(strategy, encode_instances, encoder):
    cluster, log = run(IMAGE, strategy, encode_instances)
    # the encoder's step: the image alone (50 ms); 10 ms later the prefill instance e0 computes the prompt
    # (10 + 50 ms) and encodes nothing; the decode instance e1 decodes tokens 2 and 3 (11 ms each)
    check(log, [(0.0, 0.05, encoder, ()), (0.06, 0.12, "e0", ((0, 50),)), (0.12, 0.131, "e1", ((0, 1),)),
                (0.131, 0.142, "e1", ((0, 1),))])
    (req,) = cluster.requests
    assert req.ttft == pytest.approx(0.12, abs=EPS) and req.finish == pytest.approx(0.142, abs=EPS)
    assert encoded(cluster)[encoder] == 1 and encoded(cluster)["e0"] == 0


def test_ep_d_encodes_on_the_prefill_instance():
    cluster, log = run(IMAGE, "ep+d")
    # the prefill instance's encode phase (50 ms), then its prompt: no hand-off of embeddings
    check(log, [(0.0, 0.05, "e0", ()), (0.05, 0.11, "e0", ((0, 50),)), (0.11, 0.121, "e1", ((0, 1),)),
                (0.121, 0.132, "e1", ((0, 1),))])
    assert encoded(cluster) == {"e0": 1, "e1": 0}


def test_ed_p_encodes_between_the_decode_steps_it_delays():
    # r0 (text) decodes on e1 when r1's image arrives: e1's next step carries r0's decode and r1's image
    specs = [RequestSpec(0, 0.0, 50, 4), RequestSpec(1, 0.07, 20, 2, images=1)]
    _, log = run(specs, "ed+p")
    check(log, [(0.0, 0.06, "e0", ((0, 50),)), (0.06, 0.071, "e1", ((0, 1),)),
                (0.071, 0.132, "e1", ((0, 1),)),  # 11 ms of decode + 50 ms of r1's image
                (0.132, 0.143, "e1", ((0, 1),)),   # r1's embeddings reach the gateway at 0.142, and e1 reserves
                (0.143, 0.173, "e0", ((1, 20),)),  # its KV between steps (0.143): then e0 prefills r1
                (0.173, 0.184, "e1", ((1, 1),))])


def test_config_rules():
    with pytest.raises(ValueError, match="encode_instances"):
        SimConfig(prefill_instances=1, decode_instances=1, epd_strategy="e+p+d").check()
    with pytest.raises(ValueError, match="PD mode"):
        SimConfig(instances=2, epd_strategy="ed+p").check()
    with pytest.raises(ValueError, match="ep\\+d"):
        SimConfig(prefill_instances=1, decode_instances=1, epd_strategy="e+d").check()


def test_the_epd_command_ranks_simulates_and_reports_the_picks(tmp_path, capsys):
    out = tmp_path / "epd.json"
    argv = ["epd", "--total-instances", "3", "--prompt-len", "128", "--output-len", "16", "--image-fraction", "0.5",
            "--encode-image-ms", "100", "--rate", "2", "--slo-ttft-ms", "3000", "--slo-tpot-ms", "200",
            "--requests", "60", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    strategies = {p["layout"].split()[0] for p in r["predicted"]}
    assert strategies == {"ep+d", "e+p+d", "ed+p"} and len(r["predicted"]) == 5  # 2 x (1P 2D, 2P 1D), 1E 1P 1D
    assert {s["layout"].split()[0] for s in r["simulated"]} == strategies
    assert r["model_pick"] == r["predicted"][0]["layout"] and 0 < r["checked_pick_vs_best"] <= 1
    assert "checked among its top 3" in capsys.readouterr().out
    no_slo = [a for i, a in enumerate(argv) if "--slo-ttft-ms" not in argv[max(i - 1, 0):i + 1]]
    assert main(no_slo) == 2  # goodput needs both SLOs
    assert "--slo-ttft-ms" in capsys.readouterr().err

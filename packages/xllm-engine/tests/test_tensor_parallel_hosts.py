"""One engine instance's ranks on two hosts (``--tensor-parallel-size 2 --nnodes 2``): node 0 (rank 0, the
engine) here, node 1 (rank 1) an ``xllm engine --node-rank 1`` process in a network namespace of its own
(:mod:`xllm.testing.netns`: another address behind a veth pair, so rank 0's rendezvous is beyond loopback
and needs the cluster token); where namespaces cannot be made, node 1 runs on loopback (logged).

Oracle: the one-process engine (TP=1) of the same tiny Llama (9 query / 3 KV heads) and flags: greedy and
seeded-sampling tokens identical, through chunked prefill and prefix-cache hits. A node 1 holding another
cluster token fails both nodes at start-up (node 0 with the credential error, node 1 with a nonzero exit);
node 1 killed mid-stream fails node 0's engine with ``RankFailed`` within seconds, never hangs it.
Flag combinations that cannot work are refused naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from xllm.common.net import free_port
from xllm.core.async_engine import AsyncEngine
from xllm.core.config import EngineConfig
from xllm.core.parallel.comm import CollectiveError
from xllm.engine.config import engine_config
from xllm.engine.loader import LoadedEngine, load_engine
from xllm.engine_api import flags
from xllm.engine_api.credential import ClusterKeys
from xllm.engine_api.errors import ConfigError
from xllm.engine_api.security import SecurityConfigError
from xllm.models import resolve_model
from xllm.testing import netns
from xllm.testing.engine import Collected, drive_loaded, make_request, stream_until_killed
from xllm.testing.models import save_llama_9q3kv

transformers = pytest.importorskip("transformers")
log = logging.getLogger(__name__)

TOKEN = "tp-hosts-test-token"
SYSTEM = list(range(1000, 1140))  # a shared prefix longer than one xTensor block (128 tokens)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_llama_9q3kv(tmp_path_factory.mktemp("tp_hosts") / "llama_9q3kv", resolve_model(None, progress=False))


@dataclass
class Hosts:
    """Where node 0 (this process) and node 1 run: a namespace (``ns``) or, without one, both on loopback."""

    master_addr: str
    prefix: list[str]
    ns: netns.Namespace | None = None


@pytest.fixture(scope="module")
def hosts():
    reason, _ = netns.probe()
    if reason is not None:
        log.warning("network namespaces unavailable (%s): node 1 runs on loopback", reason)
        yield Hosts("127.0.0.1", [])
        return
    ns = netns.Namespace(7, tag="xllm-tp").create()
    try:
        yield Hosts(ns.host_ip, ns.prefix(), ns)
    finally:
        ns.delete()


def config(tp: int, **extra) -> EngineConfig:
    return EngineConfig(dtype=torch.float32, quantization="none", kv_cache_backend="xtensor", max_num_seqs=6,
                        max_num_batched_tokens=64, kv_cache_memory_gib=8 * 128 * 512 / 2**30, max_model_len=512,
                        num_threads=1, tensor_parallel_size=tp, **extra)


def start_node1(model_dir, h: Hosts, port: int, token: str) -> subprocess.Popen:
    """``xllm engine --node-rank 1``: the same engine flags as node 0's, the token in the environment."""
    cmd = [*h.prefix, sys.executable, "-m", "xllm.engine", "--model", str(model_dir), "--dtype", "float32",
           "--threads", "1", "--max-num-seqs", "6", "--max-num-batched-tokens", "64", "--max-model-len", "512",
           "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", h.master_addr,
           "--master-port", str(port), "--no-progress"]
    env = {**os.environ, "XLLM_CLUSTER_TOKEN": token, "OMP_WAIT_POLICY": "PASSIVE"}
    log_file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by stop(); (a pipe nobody reads could fill and block it)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=log_file)
    proc.log_file = log_file  # type: ignore[attr-defined]
    return proc


def node_log(proc: subprocess.Popen) -> str:
    proc.log_file.seek(0)  # type: ignore[attr-defined]
    return proc.log_file.read()  # type: ignore[attr-defined]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.log_file.close()  # type: ignore[attr-defined]


def load_node0(model_dir, h: Hosts, port: int, token: str) -> LoadedEngine:
    cfg = config(2, nnodes=2, master_addr=h.master_addr, master_port=port, cluster_keys=ClusterKeys.from_token(token))
    return load_engine(str(model_dir), "tiny", cfg, "tp2-hosts", progress=False)


def workload():
    reqs = [make_request(f"greedy{i}", SYSTEM + [2000 + 7 * i + j for j in range(6 + i)], max_tokens=16)
            for i in range(3)]  # a shared prefix (hits once cached), chunked (64-token budget)
    reqs += [make_request(f"sampled{i}", [*SYSTEM[:60], 3000 + i], temperature=0.8, top_p=0.95, seed=11 + i,
                          max_tokens=16) for i in range(2)]
    return reqs


def serve(loaded: LoadedEngine, reqs) -> tuple[Collected, object]:
    return drive_loaded(loaded, reqs), loaded.engine.kv.prefix_stats


def close(loaded: LoadedEngine) -> None:
    loaded.engine.close()
    loaded.compute.shutdown()


def test_bad_node_flags_are_refused():
    for extra, flag in [(dict(nnodes=2, master_port=29500, tensor_parallel_size=3), "--nnodes 2"),
                        (dict(nnodes=2, node_rank=2, master_port=29500), "--node-rank"),
                        (dict(nnodes=2), "--master-port"),
                        (dict(nnodes=2, master_port=29500, tp_comm="shm"), "--tp-comm shm"),
                        (dict(master_port=70000), "--master-port"),
                        (dict(nnodes=0), "--nnodes")]:
        with pytest.raises(ConfigError, match=flag):
            EngineConfig(**{"tensor_parallel_size": 2, **extra})
    parser = argparse.ArgumentParser()
    flags.add_engine_process_arguments(parser)
    args = parser.parse_args(["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                              "10.0.0.1", "--master-port", "29500", "--cluster-token", TOKEN])
    cfg = engine_config(args)
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (2, 1, "10.0.0.1", 29500)
    assert cfg.cluster_keys == ClusterKeys.from_token(TOKEN) and TOKEN not in repr(cfg)
    with pytest.raises(SystemExit):  # a negative rank is refused by the flag's type
        parser.parse_args(["--node-rank", "-1"])


def test_a_rendezvous_beyond_loopback_needs_the_token(model_dir, monkeypatch):
    monkeypatch.delenv("XLLM_CLUSTER_TOKEN", raising=False)
    cfg = config(2, nnodes=2, master_addr="10.77.99.1", master_port=29500)
    with pytest.raises(SecurityConfigError, match=r"--master-addr 10\.77\.99\.1 is not loopback"):
        load_engine(str(model_dir), "tiny", cfg, "no-token", progress=False)
    from xllm.engine.instance import main  # node 1 refuses it too, before it starts a rank
    assert main(["--model", str(model_dir), "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "10.77.99.1", "--master-port", "29500", "--no-progress"]) == 2


def test_a_node_with_another_token_fails_both_nodes(model_dir, hosts):
    port = free_port(hosts.master_addr)
    node1 = start_node1(model_dir, hosts, port, "another-cluster-token-0123456789")
    try:
        with pytest.raises(CollectiveError, match=r"rank\(s\) \[1\] did not prove the cluster credential"):
            load_node0(model_dir, hosts, port, TOKEN)
        assert node1.wait(60) != 0
        assert "did not prove the cluster credential" in node_log(node1)
    finally:
        stop(node1)


WRITER = """
import os, sys, numpy as np
from xllm.core.executor.channel import OPS, SETUP, STEP
from xllm.core.executor.net_channel import NetChannelSpec, NetPlanChannel
from xllm.core.parallel.comm import GlooComm, GroupAddress
comm = GlooComm(GroupAddress("127.0.0.1", int(sys.argv[1]), 30.0), 0, 2)
channel = NetPlanChannel.join(NetChannelSpec(2, 64, 30.0))
channel.publish(SETUP, b"set-up", 10.0)
channel.publish(STEP, np.arange(5, dtype=np.int64), 10.0)
channel.publish(OPS, b"", 10.0)
try:
    channel.publish(STEP, bytes(65), 10.0)
except ValueError:
    pass
else:
    sys.exit(3)
channel.wait_acked(channel.publish(STEP, bytes(range(64)), 10.0), 10.0)
sys.stdin.read()  # until the test closes it: then gone without a SHUTDOWN
# at once, as a crash would: the interpreter's teardown may destroy gloo's still-joinable threads, which aborts
# the process (std::terminate) after every check above passed
os._exit(0)
"""


def test_the_network_plan_channel_delivers_in_order_and_fails_when_rank_0_is_gone():
    from xllm.core.executor.channel import OPS, SETUP, STEP, RankFailed
    from xllm.core.executor.net_channel import NetChannelSpec, NetPlanChannel
    from xllm.core.parallel.comm import GlooComm, GroupAddress

    port = free_port("127.0.0.1")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(port)], stdin=subprocess.PIPE)
    comm = channel = None
    try:
        comm = GlooComm(GroupAddress("127.0.0.1", port, 30.0), 1, 2)
        channel = NetPlanChannel.join(NetChannelSpec(2, 64, 30.0))
        with pytest.raises(ValueError, match="rank 0 writes"):
            channel.publish(STEP, b"", 1.0)
        got = [channel.receive(lambda: True) for _ in range(4)]
        assert got == [(SETUP, b"set-up"), (STEP, np.arange(5, dtype=np.int64).tobytes()), (OPS, b""),
                       (STEP, bytes(range(64)))]
        assert channel.seq == 4
        writer.stdin.close()  # rank 0 exits: its connection drops while this rank waits for a plan
        started = time.monotonic()
        with pytest.raises(RankFailed, match="connection"):
            channel.receive(lambda: True)
        assert time.monotonic() - started < 10
        assert writer.wait(10) == 0
    finally:
        if channel is not None:
            channel.close()
        if comm is not None:
            comm.close()
        if writer.poll() is None:
            writer.kill()
        writer.wait(10)


@pytest.mark.parametrize("tp_comm", ["auto", "gloo"])
def test_one_host_ranks_prove_the_token_too(model_dir, tp_comm):
    loaded = load_engine(str(model_dir), "tiny", config(2, tp_comm=tp_comm, cluster_keys=ClusterKeys.from_token(TOKEN)),
                         "tp2-token", progress=False)
    try:
        got, _ = serve(loaded, [make_request("one", SYSTEM[:10], max_tokens=4, ignore_eos=True)])
        assert len(got.tokens["one"]) == 4
    finally:
        close(loaded)


def test_closing_node_0_stops_node_1_cleanly(model_dir, hosts):
    port = free_port(hosts.master_addr)
    node1 = start_node1(model_dir, hosts, port, TOKEN)
    try:
        loaded = load_node0(model_dir, hosts, port, TOKEN)
        try:
            got, _ = serve(loaded, [make_request("one", SYSTEM[:10], max_tokens=4, ignore_eos=True)])
            assert len(got.tokens["one"]) == 4
        finally:
            close(loaded)  # a SHUTDOWN plan: node 1's rank stops, then node 1
        assert node1.wait(30) == 0, node_log(node1)[-2000:]
    finally:
        stop(node1)


@pytest.fixture(scope="module")
def pair(model_dir, hosts):
    """Node 1 (another host) and node 0's engine (here), for the tests below: the last kills node 1."""
    port = free_port(hosts.master_addr)
    node1 = start_node1(model_dir, hosts, port, TOKEN)
    try:
        loaded = load_node0(model_dir, hosts, port, TOKEN)
    except BaseException:
        stop(node1)
        raise
    try:
        yield loaded, node1
    finally:
        close(loaded)
        stop(node1)


def test_two_hosts_generate_what_one_process_does(model_dir, pair):
    reqs = workload()
    one = load_engine(str(model_dir), "tiny", config(1), "tp1", progress=False)
    try:
        want, _ = serve(one, reqs)
    finally:
        close(one)
    two, node1 = pair
    assert two.engine.runner.group.size == 2 and two.engine.runner.group.processes == []  # rank 1: node 1's
    got, prefix = serve(two, reqs)
    assert node1.poll() is None
    assert set(got.final) == {r.request_id for r in reqs}
    for r in reqs:
        assert got.tokens[r.request_id] == want.tokens[r.request_id], r.request_id
        assert got.final[r.request_id].finish_reason == want.final[r.request_id].finish_reason, r.request_id
    assert prefix.hits > 0, "no prefix-cache hit"


def test_a_killed_node_fails_the_instance_within_seconds(pair):
    loaded, node1 = pair
    aeng = AsyncEngine(loaded.engine, compute=loaded.compute)
    aeng.start()
    try:
        kill = lambda: os.killpg(node1.pid, signal.SIGKILL)  # noqa: E731  (the node and its rank)
        n, err, after = stream_until_killed(aeng, SYSTEM[:20], kill)
        assert err is not None and n < 400, "the stream did not fail"
        assert after < 10
        assert aeng.crashed and "RankFailed" in (aeng.dead_reason or "")
    finally:
        aeng.shutdown(5)
    assert node1.wait(10) == -signal.SIGKILL

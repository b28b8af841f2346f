"""The ``xllm`` command line: every flag documented, parsed and validated."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from xllm.engine.flags import engine_args, engine_config
from xllm.gateway.cli import build_parser, main

ENGINE_CONFIG_FLAGS = ["--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                       "--kv-cache-memory", "--max-waiting", "--device", "--threads", "--seed", "--kv-cache-backend",
                       "--block-size", "--no-prefix-cache", "--async-scheduling", "--no-native-decode",
                       "--compile-decode"]
HANDOFF_FLAGS = ["--kv-transfer", "--kv-handoff-timeout", "--kv-reservation-timeout", "--mooncake-master",
                 "--mooncake-metadata"]
SERVE_FLAGS = ["--model", "--served-model-name", "--host", "--port", *ENGINE_CONFIG_FLAGS, "--no-progress",
               "--log-level", "--instances", "--etcd", "--etcd-prefix", "--routing", "--prefill-instances",
               "--decode-instances", *HANDOFF_FLAGS]
ENGINE_FLAGS = ["--model", "--served-model-name", "--host", "--port", "--instance-id", "--advertise-address",
                "--etcd", "--etcd-prefix", "--registry", "--lease-ttl", "--heartbeat-interval", "--drain-timeout",
                "--exit-with-parent", "--role", *HANDOFF_FLAGS, *ENGINE_CONFIG_FLAGS, "--no-progress", "--log-level"]


def _sub_parser(name: str = "serve"):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def _serve_parser():
    return _sub_parser("serve")


@pytest.mark.parametrize("command, flags", [("serve", SERVE_FLAGS), ("engine", ENGINE_FLAGS)])
def test_every_flag_has_help(command, flags):
    parser = _sub_parser(command)
    documented = {opt: a for a in parser._actions for opt in a.option_strings}
    assert set(flags) <= set(documented)
    for action in parser._actions:
        if action.option_strings == ["-h", "--help"]:
            continue
        assert action.help and len(action.help) > 10, action.option_strings
    assert set(documented) - {"-h", "--help"} == set(flags), "a new flag needs a test entry"


@pytest.mark.parametrize("command, flags, shown", [
    ("serve", SERVE_FLAGS, "(default: 8000)"),  # defaults are shown
    ("engine", ENGINE_FLAGS, "EngineService"),
])
def test_help_lists_every_flag(capsys, command, flags, shown):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in flags:
        assert flag in out, flag
    assert shown in out


def test_cluster_flags_parse():
    args = build_parser().parse_args(["serve", "--instances", "2", "--etcd", "127.0.0.1:2379", "--routing",
                                      "round_robin"])
    assert (args.instances, args.etcd, args.etcd_prefix, args.routing) == (2, "127.0.0.1:2379", "/xllm", "round_robin")
    assert build_parser().parse_args(["serve"]).instances is None
    assert build_parser().parse_args(["serve"]).routing == "kv_aware"
    args = build_parser().parse_args(["engine", "--etcd", "h:1", "--instance-id", "e1", "--port", "0",
                                      "--lease-ttl", "3", "--heartbeat-interval", "0.5"])
    assert (args.etcd, args.instance_id, args.port, args.lease_ttl, args.heartbeat_interval) == ("h:1", "e1", 0,
                                                                                                3.0, 0.5)
    assert (args.host, args.drain_timeout, args.registry) == ("127.0.0.1", 30.0, None)


def test_engine_args_for_spawned_instances():
    args = build_parser().parse_args(["serve", "--instances", "2", "--dtype", "fp32", "--threads", "1",
                                      "--kv-cache-memory", "0.5", "--block-size", "32", "--no-prefix-cache"])
    out = engine_args(args, 2)
    parsed = build_parser().parse_args(["engine", *out])
    assert (parsed.dtype, parsed.threads, parsed.kv_cache_memory, parsed.block_size) == ("fp32", 1, 0.5, 32)
    assert parsed.no_prefix_cache
    default_threads = build_parser().parse_args(["engine", *engine_args(build_parser().parse_args(["serve"]), 64)])
    assert default_threads.threads == 1  # cores divided among instances, at least one each


def test_engine_rejects_two_registries(capsys):
    assert main(["engine", "--etcd", "h:1", "--registry", "h:2", "--no-progress"]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve", "--prefill-instances", "1", "--decode-instances", "1"], ["engine"]])
def test_mooncake_transfer_needs_its_master(command, capsys):
    """Checked before any engine starts, not as a traceback from each spawned engine."""
    assert main([*command, "--kv-transfer", "mooncake", "--mooncake-master", "h:1", "--no-progress"]) == 2
    assert "--mooncake-metadata" in capsys.readouterr().err



def test_top_level_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "serve" in out and "OpenAI-compatible" in out


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "xllm.gateway", "serve", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--max-model-len" in r.stdout


def test_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.dtype, args.model, args.served_model_name) == ("127.0.0.1", 8000,
                                                                                     "bfloat16", None, None)
    cfg = engine_config(args)
    assert cfg.dtype == torch.bfloat16
    assert cfg.max_num_seqs == 64 and cfg.max_num_batched_tokens == 2048
    assert cfg.max_model_len is None and cfg.kv_cache_memory_gib == 2.0
    assert cfg.max_waiting_requests == 4096 and cfg.num_threads is None and cfg.seed == 0


def test_flags_reach_the_engine_config():
    args = build_parser().parse_args(["serve", "--dtype", "fp32", "--max-num-seqs", "8", "--max-num-batched-tokens",
                                      "256", "--max-model-len", "512", "--kv-cache-memory", "0.5",
                                      "--max-waiting", "10", "--threads", "2", "--seed", "7", "--device", "cpu"])
    cfg = engine_config(args)
    assert cfg.dtype == torch.float32
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (8, 256, 512)
    assert (cfg.kv_cache_memory_gib, cfg.max_waiting_requests, cfg.num_threads, cfg.seed) == (0.5, 10, 2, 7)


@pytest.mark.parametrize("argv", [
    ["serve", "--max-num-seqs", "0"],
    ["serve", "--max-model-len", "-5"],
    ["serve", "--max-model-len", "1"],
    ["serve", "--kv-cache-memory", "0"],
    ["serve", "--port", "http"],
    ["serve", "--dtype", "int8"],
    ["serve", "--log-level", "loud"],
    ["serve", "--bogus"],
    ["serve", "--instances", "0"],
    ["serve", "--routing", "random"],
    ["engine", "--lease-ttl", "0"],
    [],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_missing_model_is_a_clean_error(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "no-such-model"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xllm serve: error:")


def test_engine_ablation_flags_reach_the_config_and_spawned_engines():
    args = build_parser().parse_args(["serve", "--async-scheduling", "--no-native-decode", "--compile-decode"])
    cfg = engine_config(args)
    assert cfg.async_scheduling and not cfg.native_decode and cfg.compile_decode
    spawned = engine_args(args, 2)
    assert {"--async-scheduling", "--no-native-decode", "--compile-decode"} <= set(spawned)
    defaults = engine_config(build_parser().parse_args(["serve"]))
    assert not defaults.async_scheduling and defaults.native_decode and not defaults.compile_decode


def test_a_cluster_gateway_imports_no_torch():
    """Everything ``xllm serve --etcd`` / ``--instances`` runs in the gateway process: the CLI with all
    its flags, the cluster composition, the app, routing, the registries and the gRPC engine client."""
    code = ("import sys\n"
            "from xllm.gateway.cli import build_parser\n"
            "import xllm.gateway.cluster, xllm.gateway.app, xllm.gateway.dispatch, xllm.engine.client\n"
            "args = build_parser().parse_args(['serve', '--etcd', 'h:1', '--instances', '2'])\n"
            "from xllm.engine.flags import engine_args\n"
            "engine_args(args, 2)\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded[:5]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

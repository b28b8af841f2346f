"""The ``xllm`` command line: every flag documented, parsed and validated."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

from xllm.engine.config import engine_config
from xllm.engine_api.errors import ConfigError
from xllm.engine_api.flags import engine_args
from xllm.gateway.cli import build_parser, main
from xllm.sched import DEFAULT_OFFLINE_SLO_FRACTION

ENGINE_CONFIG_FLAGS = ["--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                       "--kv-cache-memory", "--max-waiting", "--device", "--threads", "--seed", "--kv-cache-backend",
                       "--block-size", "--no-prefix-cache", "--async-scheduling", "--no-native-decode",
                       "--compile-decode"]
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, "--profile"]  # the step-time profile (xllm.core.step_timing)
# online SLOs and offline co-location (xllm.sched.colocation)
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, "--slo-ttft-ms", "--slo-tpot-ms", "--offline-starvation-s",
                       "--offline-slo-fraction"]
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, "--max-encode-images"]  # the encode phase (xllm.sched.encode)
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, "--speculative", "--num-speculative-tokens", "--speculative-max-batch",
                       "--speculative-self-layers", "--draft-model"]
# KV tiers below the engine's KV memory (xllm.core.kv.lower_tiers)
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, "--kv-host-memory", "--kv-host-dir", "--kv-disk-dir", "--kv-disk-size",
                       "--kv-store", "--kv-store-segment", "--mooncake-metadata"]
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, "--quantization", "--kv-cache-dtype"]  # weights and KV quantization
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, "--item-catalog"]  # generative recommendation (issue 19)
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, "--tensor-parallel-size", "--tp-comm",
                       "--tp-overlap"]  # tensor parallelism (issue 45)
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, "--enable-expert-parallel", "--num-redundant-experts", "--enable-eplb",
                       "--eplb-step-interval", "--eplb-policy"]  # expert parallelism and EPLB (issue 46)
# the request limits of gateway and engines, defined once (xllm.engine_api.flags.add_request_bound_flags)
REQUEST_BOUND_FLAGS = ["--max-prompt-chars", "--max-stop", "--max-stop-chars", "--max-stop-token-ids",
                       "--max-logit-bias"]
ENGINE_CONFIG_FLAGS = [*ENGINE_CONFIG_FLAGS, *REQUEST_BOUND_FLAGS]
HANDOFF_FLAGS = ["--kv-transfer", "--kv-handoff-timeout", "--kv-reservation-timeout"]
CLUSTER_SECURITY_FLAGS = ["--cluster-token", "--cluster-token-file", "--tls-cert", "--tls-key", "--tls-ca",
                          "--tls-server-name", "--etcd-ca", "--etcd-cert", "--etcd-key", "--insecure-cluster"]
SERVE_FLAGS = ["--model", "--served-model-name", "--host", "--port", *ENGINE_CONFIG_FLAGS, "--no-progress",
               "--log-level", "--instances", "--etcd", "--etcd-prefix", "--routing", "--drain-moves",
               "--kv-bandwidth-prior", "--prefill-instances", "--decode-instances", "--etcd-watch-timeout",
               "--routing-fallback-ratio",
               "--engine-idle-timeout", "--request-timeout", "--tool-call-parser",
               *HANDOFF_FLAGS, *CLUSTER_SECURITY_FLAGS]
ENGINE_FLAGS = ["--model", "--served-model-name", "--host", "--port", "--instance-id", "--advertise-address",
                "--etcd", "--etcd-prefix", "--registry", "--lease-ttl", "--heartbeat-interval", "--drain-timeout",
                "--exit-with-parent", "--role", *HANDOFF_FLAGS, *ENGINE_CONFIG_FLAGS, "--no-progress", "--log-level",
                *CLUSTER_SECURITY_FLAGS, "--detached-grace-s"]

PROFILE_FLAGS = ["--model", "--served-model-name", *ENGINE_CONFIG_FLAGS, "--output", "-o", "--quick", "--reps",
                 "--warmup", "--decode-contexts", "--batches", "--ladder-tokens", "--mixed-chunks", "--prefill-chunks",
                 "--prefill-cached", "--no-progress", "--log-level"]  # xllm profile (xllm.engine.profiler)

API_FLAGS = ["--api-key", "--priority-api-key", "--allow-client-priority", "--max-inflight-requests",
             "--max-body-mib", "--max-prompts", "--max-n", "--max-logprobs"]
API_FLAGS = [*API_FLAGS, "--offline-priority", "--admin-api-key"]  # offline priority; LoRA loading
API_FLAGS = [*API_FLAGS, "--http-header-timeout-s", "--http-body-timeout-s", "--http-keep-alive-s",
             "--max-connections-per-client", "--max-connections"]  # HTTP connection bounds (xllm.gateway.http_guard)
API_FLAGS = [*API_FLAGS, "--allowed-media-domains", "--max-image-mib", "--max-image-pixels",
             "--max-images-per-request", "--media-fetch-timeout-s"]  # image inputs (xllm.gateway.media.limits)
SERVE_FLAGS = [*SERVE_FLAGS, *API_FLAGS]  # the OpenAI API's keys and limits (xllm.gateway.api_flags)
SERVE_FLAGS = [*SERVE_FLAGS, "--stream-stall-timeout"]  # streams of stopped engines (xllm.gateway.progress)
ENGINE_FLAGS = [*ENGINE_FLAGS, "--step-timeout"]  # the step watchdog (xllm.core.watchdog)
SERVE_FLAGS = [*SERVE_FLAGS, "--step-timeout"]  # (in-process engines; passed on to spawned ones)
ENGINE_FLAGS = [*ENGINE_FLAGS, "--metrics-port", "--metrics-host"]  # the engine's own /metrics (engine_api.metrics)
ENGINE_FLAGS = [*ENGINE_FLAGS, "--nnodes", "--node-rank", "--master-addr", "--master-port"]  # TP over hosts (issue 45)
PD_ROLE_FLAGS = ["--pd-policy", "--pd-flip-window", "--pd-flip-cooldown", "--pd-cluster-cooldown", "--pd-min-per-role",
                 "--pd-max-flips", "--pd-prefill-overflow", "--no-pd-prefill-overflow"]
SERVE_FLAGS = [*SERVE_FLAGS, *PD_ROLE_FLAGS]  # dynamic PD roles (xllm.gateway.roles)
SERVE_FLAGS = [*SERVE_FLAGS, "--encode-instances", "--epd-strategy", "--encode-timeout"]  # EPD (xllm.gateway.encode)
TRACING_FLAGS = ["--otlp-traces-endpoint", "--otlp-traces-protocol", "--otlp-traces-sample-ratio"]  # engine_api.tracing
SERVE_FLAGS = [*SERVE_FLAGS, *TRACING_FLAGS, "--log-format"]  # --log-format: engine_api.logs
ENGINE_FLAGS = [*ENGINE_FLAGS, *TRACING_FLAGS, "--log-format"]
LORA_FLAGS = ["--lora-modules", "--max-loras", "--max-lora-rank"]  # multi-LoRA (xllm.core.lora), engine flags
SERVE_FLAGS, ENGINE_FLAGS, PROFILE_FLAGS = ([*flags, *LORA_FLAGS] for flags in (SERVE_FLAGS, ENGINE_FLAGS,
                                                                              PROFILE_FLAGS))
PROFILE_FLAGS = [*PROFILE_FLAGS, "--log-format"]


def _sub_parser(name: str = "serve"):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def _serve_parser():
    return _sub_parser("serve")


@pytest.mark.parametrize("command, flags", [("serve", SERVE_FLAGS), ("engine", ENGINE_FLAGS),
                                            ("profile", PROFILE_FLAGS)])
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
    assert build_parser().parse_args(["serve", "--routing-fallback-ratio", "50"]).routing_fallback_ratio == 50.0
    with pytest.raises(SystemExit):  # a ratio below 1 would leave the fastest instance itself
        build_parser().parse_args(["serve", "--routing-fallback-ratio", "0.5"])
    args = build_parser().parse_args(["engine", "--etcd", "h:1", "--instance-id", "e1", "--port", "0",
                                      "--lease-ttl", "3", "--heartbeat-interval", "0.5"])
    assert (args.etcd, args.instance_id, args.port, args.lease_ttl, args.heartbeat_interval) == ("h:1", "e1", 0,
                                                                                                3.0, 0.5)
    assert (args.host, args.drain_timeout, args.registry) == ("127.0.0.1", 30.0, None)


def test_routing_fallback_ratio_reaches_the_kv_aware_policy():
    from xllm.gateway.registry.embedded import EmbeddedRegistry
    from xllm.gateway.router import Router

    kv = Router(EmbeddedRegistry(), "kv_aware", fallback_ratio=50.0)
    assert kv.policy.fallback_ratio == 50.0 and kv.placement.prefill_policy.fallback_ratio == 50.0
    assert Router(EmbeddedRegistry(), "kv_aware").policy.fallback_ratio == 2.0  # the policy's default
    assert Router(EmbeddedRegistry(), "least_load", fallback_ratio=50.0).policy.name == "least_load"  # (no knob)


def test_engine_args_for_spawned_instances():
    args = build_parser().parse_args(["serve", "--instances", "2", "--dtype", "fp32", "--threads", "1",
                                      "--kv-cache-memory", "0.5", "--block-size", "32", "--no-prefix-cache",
                                      "--step-timeout", "7"])
    out = engine_args(args, 2)
    parsed = build_parser().parse_args(["engine", *out])
    assert (parsed.dtype, parsed.threads, parsed.kv_cache_memory, parsed.block_size) == ("fp32", 1, 0.5, 32)
    assert parsed.no_prefix_cache and parsed.step_timeout == 7.0
    default_threads = build_parser().parse_args(["engine", *engine_args(build_parser().parse_args(["serve"]), 64)])
    assert default_threads.threads == 1  # cores divided among instances, at least one each


def test_engine_rejects_two_registries(capsys):
    assert main(["engine", "--etcd", "h:1", "--registry", "h:2", "--no-progress"]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_etcd_without_a_cluster_credential_refuses_to_start(command, capsys, monkeypatch):
    """Checked before any model is resolved or loaded; --insecure-cluster gets past the check (and then fails
    on the missing model, which shows the check passed)."""
    monkeypatch.delenv("XLLM_CLUSTER_TOKEN", raising=False)
    argv = [command, "--model", "/nonexistent/model", "--etcd", "127.0.0.1:1", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in ("--cluster-token", "--cluster-token-file", "$XLLM_CLUSTER_TOKEN",
                                        "--insecure-cluster"))
    assert main([*argv, "--insecure-cluster"]) == 2
    assert "--insecure-cluster" not in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve", "--prefill-instances", "1", "--decode-instances", "1"], ["engine"]])
def test_mooncake_transfer_needs_the_store_tier(command, capsys):
    """Checked before any engine starts, not as a traceback from each spawned engine: hand-offs through
    the store go through the engines' T3 tier."""
    assert main([*command, "--kv-transfer", "mooncake", "--no-progress"]) == 2
    assert "--kv-store" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["e+p+d", "ED+P", "auto"])
def test_an_epd_strategy_needs_other_instances(strategy, smollm2_dir, capsys):
    """One process has nowhere else to encode: refused, not ignored."""
    assert main(["serve", "--model", str(smollm2_dir), "--epd-strategy", strategy, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--epd-strategy" in err and "--encode-instances" in err


def test_auto_epd_needs_both_slos(smollm2_dir, capsys):
    argv = ["serve", "--model", str(smollm2_dir), "--instances", "1", "--epd-strategy", "auto", "--no-progress"]
    assert main([*argv, "--slo-ttft-ms", "2000"]) == 2
    assert "--slo-tpot-ms" in capsys.readouterr().err


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
                                                                                     None, None, None)
    cfg = engine_config(args)
    assert cfg.dtype == torch.bfloat16 and cfg.quantization == "auto"  # a GGUF keeps its stored weights
    assert cfg.max_num_seqs == 64 and cfg.max_num_batched_tokens == 512
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


def test_request_limit_flags_reach_the_api_limits_the_engine_config_and_spawned_engines():
    from xllm.engine_api.bounds import RequestBounds
    from xllm.gateway.api_flags import api_limits

    assert engine_config(build_parser().parse_args(["serve"])).request_bounds == RequestBounds()
    values = ["--max-prompt-chars", "2000000", "--max-stop", "64", "--max-stop-chars", "1000",
              "--max-stop-token-ids", "512", "--max-logit-bias", "400"]
    args = build_parser().parse_args(["serve", "--instances", "2", *values])
    raised = RequestBounds(max_stop=64, max_stop_chars=1000, max_stop_token_ids=512, max_logit_bias=400,
                           max_grammar_chars=2000000)
    limits = api_limits(args)
    assert (limits.max_prompt_chars, limits.max_stop, limits.max_stop_chars, limits.max_stop_token_ids,
            limits.max_logit_bias) == (2000000, 64, 1000, 512, 400)
    assert engine_config(args).request_bounds == raised  # the embedded engine
    spawned = build_parser().parse_args(["engine", *engine_args(args, 2)])
    assert engine_config(spawned).request_bounds == raised
    assert engine_config(build_parser().parse_args(["engine", *values])).request_bounds == raised


def test_kv_tier_flags_reach_the_engine_config_and_spawned_engines():
    argv = ["--kv-host-memory", "2", "--kv-host-dir", "/dev/shm/x", "--kv-disk-dir", "/tmp/kv", "--kv-disk-size", "5",
            "--kv-store", "mooncake://10.0.0.1:50051", "--mooncake-metadata", "http://10.0.0.1:8080/metadata",
            "--kv-store-segment", "0.5"]
    args = build_parser().parse_args(["serve", *argv])
    cfg = engine_config(args)
    assert (cfg.kv_host_memory_gib, cfg.kv_host_dir, cfg.kv_disk_dir, cfg.kv_disk_size_gib) == (2, "/dev/shm/x",
                                                                                               "/tmp/kv", 5)
    assert (cfg.kv_store, cfg.kv_store_metadata, cfg.kv_store_segment_gib) == (
        "mooncake://10.0.0.1:50051", "http://10.0.0.1:8080/metadata", 0.5)
    assert all(flag in engine_args(args, 2) for flag in argv[::2])
    with pytest.raises(ConfigError, match="kv_store_metadata"):
        engine_config(build_parser().parse_args(["serve", "--kv-store", "mooncake://10.0.0.1:50051"]))
    with pytest.raises(ConfigError, match="mooncake://HOST:PORT"):
        engine_config(build_parser().parse_args(["serve", "--kv-store", "redis://x", "--mooncake-metadata", "u"]))


def _listening_addresses(port: int) -> set[str]:
    """Hex local addresses (/proc/net/tcp) listening on ``port`` (``0100007F``: 127.0.0.1)."""
    out = set()
    for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            out.add(addr)
    return out


def test_serve_starts_a_local_mooncake_store_on_loopback_for_its_engines():
    """``xllm serve --kv-store local-mooncake``: a master and a metadata server on loopback ports only,
    the engine flags pointed at them; an engine on its own refuses the value (it joins a store)."""
    from xllm.gateway.cli import start_local_store
    from xllm.testing.processes import ensure_mooncake

    ensure_mooncake()
    args = build_parser().parse_args(["serve", "--kv-store", "local-mooncake", "--kv-host-memory", "1"])
    store = start_local_store(args)
    try:
        master_port = int(store.address.rsplit(":", 1)[1])
        meta_port = int(store.metadata_url.split(":")[2].split("/")[0])
        assert args.kv_store == f"mooncake://127.0.0.1:{master_port}" and args.mooncake_metadata == store.metadata_url
        assert _listening_addresses(master_port) == {"0100007F"} == _listening_addresses(meta_port)
        cfg = engine_config(args)
        assert (cfg.kv_store, cfg.kv_store_metadata) == (args.kv_store, store.metadata_url)
        spawned = engine_args(args, 2)
        assert spawned[spawned.index("--kv-store") + 1] == args.kv_store
    finally:
        store.stop()
    assert store.master.poll() is not None and store.metadata.poll() is not None
    with pytest.raises(ValueError, match="local-mooncake starts a store for `xllm serve`"):
        engine_config(build_parser().parse_args(["engine", "--kv-store", "local-mooncake"]))
    assert start_local_store(build_parser().parse_args(["serve"])) is None


def test_serve_stopped_by_sigterm_stops_its_local_store(monkeypatch):
    """uvicorn re-raises the SIGTERM that stopped it after its shutdown; the store ``xllm serve`` started
    (in sessions of its own) must still be stopped, not orphaned."""
    import signal

    from xllm.gateway import cli
    from xllm.testing.processes import ensure_mooncake

    ensure_mooncake()
    started, real_start = [], cli.start_local_store
    monkeypatch.setattr(cli, "start_local_store", lambda args: started.append(real_start(args)) or started[-1])
    monkeypatch.setattr(cli, "_serve", lambda args: signal.raise_signal(signal.SIGTERM))  # as uvicorn ends
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        cli.serve(build_parser().parse_args(["serve", "--kv-store", "local-mooncake"]))
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert started and started[0].master.poll() is not None and started[0].metadata.poll() is not None
    assert signal.getsignal(signal.SIGTERM) == before


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
    ["serve", "--drain-moves", "sometimes"],
    ["serve", "--kv-bandwidth-prior", "0"],
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
    its flags, the cluster composition, the app, routing, the registries and the gRPC engine client.
    Nor the engine runtime (``xllm.core``) or the engine service's server half (``xllm.engine``)."""
    code = ("import sys\n"
            "from xllm.gateway.cli import build_parser\n"
            "import xllm.gateway.cluster, xllm.gateway.app, xllm.gateway.dispatch, xllm.engine_api.client\n"
            "args = build_parser().parse_args(['serve', '--etcd', 'h:1', '--instances', '2'])\n"
            "from xllm.engine_api.flags import engine_args\n"
            "engine_args(args, 2)\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded[:5]\n"
            "engine = sorted(m for m in sys.modules if m.split('.')[:2] in (['xllm', 'core'], ['xllm', 'engine']))\n"
            "assert not engine, engine\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ---- the OpenAI API's keys and limits (xllm.gateway.api_flags) ----------------------------------


def test_api_flags_defaults_are_the_documented_limits():
    from xllm.gateway.access import AccessPolicy
    from xllm.gateway.api_flags import access_policy, api_limits
    from xllm.gateway.openai.limits import ApiLimits

    args = build_parser().parse_args(["serve"])
    assert api_limits(args) == ApiLimits()
    assert access_policy(args, environ={}) == AccessPolicy()


def test_api_flags_build_limits_and_keys():
    from xllm.gateway.api_flags import access_policy, api_limits

    args = build_parser().parse_args(["serve", "--api-key", "k1", "--api-key", "k2", "--priority-api-key", "p1",
                                      "--max-inflight-requests", "7", "--max-body-mib", "0.5", "--max-prompt-chars",
                                      "1000", "--max-prompts", "3", "--max-n", "2", "--max-logprobs", "0"])
    limits = api_limits(args)
    assert (limits.max_inflight_requests, limits.max_body_bytes, limits.max_prompt_chars) == (7, 512 * 1024, 1000)
    assert (limits.max_prompts, limits.max_n, limits.max_logprobs) == (3, 2, 0)
    access = access_policy(args, environ={"XLLM_API_KEY": " k3 , ,k4"})
    assert access.api_keys == {"k1", "k2", "k3", "k4"} and access.priority_keys == {"p1"}
    assert not access.allow_client_priority
    assert access_policy(build_parser().parse_args(["serve"]), environ={"XLLM_API_KEY": "env-key"}).requires_key


@pytest.mark.parametrize("argv, message", [
    (["--api-key", ""], "non-empty"),
    (["--api-key", "k", "--allow-client-priority"], "--allow-client-priority"),
    (["--max-n", "200"], "max_n"),
    (["--max-logprobs", "21"], "max_logprobs"),
])
def test_bad_api_flags_are_clean_errors(argv, message, capsys):
    assert main(["serve", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xllm serve: error:") and message in err


@pytest.mark.parametrize("argv", [["serve", "--max-n", "0"], ["serve", "--max-body-mib", "0"],
                                  ["serve", "--max-inflight-requests", "-1"], ["serve", "--max-prompts", "x"]])
def test_api_flags_reject_bad_numbers(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_serve_passes_the_api_options_to_the_app(monkeypatch):
    """``xllm serve`` (embedded) hands the limits and keys of its flags to the gateway it builds."""
    import xllm.gateway.embedded as embedded
    import xllm.gateway.http_guard as http_guard

    built = []
    monkeypatch.setattr(embedded, "build_embedded", lambda opts: built.append(opts) or "app")
    monkeypatch.setattr(http_guard, "serve", lambda app, host, port, options, **kw: built.append((app, options)))
    monkeypatch.delenv("XLLM_API_KEY", raising=False)
    assert main(["serve", "--no-progress", "--api-key", "k", "--priority-api-key", "p", "--max-n", "3",
                 "--http-header-timeout-s", "7", "--step-timeout", "9"]) == 0
    opts, (app, http) = built
    assert app == "app" and http.header_timeout_s == 7.0 and opts.step_timeout == 9.0
    assert opts.limits.max_n == 3 and opts.access.api_keys == {"k"} and opts.access.priority_keys == {"p"}


def test_slo_and_offline_flags_reach_the_config_spawned_engines_and_access():
    from xllm.gateway.api_flags import access_policy

    args = build_parser().parse_args(["serve", "--slo-ttft-ms", "800", "--slo-tpot-ms", "60",
                                      "--offline-starvation-s", "5", "--offline-priority", "3",
                                      "--offline-slo-fraction", "0.5"])
    cfg = engine_config(args)
    assert (cfg.slo_ttft_ms, cfg.slo_tpot_ms, cfg.offline_starvation_s) == (800.0, 60.0, 5.0)
    assert cfg.offline_slo_fraction == 0.5
    spawned = engine_args(args, 2)
    assert spawned[spawned.index("--slo-tpot-ms") + 1] == "60.0"
    assert spawned[spawned.index("--offline-starvation-s") + 1] == "5.0"
    assert spawned[spawned.index("--offline-slo-fraction") + 1] == "0.5"
    assert access_policy(args, {}).offline_priority == 3
    defaults = engine_config(build_parser().parse_args(["serve"]))
    assert (defaults.slo_ttft_ms, defaults.slo_tpot_ms, defaults.offline_starvation_s) == (None, None, 30.0)
    assert defaults.offline_slo_fraction == DEFAULT_OFFLINE_SLO_FRACTION
    assert "--slo-tpot-ms" not in engine_args(build_parser().parse_args(["serve"]), 2)
    for argv in (["serve", "--slo-tpot-ms", "0"], ["serve", "--offline-starvation-s", "-1"],
                 ["serve", "--offline-slo-fraction", "0"], ["serve", "--offline-slo-fraction", "1.2"],
                 ["serve", "--pd-max-flips", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)


def test_pd_max_flips_reaches_the_role_policy():
    from xllm.gateway.cli import pd_role_options

    base = ["serve", "--pd-policy", "dynamic", "--slo-ttft-ms", "900", "--slo-tpot-ms", "80"]
    auto = pd_role_options(build_parser().parse_args(base)).build_policy()
    assert auto.max_flips_per_decision is None and auto.max_in_progress is None  # a tenth of the instances
    fixed = pd_role_options(build_parser().parse_args([*base, "--pd-max-flips", "3"])).build_policy()
    assert fixed.max_flips_per_decision == 3 and fixed.max_in_progress == 3


def test_pd_prefill_overflow_follows_the_ttft_objective_and_its_flag():
    from xllm.gateway.cli import pd_role_options

    on = pd_role_options(build_parser().parse_args(["serve", "--slo-ttft-ms", "900"]))
    assert on.prefill_overflow and on.overflow_slo_ttft_s == 0.9  # static roles too
    assert pd_role_options(build_parser().parse_args(["serve"])).overflow_slo_ttft_s is None  # no objective
    off = pd_role_options(build_parser().parse_args(["serve", "--slo-ttft-ms", "900", "--no-pd-prefill-overflow"]))
    assert not off.prefill_overflow and off.overflow_slo_ttft_s is None

"""The ``xllm`` command line: every flag documented, parsed and validated."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from xllm.gateway.cli import _engine_config, build_parser, main

SERVE_FLAGS = ["--model", "--served-model-name", "--host", "--port", "--dtype", "--max-num-seqs",
               "--max-num-batched-tokens", "--max-model-len", "--kv-cache-memory", "--max-waiting", "--device",
               "--threads", "--seed", "--no-progress", "--log-level", "--kv-cache-backend", "--block-size",
               "--no-prefix-cache"]


def _serve_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["serve"]


def test_every_serve_flag_has_help():
    serve = _serve_parser()
    documented = {opt: a for a in serve._actions for opt in a.option_strings}
    assert set(SERVE_FLAGS) <= set(documented)
    for action in serve._actions:
        if action.option_strings == ["-h", "--help"]:
            continue
        assert action.help and len(action.help) > 10, action.option_strings
    assert set(documented) - {"-h", "--help"} == set(SERVE_FLAGS), "a new flag needs a test entry"


def test_serve_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in SERVE_FLAGS:
        assert flag in out, flag
    assert "(default: 8000)" in out  # defaults are shown


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
    cfg = _engine_config(args)
    assert cfg.dtype == torch.bfloat16
    assert cfg.max_num_seqs == 64 and cfg.max_num_batched_tokens == 2048
    assert cfg.max_model_len is None and cfg.kv_cache_memory_gib == 2.0
    assert cfg.max_waiting_requests == 4096 and cfg.num_threads is None and cfg.seed == 0


def test_flags_reach_the_engine_config():
    args = build_parser().parse_args(["serve", "--dtype", "fp32", "--max-num-seqs", "8", "--max-num-batched-tokens",
                                      "256", "--max-model-len", "512", "--kv-cache-memory", "0.5",
                                      "--max-waiting", "10", "--threads", "2", "--seed", "7", "--device", "cpu"])
    cfg = _engine_config(args)
    assert cfg.dtype == torch.float32
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (8, 256, 512)
    assert (cfg.kv_cache_memory_gib, cfg.max_waiting_requests, cfg.num_threads, cfg.seed) == (0.5, 10, 2, 7)


@pytest.mark.parametrize("argv", [
    ["serve", "--max-num-seqs", "0"],
    ["serve", "--max-model-len", "-5"],
    ["serve", "--kv-cache-memory", "0"],
    ["serve", "--port", "http"],
    ["serve", "--dtype", "int8"],
    ["serve", "--log-level", "loud"],
    ["serve", "--bogus"],
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

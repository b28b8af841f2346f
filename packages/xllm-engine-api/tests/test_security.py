"""Cluster security without a server (:mod:`xllm.engine_api.security`): the bind policy, how the flags
resolve the token and the TLS files, and the token check. Served engines with a token and TLS:
packages/xllm-engine/tests/test_security.py."""

from __future__ import annotations

import argparse
import secrets

import pytest

from xllm.engine_api import flags
from xllm.engine_api.security import (
    NO_SECURITY,
    TOKEN_ENV,
    ClusterSecurity,
    SecurityConfigError,
    TokenCheck,
    is_loopback,
)

TOKEN = "t" + secrets.token_urlsafe(24)  # never starting with "-" (argparse would read an option)
OTHER = "o" + secrets.token_urlsafe(24)


def test_internal_services_bind_non_loopback_only_with_a_token():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.7", "example.org"))
    with pytest.raises(SecurityConfigError, match="--cluster-token"):
        NO_SECURITY.check_bind("0.0.0.0", "the engine service")
    ClusterSecurity(token=TOKEN).check_bind("0.0.0.0", "the engine service")
    NO_SECURITY.check_bind("127.0.0.1", "the engine service")  # the single-machine default needs nothing


def test_the_token_comes_from_the_flag_the_file_or_the_environment(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    flags.add_engine_process_arguments(parser)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert flags.cluster_security(parser.parse_args([])).token is None
    monkeypatch.setenv(TOKEN_ENV, OTHER)
    assert flags.cluster_security(parser.parse_args([])).token == OTHER
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n")
    assert flags.cluster_security(parser.parse_args(["--cluster-token-file", str(path)])).token == TOKEN
    assert flags.cluster_security(parser.parse_args(["--cluster-token", TOKEN])).token == TOKEN
    for argv, message in ((["--cluster-token", TOKEN, "--cluster-token-file", str(path)], "not both"),
                          (["--cluster-token", "short"], "at least 16"),
                          (["--cluster-token", "x" * 20 + " y"], "printable"),
                          (["--cluster-token-file", str(tmp_path / "missing")], "--cluster-token-file"),
                          (["--tls-cert", "c.pem"], "--tls-key")):
        with pytest.raises(SecurityConfigError, match=message):
            flags.cluster_security(parser.parse_args(argv))
    security = flags.cluster_security(parser.parse_args(["--cluster-token", TOKEN, "--tls-cert", "c.pem",
                                                         "--tls-key", "k.pem", "--tls-ca", "ca.pem"]))
    assert TOKEN not in repr(security)
    spawned = flags.security_args(security)  # what a spawned engine's command line gets: never the token
    assert spawned == ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"]
    assert security.environment() == {TOKEN_ENV: TOKEN}
    with pytest.raises(SecurityConfigError, match="--tls-cert"):  # files are read at start-up, naming the flag
        security.check_files()
    with pytest.raises(SecurityConfigError, match="--etcd-ca"):
        ClusterSecurity(etcd_ca=str(tmp_path / "missing.pem")).check_files()


def test_the_token_check_compares_the_whole_value():
    check = TokenCheck(TOKEN)
    assert check.admits((("authorization", f"Bearer {TOKEN}"),))
    assert check.admits((("x-other", "1"), ("authorization", f"Bearer {TOKEN}")))
    for value in (TOKEN, f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"bearer {TOKEN}", ""):
        assert not check.admits((("authorization", value),))
    assert not check.admits(None) and not check.admits(())

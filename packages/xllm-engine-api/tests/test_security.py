"""Cluster security without a server (:mod:`xllm.engine_api.security`): the bind policy, how the flags
resolve the token and the TLS files, the per-call proof check, and --etcd refused without a credential
unless --insecure-cluster. Served engines with a token and TLS: packages/xllm-engine/tests/test_security.py;
the proofs themselves: test_credential.py."""

from __future__ import annotations

import argparse
import secrets

import pytest

from xllm.engine_api import flags
from xllm.engine_api.credential import PROOF_KEY, ClusterKeys, make_proof
from xllm.engine_api.security import (
    NO_SECURITY,
    TOKEN_ENV,
    CallCheck,
    ClusterSecurity,
    SecurityConfigError,
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


def test_the_call_check_wants_one_fresh_proof_of_the_method_and_never_the_token():
    check = CallCheck(ClusterKeys.from_token(TOKEN))
    method = "/xllm.engine.v1.EngineService/Generate"
    proof = make_proof(ClusterKeys.from_token(TOKEN), method)
    assert TOKEN not in proof
    assert check.admits(((PROOF_KEY, proof),), method) is None
    assert check.admits(((PROOF_KEY, proof),), method) == "replayed"  # a captured proof, sent again
    fresh = make_proof(ClusterKeys.from_token(TOKEN), method)
    assert check.admits(((PROOF_KEY, fresh),), "/xllm.engine.v1.EngineService/Abort") == "bad_mac"  # another method
    assert check.admits(((PROOF_KEY, make_proof(ClusterKeys.from_token(OTHER), method)),), method) == "bad_mac"
    assert check.admits(((PROOF_KEY, fresh), (PROOF_KEY, fresh)), method) == "missing"  # exactly one proof
    for metadata in (None, (), (("authorization", f"Bearer {TOKEN}"),), ((PROOF_KEY, "v1.1.2.3"),)):
        assert check.admits(metadata, method) in ("missing", "malformed")
    assert check.admits(((PROOF_KEY, fresh),), method) is None


def test_etcd_without_a_credential_refuses_to_start_unless_insecure_cluster(monkeypatch, caplog):
    parser = argparse.ArgumentParser()
    flags.add_engine_process_arguments(parser)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    security = flags.cluster_security(parser.parse_args(["--etcd", "127.0.0.1:2379"]))
    with pytest.raises(SecurityConfigError) as refused:
        security.check_cluster("127.0.0.1:2379", "xllm engine")
    for name in ("--cluster-token", "--cluster-token-file", TOKEN_ENV, "--insecure-cluster"):
        assert name in str(refused.value)
    security.check_cluster(None, "xllm engine")  # no etcd: the loopback default needs nothing
    flags.cluster_security(parser.parse_args(["--cluster-token", TOKEN])).check_cluster("h:1", "xllm engine")
    insecure = flags.cluster_security(parser.parse_args(["--etcd", "h:1", "--insecure-cluster"]))
    insecure.check_cluster("h:1", "xllm engine")
    assert "--insecure-cluster" in caplog.text and "NOT verified" in caplog.text
    assert flags.security_args(insecure) == ["--insecure-cluster"]  # spawned engines get it too

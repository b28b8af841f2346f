"""The proofs members of a cluster give without sending the token (:mod:`xllm.engine_api.credential`):
signed instance records (another credential, an altered field, another lease, too old: refused), per-call
proofs (a captured one refused later, a second time, when the server forgot older nonces), and the
``Prove`` answer bound to the challenge, the instance id and its address."""

from __future__ import annotations

import secrets

import pytest

from xllm.engine_api.credential import (
    PROOF_KEY,
    ClusterKeys,
    ProofCheck,
    RecordRefusedError,
    make_proof,
    new_nonce,
    prove_mac,
    proven,
    sign_record,
    verify_record,
)
from xllm.proto.registry.v1 import instance_pb2

TOKEN = secrets.token_urlsafe(24)
KEYS = ClusterKeys.from_token(TOKEN)
OTHER = ClusterKeys.from_token(secrets.token_urlsafe(24))
METHOD = "/xllm.engine.v1.EngineService/Generate"


def record(address: str = "10.0.0.7:7001") -> instance_pb2.InstanceInfo:
    return instance_pb2.InstanceInfo(instance_id="e0", address=address, role=instance_pb2.INSTANCE_ROLE_MIXED,
                                     model=instance_pb2.ModelInfo(served_name="m", block_size=16, max_model_len=64))


def refusal(info: instance_pb2.InstanceInfo, **kw) -> str:
    with pytest.raises(RecordRefusedError) as refused:
        verify_record(KEYS, info, **kw)
    return refused.value.reason


def test_keys_are_derived_per_purpose_and_never_the_token():
    assert len({KEYS.record, KEYS.call, KEYS.prove}) == 3
    assert all(TOKEN.encode() not in key for key in (KEYS.record, KEYS.call, KEYS.prove))
    assert ClusterKeys.from_token(TOKEN) == KEYS and KEYS != OTHER and TOKEN not in repr(KEYS)


def test_a_record_verifies_only_as_signed_by_a_holder_for_its_lease_and_while_fresh():
    signed = sign_record(KEYS, record(), lease=0x1234, now=1000.0)
    verify_record(KEYS, signed, lease=0x1234)
    verify_record(KEYS, signed, max_age=60, now=1059.0)
    assert refusal(record()) == "unsigned"
    assert refusal(sign_record(OTHER, record(), lease=0x1234)) == "bad_signature"  # another credential
    for change in ("address", "instance_id", "role", "model", "issued_at", "lease"):
        altered = instance_pb2.InstanceInfo()
        altered.CopyFrom(signed)
        if change == "address":
            altered.address = "10.6.6.6:7001"  # the attacker's address under a real signature
        elif change == "instance_id":
            altered.instance_id = "e1"
        elif change == "role":
            altered.role = instance_pb2.INSTANCE_ROLE_DECODE
        elif change == "model":
            altered.model.served_name = "other"
        elif change == "issued_at":
            altered.signature.issued_at += 3600  # made to look fresh
        else:
            altered.signature.lease = 0x9999  # moved to the attacker's own lease
        assert refusal(altered, lease=altered.signature.lease) == "bad_signature", change
    assert refusal(signed, lease=0x9999) == "wrong_lease"  # the same bytes written again under another lease
    assert refusal(signed, lease=0) == "wrong_lease"  # ... or under none
    assert refusal(signed, max_age=60, now=1061.0) == "stale"
    assert refusal(signed, max_age=60, now=939.0) == "stale"  # from the future


def test_a_captured_call_proof_is_refused_later_again_and_for_another_method():
    t = [10_000.0]
    check = ProofCheck(KEYS, window=30, clock=lambda: t[0])
    proof = make_proof(KEYS, METHOD, now=t[0])
    assert TOKEN not in proof and PROOF_KEY == "xllm-proof"
    assert check.check(proof, METHOD) is None
    assert check.check(proof, METHOD) == "replayed"
    late = make_proof(KEYS, METHOD, now=t[0])
    t[0] += 31  # replayed after the window: refused though never used
    assert check.check(late, METHOD) == "expired"
    assert check.check(make_proof(KEYS, METHOD, now=t[0]), METHOD) is None
    assert check.check(make_proof(KEYS, METHOD, now=t[0] + 60), METHOD) == "expired"  # from the future
    assert check.check(make_proof(OTHER, METHOD, now=t[0]), METHOD) == "bad_mac"
    assert check.check(make_proof(KEYS, "/xllm.engine.v1.EngineService/Abort", now=t[0]), METHOD) == "bad_mac"
    assert check.check(proof.encode(), METHOD) == "expired"
    for bad in ("", "v1", "v2.1.00.00", f"v1.{int(t[0] * 1000)}.zz.00", f"v1.{int(t[0] * 1000)}.00.00"):
        assert check.check(bad, METHOD) in ("missing", "malformed")


def test_a_full_nonce_memory_refuses_what_it_forgot_rather_than_admitting_a_replay():
    t = [5_000.0]
    check = ProofCheck(KEYS, window=30, max_remembered=4, clock=lambda: t[0])
    proofs = [make_proof(KEYS, METHOD, now=t[0] - 10 + i) for i in range(6)]
    assert [check.check(p, METHOD) for p in proofs] == [None] * 6
    assert [check.check(p, METHOD) for p in proofs] == ["expired", "expired", "replayed", "replayed", "replayed",
                                                        "replayed"]
    assert len(check._seen) <= 4
    assert check.check(make_proof(KEYS, METHOD, now=t[0]), METHOD) is None  # new calls still pass


def test_prove_answers_bind_the_challenge_the_instance_and_its_address():
    nonce = new_nonce()
    mac = prove_mac(KEYS, nonce, "e0", "10.0.0.7:7001")
    assert proven(KEYS, nonce, "e0", "10.0.0.7:7001", mac)
    assert not proven(KEYS, new_nonce(), "e0", "10.0.0.7:7001", mac)  # an old answer to a new challenge
    assert not proven(KEYS, nonce, "e1", "10.0.0.7:7001", mac)
    assert not proven(KEYS, nonce, "e0", "10.6.6.6:7001", mac)  # relayed from another address
    assert not proven(KEYS, nonce, "e0", "10.0.0.7:7001", prove_mac(OTHER, nonce, "e0", "10.0.0.7:7001"))

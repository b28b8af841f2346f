import subprocess
import sys

from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc
from xllm.proto.registry.v1 import instance_pb2


def test_engine_service_methods():
    service = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Abort", "Health", "GetLoad", "GetKVEvents", "TransferKV", "Migrate",
                            "Prove", "Reattach", "LoadLora", "Embed", "Control", "Encode"}
    assert methods["Reattach"].server_streaming and not methods["Reattach"].client_streaming
    assert methods["Reattach"].output_type.full_name == "xllm.engine.v1.GenerateResponse"
    assert not methods["Prove"].client_streaming and not methods["Prove"].server_streaming
    assert methods["Prove"].output_type.full_name == "xllm.engine.v1.ProveResponse"
    assert not methods["Migrate"].client_streaming and not methods["Migrate"].server_streaming
    assert methods["Migrate"].output_type.full_name == "xllm.engine.v1.MigrateResponse"
    assert methods["TransferKV"].client_streaming and not methods["TransferKV"].server_streaming
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert methods["GetLoad"].output_type.full_name == "xllm.registry.v1.LoadReport"
    assert hasattr(engine_pb2_grpc, "EngineServiceStub") and hasattr(engine_pb2_grpc, "EngineServiceServicer")


def test_registry_service_and_kv_events():
    from xllm.proto.kvstore.v1 import kv_events_pb2
    from xllm.proto.registry.v1 import registry_pb2, registry_pb2_grpc

    service = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"]
    assert {m.name for m in service.methods} == {"Register", "Heartbeat", "Deregister"}
    assert hasattr(registry_pb2_grpc, "RegistryServiceStub")
    hb = instance_pb2.Heartbeat(instance_id="e0", seq=3, kv_events=kv_events_pb2.KVCacheEvents(
        epoch=1, base_version=2, version=5, stored=[2**64 - 1], removed=[7]))
    assert instance_pb2.Heartbeat.FromString(hb.SerializeToString()) == hb
    signature = instance_pb2.Heartbeat.DESCRIPTOR.fields_by_name["signature"]  # signed heartbeats (issue 50)
    assert signature.number == 9 and signature.message_type.full_name == "xllm.registry.v1.RecordSignature"
    assert kv_events_pb2.DESCRIPTOR.package == "xllm.kvstore.v1"
    methods = {m.name: m for m in engine_pb2.DESCRIPTOR.services_by_name["EngineService"].methods}
    assert methods["GetKVEvents"].output_type.full_name == "xllm.kvstore.v1.KVCacheEvents"


def test_packages_are_versioned():
    assert engine_pb2.DESCRIPTOR.package == "xllm.engine.v1"
    assert instance_pb2.DESCRIPTOR.package == "xllm.registry.v1"


def test_optional_fields_track_presence():
    sp = engine_pb2.SamplingParams(max_tokens=8)
    assert not sp.HasField("temperature") and not sp.HasField("seed")
    sp.temperature = 0.0
    assert sp.HasField("temperature")  # an explicit 0 (greedy) differs from "unset" (1.0)


def test_round_trip_generate_messages():
    req = engine_pb2.GenerateRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3], priority=-1, model="m", arrival_time=1.5,
        sampling=engine_pb2.SamplingParams(max_tokens=4, top_k=5, stop=["\n"], logit_bias={7: -100.0}, seed=2**63))
    assert engine_pb2.GenerateRequest.FromString(req.SerializeToString()) == req
    resp = engine_pb2.GenerateResponse(
        request_id="r1", token_ids=[9], text="hi", finish_reason=engine_pb2.FINISH_REASON_LENGTH,
        logprobs=[engine_pb2.TokenLogprob(token_id=9, logprob=-0.5, top=[engine_pb2.TopLogprob(token_id=9,
                                                                                              logprob=-0.5)])],
        usage=engine_pb2.Usage(prompt_tokens=3, completion_tokens=1))
    assert engine_pb2.GenerateResponse.FromString(resp.SerializeToString()) == resp


def test_contracts_import_without_torch():
    code = "import sys, xllm.proto.engine.v1.engine_pb2_grpc; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_finish_reason_names_cover_every_enum_value():
    from xllm.proto.enums import finish_reason_name

    values = engine_pb2.FinishReason.values()
    assert finish_reason_name(engine_pb2.FINISH_REASON_UNSPECIFIED) is None
    names = {finish_reason_name(v) for v in values if v != engine_pb2.FINISH_REASON_UNSPECIFIED}
    assert names == {"stop", "length", "abort", "error", "handed_off"}
    assert len(values) == 6, "a new FinishReason needs its API name in xllm.proto.enums"
    assert finish_reason_name(99) == "stop"  # a value from a newer engine still ends the request


def test_role_names_round_trip():
    from xllm.proto.enums import role_from_name, role_name

    for name in ("mixed", "prefill", "decode", "encode"):
        assert role_name(role_from_name(name)) == name
    assert role_name(instance_pb2.INSTANCE_ROLE_UNSPECIFIED) == "mixed"
    import pytest

    with pytest.raises(ValueError, match="prefill"):
        role_from_name("vision")

"""Protobuf and gRPC contracts of xLLM: the code generated from top-level ``proto/``.

Do not edit the ``*_pb2*.py`` files: run ``nox -s proto`` to regenerate them.

- ``xllm.proto.engine.v1``: the engine service (Generate, Abort, Health, GetLoad, GetKVEvents),
  sampling parameters and streamed token outputs.
- ``xllm.proto.registry.v1``: instance info, load reports, heartbeats, the registry service.
- ``xllm.proto.kvstore.v1``: versioned KV cache events.
- :mod:`xllm.proto.enums` (hand-written): the names enum values have outside the wire.
"""

"""Generated protobuf and gRPC code for the xLLM contracts in top-level ``proto/``.

Do not edit the ``*_pb2*.py`` files: run ``nox -s proto`` to regenerate them.

- ``xllm.proto.engine.v1``: the engine service (Generate, Abort, Health, GetLoad),
  sampling parameters and streamed token outputs.
- ``xllm.proto.registry.v1``: instance info and load reports.
"""

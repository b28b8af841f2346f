"""Prefill/decode hand-off of KV between engine instances.

- :mod:`~xllm.engine.handoff.manager`: :class:`HandoffManager`, both sides of every hand-off of one
  engine (reservations, sending, installing, timeouts, counters);
- :mod:`~xllm.engine.handoff.base`: the transport contract and the checks byte transports share;
- transports, by name in :data:`xllm.engine_api.names.KV_TRANSPORTS` (``--kv-transfer``): ``fd`` (one host: the prefill
  instance's memfd passed over a Unix socket, pages copied in the kernel), ``grpc`` (blocks streamed
  over the engines' gRPC service, CRC-checked), ``mooncake`` (blocks through a Mooncake store, then
  the commit over gRPC).
"""

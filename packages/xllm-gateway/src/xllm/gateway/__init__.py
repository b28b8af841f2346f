"""The xLLM service: OpenAI-compatible API, instance registry, routing, metrics, CLI.

Public API: :func:`xllm.gateway.app.create_app`, :func:`xllm.gateway.server.build_embedded`,
:class:`xllm.gateway.registry.EmbeddedRegistry`, the ``xllm`` CLI (:mod:`xllm.gateway.cli`).
"""

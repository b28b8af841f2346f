"""The xLLM service: OpenAI-compatible API, instance registry, routing, metrics, CLI.

Public API: :func:`xllm.gateway.app.create_app`, :func:`xllm.gateway.server.build_embedded`
(one process), :func:`xllm.gateway.cluster.build_cluster` (gateway over engine processes),
:mod:`xllm.gateway.instance` (one engine instance process), the registries
(:class:`xllm.gateway.registry.EmbeddedRegistry`, :class:`xllm.gateway.registry.EtcdRegistry`),
:class:`xllm.gateway.router.Router`, the ``xllm`` CLI (:mod:`xllm.gateway.cli`).
"""
